import os
from pathlib import Path

import pytest

from helpers.trainrun import STEPS, train


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent JAX compilation cache for every ``olmax train`` subprocess of the session
    (the same program compiles to the same executable; this only saves compile time)."""
    old = os.environ.get("OLMAX_FAULT_JAX_CACHE")
    os.environ["OLMAX_FAULT_JAX_CACHE"] = str(tmp_path_factory.mktemp("jax-cache"))
    yield
    if old is None:
        os.environ.pop("OLMAX_FAULT_JAX_CACHE", None)
    else:
        os.environ["OLMAX_FAULT_JAX_CACHE"] = old


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """An uninterrupted run on 1 process x 8 devices: steps 1..12, checkpoints every 3 steps."""
    d = tmp_path_factory.mktemp("reference")
    train(d, [f"train.max_steps={STEPS}", "checkpoint.interval=3"], devices=8)
    return d
