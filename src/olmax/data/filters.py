"""The OLMo-core repetition filter (``InstanceFilterConfig``), applied as an instance (loss) mask.

Same algorithm and decisions as OLMo-core ``data/utils.py: find_periodic_sequences`` and
``NumpyDatasetBase._validate_instance``: for each period p in ``[min_period, min(max_period, n // 3)]``
the instance is padded with ``mask_value`` to ``(n // p + 1) * p`` tokens (a full extra row when
``n % p == 0``), reshaped to rows of p, and each row is compared with the previous one (``np.roll``,
so row 0 is compared with the padded last row). Each run of consecutive all-equal rows
``[s, e]`` is one periodic sequence: it starts ``(s - 1) * p - t`` (t = trailing equal entries of row
``s - 1``) and ends, exclusive, at ``(e + 1) * p + l`` (l = leading equal entries of row ``e + 1``);
``times = (end - start) // p``, and only ``times > 2`` is reported. An instance is invalid when any
reported sequence repeats ``times >= max_count`` times. OLMo 3 7B ran without the filter; its
defaults are period 1..13, count 32.

An invalid instance keeps its tokens; the trainer masks all of its labels (``instance_mask=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np


class Repetition(NamedTuple):
    start: int
    end: int  # exclusive
    period: int
    times: int


@dataclass(frozen=True)
class RepetitionFilter:
    """OLMo-core ``InstanceFilterConfig`` defaults (also the values in OLMo-core's OLMo3-7B script)."""

    max_period: int = 13
    min_period: int = 1
    max_count: int = 32

    def is_valid(self, ids: np.ndarray) -> bool:
        return is_valid_instance(ids, self.max_period, self.min_period, self.max_count)


def _leading_true(row: np.ndarray) -> int:
    """Number of leading True entries."""
    if row.all():
        return row.size
    return int(np.argmin(row))


def find_periodic_sequences(arr: np.ndarray, max_period: int, min_period: int = 1,
                            mask_value: int = -1) -> Iterator[Repetition]:
    """Periodic sequences repeated at least 3 times, as OLMo-core reports them (same order)."""
    arr = np.asarray(arr).astype(np.int64, copy=False)
    if np.any(arr == mask_value):
        raise ValueError("`mask_value` is in the array")
    n = arr.shape[0]
    for period in range(min_period, min(max_period, n // 3) + 1):
        rows = n // period + 1
        padded = np.full(rows * period, mask_value, dtype=np.int64)
        padded[:n] = arr
        shaped = padded.reshape(rows, period)
        eq = shaped == np.roll(shaped, 1, axis=0)
        full = np.flatnonzero(eq.all(axis=1))
        if full.size == 0:
            continue
        breaks = np.flatnonzero(np.diff(full) != 1)
        run_starts = full[np.concatenate(([0], breaks + 1))]
        run_ends = full[np.concatenate((breaks, [full.size - 1]))]
        for s, e in zip(run_starts.tolist(), run_ends.tolist()):
            trailing = _leading_true(eq[s - 1][::-1])
            start_offset = trailing if trailing < period else 0  # OLMo-core's -1/0 convention
            end_offset = _leading_true(eq[e + 1])
            start = (s - 1) * period - start_offset
            end = (e + 1) * period + end_offset
            times = (end - start) // period
            if times > 2:
                yield Repetition(start, end, period, times)


def _may_repeat(arr: np.ndarray, max_period: int, min_period: int, max_count: int) -> bool:
    """A necessary condition for an invalid instance, cheap to test.

    A sequence reported with period p spanning ``[start, end)`` has ``x[i] == x[i - p]`` for every
    i in ``[start + p, end)`` (its rows equal their previous rows, and the offsets extend that by the
    matching tail/head entries; padding never matches). So ``times >= max_count`` needs a run of at
    least ``(max_count - 1) * p`` consecutive such positions. Without one for any p, the instance is
    valid; otherwise the exact algorithm decides.
    """
    n = arr.shape[0]
    for p in range(min_period, min(max_period, n // 3) + 1):
        need = (max_count - 1) * p
        eq = arr[p:] == arr[:-p]
        if int(eq.sum()) < need:
            continue
        breaks = np.flatnonzero(~eq)
        bounds = np.concatenate(([-1], breaks, [eq.size]))
        if int(np.max(np.diff(bounds))) - 1 >= need:
            return True
    return False


def is_valid_instance(ids: np.ndarray, max_period: int = 13, min_period: int = 1,
                      max_count: int = 32) -> bool:
    """False when some period in range repeats ``>= max_count`` times (OLMo-core ``_validate_instance``)."""
    arr = np.asarray(ids).astype(np.int64, copy=False)
    if max_count > 2 and not _may_repeat(arr, max_period, min_period, max_count):
        return True
    return all(r.times < max_count for r in find_periodic_sequences(arr, max_period, min_period))


def instance_mask(tokens: np.ndarray, flt: RepetitionFilter | None) -> np.ndarray:
    """Per-row validity for a ``[B, T]`` batch; all True without a filter."""
    if flt is None:
        return np.ones(tokens.shape[0], dtype=np.bool_)
    return np.fromiter((flt.is_valid(row) for row in tokens), dtype=np.bool_, count=tokens.shape[0])
