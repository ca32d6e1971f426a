"""Fixtures for the data tests."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.datahelp import VOCAB, write_tokens


@pytest.fixture
def make_files(tmp_path):
    """make_files([n_tokens, ...], seed, prefix=...) -> paths of random token files of those sizes."""

    def make(sizes, seed=0, high=VOCAB, prefix="part"):
        rng = np.random.default_rng(seed)
        return [write_tokens(tmp_path / f"{prefix}-{i:03d}.npy", rng.integers(0, high, n))
                for i, n in enumerate(sizes)]

    return make

