"""Two ``olmax train`` processes on one run directory (real processes, CPU).

The first trainer is paused (SIGSTOP) mid-run so the second certainly meets it alive; the second
must stop at once with one line naming the holder's pid and host, before writing anything, and the
first must finish exactly like a run alone: the same metrics (every step once) and the same
checkpoints, bit for bit.
"""

from __future__ import annotations

import signal
import socket
import time

import numpy as np
import pytest

from trainrun import checkpoint_steps, metrics, start, train, wait_for_step

pytestmark = pytest.mark.slow

ARGS = ["train.max_steps=10", "checkpoint.interval=4"]
TIMING = {"tokens_per_sec", "mfu", "step_seconds", "seconds", "data_seconds", "mfu_causal"}


def _rows(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(run_dir)]


def _params(run_dir, step):
    from olmax.checkpoint.params import load_params

    params, _ = load_params(run_dir / "checkpoints" / str(step))
    import jax

    return {"/".join(str(getattr(k, "key", k)) for k in kp): np.asarray(v)
            for kp, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_second_trainer_stops_at_once_and_the_first_is_untouched(tmp_path):
    alone = tmp_path / "alone"
    train(alone, ARGS, devices=1)

    shared = tmp_path / "shared"
    first = start(shared, ARGS, devices=1)
    try:
        wait_for_step(first, shared, 2)
        first.send_signal(signal.SIGSTOP)         # alive, but not finishing while we try
        try:
            t0 = time.time()
            second = train(shared, ARGS, devices=1, check=False, timeout=120)
            took = time.time() - t0
        finally:
            first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=600) == 0
    finally:
        if first.poll() is None:
            first.kill()
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert second.returncode == 2, second.stderr
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith("olmax train: error: run directory ")
    assert f"in use by olmax train pid {first.pid} on host {socket.gethostname()}" in lines[0]
    assert second.stdout == ""
    print(f"second trainer refused in {took:.1f} s: {lines[0]}")

    assert _rows(shared) == _rows(alone)
    assert [r["step"] for r in _rows(shared)] == list(range(1, 11))
    assert checkpoint_steps(shared) == checkpoint_steps(alone) == [8, 10]
    for step in (8, 10):
        a, b = _params(alone, step), _params(shared, step)
        assert a.keys() == b.keys()
        for k in a:
            assert np.array_equal(a[k], b[k]), k
    assert not (shared / ".olmax-lock").exists()
    assert sorted(p.name for p in shared.iterdir()) == sorted(p.name for p in alone.iterdir())
