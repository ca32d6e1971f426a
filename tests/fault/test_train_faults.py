"""End-to-end fault tolerance of ``olmax train`` (subprocesses on CPU devices).

Every comparison is against one uninterrupted reference run (1 process x 8 devices, steps 1..8):
- SIGKILL at random moments (several kills, some mid-save): per-step ``loss`` and ``batch_hash``
  bit-identical, metrics.jsonl holding each step exactly once;
- SIGTERM: a checkpoint is saved at the step reached, the process exits, the rerun continues exactly;
- corrupted newest checkpoint: reported by name, the previous one used, losses exact;
- resize 8 -> 2 -> 8 devices: batch hashes identical, losses within fp tolerance;
- NaN: clear error, no checkpoint of a non-finite state.
"""

from __future__ import annotations

import glob
import os
import random
import signal
import time

import numpy as np
import pytest

from helpers.trainrun import STEPS
from helpers.trainrun import checkpoint_steps, log_path, metrics, series, start, train, wait_for_step

# Each test a unit of work of its own on 2 workers (they share only the reference run, made once).
pytestmark = [pytest.mark.slow, pytest.mark.own_unit]


def assert_exact(run_dir, reference, steps=range(1, STEPS + 1)):
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(steps), "metrics.jsonl must hold every step once, in order"
    ref_loss, ref_hash = series(reference, "loss"), series(reference, "batch_hash")
    for r in rows:
        assert r["batch_hash"] == ref_hash[r["step"]], f"step {r['step']}: batch differs"
        assert r["loss"] == ref_loss[r["step"]], f"step {r['step']}: loss {r['loss']!r} != {ref_loss[r['step']]!r}"


def partial_saves(run_dir):
    return [os.path.basename(x) for x in glob.glob(str(run_dir / "checkpoints" / "*.orbax-checkpoint-tmp*"))]


def kill_mid_save(p, run_dir, timeout=600):
    """SIGKILL as soon as an async save is in flight (its temporary directory exists)."""
    deadline = time.time() + timeout
    while not partial_saves(run_dir):
        assert p.poll() is None and time.time() < deadline, "no save seen in flight"
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)


def test_sigkill_at_random_moments_resumes_bit_exactly(reference_run, tmp_path):
    """Four kills: at random moments after random steps, and once while a save is in flight.

    The mid-save kill is the second one, so that the run cannot have finished before it lands.
    """
    seed = int(os.environ.get("OLMAX_FAULT_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    d = tmp_path / "run"
    args = [f"train.max_steps={STEPS}", "checkpoint.interval=2", "checkpoint.keep=2"]
    log = []
    reached = 0
    for k in range(4):
        p = start(d, args)
        if k == 1:
            kill_mid_save(p, d)
        else:
            wait_for_step(p, d, min(STEPS - 1, reached + rng.randint(1, 2)))
            time.sleep(rng.uniform(0.0, 0.6))
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        reached = max(r["step"] for r in metrics(d))
        log.append((reached, checkpoint_steps(d), partial_saves(d)))
    assert log[1][2], "the second kill must land inside a save"
    train(d, args)
    print(f"seed {seed}; kills (last logged step, complete checkpoints, partial saves): {log}")
    # the next start reported the interrupted save by name and removed it
    assert f"ignoring incomplete checkpoint {d / 'checkpoints' / log[1][2][0]}" in log_path(d).read_text()
    assert_exact(d, reference_run)


def test_sigterm_saves_then_exits_and_resumes_exactly(reference_run, tmp_path):
    d = tmp_path / "run"
    args = [f"train.max_steps={STEPS}", "checkpoint.interval=1000"]
    p = start(d, args)
    wait_for_step(p, d, 3)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=180)
    out = log_path(d).read_text()
    assert rc == 0, out[-3000:]
    stopped = max(r["step"] for r in metrics(d))
    assert stopped < STEPS, "SIGTERM did not stop the run"
    assert checkpoint_steps(d) == [stopped], out[-3000:]
    assert "SIGTERM" in out
    train(d, args)
    assert_exact(d, reference_run)


def test_corrupt_latest_checkpoint_falls_back(reference_run, tmp_path):
    d = tmp_path / "run"
    train(d, ["train.max_steps=5", "checkpoint.interval=2", "checkpoint.keep=3"])
    assert checkpoint_steps(d) == [2, 4, 5]
    for f in glob.glob(str(d / "checkpoints" / "5" / "params" / "**" / "d" / "*"), recursive=True):
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 3)
    out = train(d, [f"train.max_steps={STEPS}", "checkpoint.interval=2"])
    text = out.stdout + out.stderr
    assert f"{d / 'checkpoints' / '5'} is corrupt" in text
    assert "(step 4)" in text  # resumed from the previous complete checkpoint
    assert (d / "checkpoints" / "5.corrupt").is_dir()
    assert_exact(d, reference_run)


def test_resize_8_2_8(reference_run, tmp_path):
    d = tmp_path / "run"
    train(d, ["train.max_steps=3", "checkpoint.interval=3"], devices=8)
    train(d, ["train.max_steps=6", "checkpoint.interval=3"], devices=2)
    train(d, [f"train.max_steps={STEPS}", "checkpoint.interval=3"], devices=8)
    rows = metrics(d)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ref_loss, ref_hash = series(reference_run, "loss"), series(reference_run, "batch_hash")
    assert [r["batch_hash"] for r in rows] == [ref_hash[s] for s in range(1, STEPS + 1)]
    losses = [r["loss"] for r in rows]
    np.testing.assert_allclose(losses, [ref_loss[s] for s in range(1, STEPS + 1)], rtol=2e-5, atol=0)
    print("8->2->8 loss differences:", [x - ref_loss[s] for s, x in enumerate(losses, 1)])
    # before the first resize, the same device layout gives the same bits
    assert losses[:3] == [ref_loss[s] for s in range(1, 4)]


def test_nan_loss_stops_and_keeps_last_good(tmp_path):
    d = tmp_path / "run"
    out = train(d, ["train.max_steps=6", "checkpoint.interval=1", "optim.lr=1e12",
                    "optim.max_grad_norm=0", "scheduler.warmup_steps=0"], check=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "at step" in text and "stopping without saving" in text, text[-2000:]
    bad = next(r["step"] for r in metrics(d) if not np.isfinite(float(r["loss"])))
    assert checkpoint_steps(d) and max(checkpoint_steps(d)) < bad


def test_changed_dataset_under_resumed_run_names_file_and_override(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=40_000, dtype=np.uint32)      # trainrun's byte ids
    tokens[::97] = 256  # documents end with EOS
    f = tmp_path / "part-0.npy"
    tokens.tofile(f)
    d = tmp_path / "run"
    data = ["data.embedded=false", f"data.paths=[{f}]"]
    train(d, [*data, "train.max_steps=2", "checkpoint.interval=2"])
    tokens[:4096].tofile(open(f, "ab"))  # the file grows under the run
    out = train(d, [*data, "train.max_steps=3", "checkpoint.interval=2"], check=False)
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()[-1]
    assert "fingerprint" in err and str(f) in err and "data.ignore_fingerprint_mismatch=true" in err, err
    train(d, [*data, "train.max_steps=3", "checkpoint.interval=2", "data.ignore_fingerprint_mismatch=true"])
    assert [r["step"] for r in metrics(d)] == [1, 2, 3]
