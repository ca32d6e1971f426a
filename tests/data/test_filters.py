"""Repetition filter: same reported sequences and decisions as OLMo-core's find_periodic_sequences."""

from __future__ import annotations

import numpy as np
import pytest

from olmax.data.filters import RepetitionFilter, find_periodic_sequences, is_valid_instance
from helpers.reference import require



def _oc_find(arr, max_period, min_period):
    oc_utils = require("olmo_core.data.utils")
    return oc_utils.find_periodic_sequences(np.asarray(arr, dtype=np.int64), max_period, min_period)


def oc_sequences(arr, max_period=13, min_period=1):
    return [tuple(int(x) for x in r) for r in _oc_find(arr, max_period, min_period)]


def oc_valid(arr, max_period=13, min_period=1, max_count=32):
    return all(r.times < max_count for r in _oc_find(arr, max_period, min_period))


def crafted():
    """Hand-made cases: runs at row edges, exact multiples, whole-array repeats, short arrays."""
    rng = np.random.default_rng(0)
    cases = [
        np.zeros(96, dtype=np.int64),                       # one token repeated, n % p == 0 for many p
        np.zeros(97, dtype=np.int64),
        np.tile([1, 2, 3], 40),                             # period 3 exactly 40 times
        np.tile([1, 2, 3], 31),                             # 31 times: just below the limit
        np.tile([1, 2, 3], 32),                             # 32 times: at the limit
        np.concatenate([[9, 8], np.tile([5, 6, 7, 5], 33), [4]]),  # period 4 starting mid-row
        np.tile(np.arange(13), 35),                         # the longest default period
        np.tile(np.arange(14), 35),                         # period 14: outside the range
        np.array([1, 1], dtype=np.int64),                   # shorter than 3
        np.array([1, 1, 1], dtype=np.int64),
        np.array([], dtype=np.int64),
    ]
    for period in range(1, 15):
        for count in (3, 31, 32, 33):
            for lead in (0, 1, period - 1, 5):
                block = np.tile(rng.integers(100, 200, period), count)
                arr = np.concatenate([rng.integers(1000, 2000, lead), block, rng.integers(1000, 2000, 7)])
                cases.append(arr)
    return cases


@pytest.mark.reference
def test_crafted_sequences_and_decisions():
    cases = crafted()
    decisions = []
    for arr in cases:
        assert [tuple(r) for r in find_periodic_sequences(arr, 13, 1)] == oc_sequences(arr)
        decisions.append(is_valid_instance(arr))
        assert decisions[-1] == oc_valid(arr)
        for lo, hi, cnt in ((2, 5, 10), (1, 3, 4)):
            assert is_valid_instance(arr, hi, lo, cnt) == oc_valid(arr, hi, lo, cnt)
    assert any(decisions) and not all(decisions)


@pytest.mark.reference
@pytest.mark.parametrize("seed", range(4))
def test_random_data_decisions(seed):
    """Random low-entropy token streams (small alphabets make accidental repeats common)."""
    rng = np.random.default_rng(seed)
    n_invalid = 0
    for trial in range(60):
        n = int(rng.integers(10, 600))
        alphabet = int(rng.integers(1, 4))
        arr = rng.integers(0, alphabet, n)
        if trial % 3 == 0:  # splice in a long exact repeat
            p = int(rng.integers(1, 16))
            c = int(rng.integers(2, 60))
            s = int(rng.integers(0, n))
            arr = np.concatenate([arr[:s], np.tile(rng.integers(0, 50, p), c), arr[s:]])
        assert [tuple(r) for r in find_periodic_sequences(arr, 13, 1)] == oc_sequences(arr)
        valid = RepetitionFilter().is_valid(arr)
        assert valid == oc_valid(arr)
        n_invalid += not valid
    assert 0 < n_invalid < 60


def test_mask_value_in_array_rejected():
    with pytest.raises(ValueError):
        list(find_periodic_sequences(np.array([1, -1, 2]), 13))
