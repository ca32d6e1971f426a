"""Two ``olmax train`` processes on one run directory (real processes, CPU).

The first trainer is paused (SIGSTOP) mid-run so the second certainly meets it alive; the second
must stop at once with one line naming the holder's pid and host, before writing anything, and the
first must finish exactly like a run alone: the same metrics (every step once) and the same
checkpoints, bit for bit. Two attempts of one scheduled job (``--attempt JOB.N``) never both train:
the later takes over at once, the earlier stops at its next step without writing.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from helpers.trainrun import checkpoint_steps, command, env_for, metrics, start, train, wait_for_step

pytestmark = pytest.mark.slow

ARGS = ["train.max_steps=10", "checkpoint.interval=4"]
TIMING = {"tokens_per_sec", "mfu", "step_seconds", "seconds", "data_seconds", "mfu_causal"}


def _rows(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(run_dir)]


def _params(run_dir, step):
    from olmax.checkpoint.weights import load_params

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


def test_a_later_attempt_takes_over_and_the_earlier_one_stops_without_writing(reference_run, tmp_path):
    """Attempt 9.1 of a job starts while attempt 9.0 still lives (paused): it takes the run over
    at once and trains; 9.0, resumed while 9.1 holds the run, stops at its next step (exit 75)
    without a line or a checkpoint; the run reads like an uninterrupted one, bit for bit."""
    from helpers.trainrun import STEPS

    d = tmp_path / "run"
    args = [f"train.max_steps={STEPS}", "checkpoint.interval=3"]
    first = start(d, [*args, "--attempt", "9.0"], devices=8)
    second = None
    try:
        wait_for_step(first, d, 4)
        # paused with its step-3 checkpoint committed (9.1 resumes from it); its save of step 6 may
        # be in flight: fenced by its lock, it never commits, and 9.1's save of step 6 is 9.1's own
        t_ckpt = time.time()
        while 3 not in checkpoint_steps(d) and time.time() - t_ckpt < 120:
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        paused_at = metrics(d)[-1]["step"]
        t0 = time.time()
        with open(tmp_path / "second.log", "w") as log:
            second = subprocess.Popen(command(d, [*args, "--attempt", "9.1"]), env=env_for(8),
                                      stdout=log, stderr=subprocess.STDOUT, text=True)
        while not (metrics(d) and metrics(d)[-1]["step"] >= paused_at + 2) and time.time() - t0 < 600:
            assert second.poll() is None, (tmp_path / "second.log").read_text()[-3000:]
            time.sleep(0.05)
        # 9.1 holds the run, paused, while 9.0 goes on: had 9.1 finished and released its lock
        # first, 9.0 would find no record to name (it then says "another process")
        second.send_signal(signal.SIGSTOP)
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 75
        second.send_signal(signal.SIGCONT)
        assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
    log_first = (d.parent / f"{d.name}.log").read_text()
    log_second = (tmp_path / "second.log").read_text()
    assert (f"took over a stale lock of pid {first.pid} on host {socket.gethostname()} "
            "(attempt 9.0) (attempt 9.1 replaces attempt 9.0)") in log_second
    last = [ln for ln in log_first.splitlines() if ln.strip()][-1]
    assert last.startswith("olmax train: error: stopping: run directory ") and \
        f"was taken over by pid {second.pid} on host {socket.gethostname()} (attempt 9.1)" in last
    rows, ref = metrics(d), metrics(reference_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["batch_hash"]) for r in rows] == [(r["loss"], r["batch_hash"]) for r in ref]
    assert checkpoint_steps(d) == [6, STEPS]
