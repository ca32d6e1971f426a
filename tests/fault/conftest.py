import fcntl
import json
import os
from pathlib import Path

import pytest

from helpers import trainrun
from helpers.trainrun import EVAL_AT_END, STEPS, make_byte_corpus, train, train_multiprocess


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent JAX compilation cache for every ``olmax train`` subprocess: the run's
    (``scripts/test`` sets ``JAX_COMPILATION_CACHE_DIR`` for its workers), else one of this
    session's (the same program compiles to the same executable; this only saves compile time)."""
    old = os.environ.get("OLMAX_FAULT_JAX_CACHE")
    os.environ["OLMAX_FAULT_JAX_CACHE"] = (os.environ.get("JAX_COMPILATION_CACHE_DIR")
                                           or str(tmp_path_factory.mktemp("jax-cache")))
    yield
    if old is None:
        os.environ.pop("OLMAX_FAULT_JAX_CACHE", None)
    else:
        os.environ["OLMAX_FAULT_JAX_CACHE"] = old


def _made_once(tmp_path_factory, name: str, make) -> Path:
    """``make(directory)`` once for the whole run, whichever of the 2 workers asks first (the
    others wait for it); the directory, only read by the tests."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):   # the workers' base folders share a parent
        root = root.parent
    d = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"{name}.done").exists():
            make(d)
            (root / f"{name}.done").touch()
    return d


@pytest.fixture(scope="session", autouse=True)
def byte_corpus(tmp_path_factory):
    """Every ``olmax train`` of these tests trains on :func:`helpers.trainrun.make_byte_corpus`'s
    data, made once for the run."""
    root = _made_once(tmp_path_factory, "fault-byte-corpus", make_byte_corpus)
    trainrun.DATA[:] = json.loads((root / "overrides.json").read_text())
    yield root
    trainrun.DATA.clear()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """An uninterrupted run on 1 process x 8 devices: steps 1..STEPS, checkpoints every 3 steps,
    the in-loop evaluation at the end."""
    return _made_once(tmp_path_factory, "fault-reference", lambda d: train(
        d, [f"train.max_steps={STEPS}", "checkpoint.interval=3", EVAL_AT_END], devices=8))


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory) -> Path:
    """An uninterrupted run on 2 jax.distributed processes x 4 devices (gloo): steps 1..STEPS,
    checkpoints every 4 steps, the in-loop evaluation at the end."""
    return _made_once(tmp_path_factory, "fault-two-processes", lambda d: train_multiprocess(
        d, [f"train.max_steps={STEPS}", "checkpoint.interval=4", EVAL_AT_END]))
