"""Shared fixtures for evaluation tests: a tiny OLMo 3 shape (GQA, a window shorter than the text)."""

import jax
import pytest

from olmax.model.params import init_params

from helpers.tiny import tiny_cfg


@pytest.fixture(scope="session")
def tiny():
    cfg = tiny_cfg()
    return cfg, init_params(cfg, jax.random.key(7))
