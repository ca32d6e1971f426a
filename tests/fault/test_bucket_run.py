"""A run directory in a bucket, end to end (``olmax train`` subprocesses; moto's S3 server and
fake-gcs-server on 127.0.0.1): killed with SIGKILL mid-run, the rerun resumes from the bucket
bit-identically to the uninterrupted local reference run, each step once in the rolled metrics
segments; a second trainer on the same bucket path is refused in one line while the first holds
it; ``olmax curves`` reads the bucket run back. A 2-process run (gloo) writes its shards to the
bucket and resumes from them bit for bit as an uninterrupted 2-process run, which ``olmax eval``
reads back; a checkpoint written on 8 devices restores from the bucket on 2. The store lost in
the middle of a save: retried, exit 75 in one line, nothing of the step committed, and the
restart resumes from the last complete step bit for bit. Each on S3 and on Cloud Storage."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from helpers.remote_servers import cutting_proxy, store_bucket
from helpers.trainrun import STEPS, command, env_for, series, train, train_multiprocess
from olmax import store
from olmax.checkpoint import buckets
from olmax.cli import main

pytestmark = pytest.mark.slow


def bucket_rows(run: str) -> list[dict]:
    text = store.read_segments(f"{run}/metrics")
    return [r for r in map(json.loads, text.splitlines()) if "loss" in r]


def wait_until(p: subprocess.Popen, what, ok, log, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not ok():
        if p.poll() is not None:
            raise AssertionError(f"olmax train exited ({p.returncode}) before {what}:\n"
                                 f"{log.read_text()[-4000:]}")
        assert time.time() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.1)


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_bucket_run_killed_resumes_exactly_one_writer_and_curves(reference_run, tmp_path, capsys,
                                                                   kind):
    args = [f"train.max_steps={STEPS}", "checkpoint.interval=2", "checkpoint.keep=2",
            "logging.flush_s=0.5"]
    log = tmp_path / "train.log"
    with store_bucket(kind) as bucket:
        run = f"{bucket}/runs/tiny"
        env = env_for(8)
        with open(log, "a") as f:
            p = subprocess.Popen(command(run, args), env=env, stdout=f, stderr=subprocess.STDOUT)
        wait_until(p, "step 3 in the bucket after checkpoint 2",       # a resume, not a restart
                   lambda: store.stat(f"{run}/checkpoints/2/commit_success.txt") is not None
                   and any(r["step"] >= 3 for r in bucket_rows(run)), log)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        assert store.stat(f"{run}/.olmax-lock") is not None      # left by the killed trainer
        with open(log, "a") as f:
            p = subprocess.Popen(command(run, args), env=env, stdout=f, stderr=subprocess.STDOUT)
        lock = f"{run}/.olmax-lock"
        wait_until(p, "the lock taken over", lambda: json.loads(
            store.read(lock) or b"{}").get("pid") == p.pid, log)
        os.kill(p.pid, signal.SIGSTOP)         # held, not finishing, while a second one tries
        try:
            second = subprocess.run(command(run, args), env=env, capture_output=True, text=True,
                                    timeout=300)
        finally:
            os.kill(p.pid, signal.SIGCONT)
        assert p.wait(timeout=600) == 0, log.read_text()[-4000:]
        lines = [x for x in second.stderr.splitlines() if x.startswith("olmax")]
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert f"run directory {run} is in use by olmax train pid {p.pid}" in lines[0]
        text = log.read_text()
        assert "process" in text and "is gone" in text          # the restart took over at once
        assert f"resumed from {run}/checkpoints/" in text
        rows = bucket_rows(run)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step once, in order"
        ref_loss, ref_hash = series(reference_run, "loss"), series(reference_run, "batch_hash")
        for r in rows:
            assert r["batch_hash"] == ref_hash[r["step"]] and r["loss"] == ref_loss[r["step"]], r
        assert store.stat(lock) is None                           # released at the end
        assert main(["curves", str(reference_run), run]) == 0
        out = capsys.readouterr().out
        assert f"{STEPS} aligned points" in out and "max 0)" in out, out


def assert_reference_steps(run: str, reference, exact: bool) -> list[float]:
    """The bucket run logged steps 1..STEPS once each with the batch hashes and losses of the
    (local, uninterrupted) ``reference`` run: ``exact``, bit for bit; else within the resize
    contract's rtol 2e-5 (``test_resize_8_2_8``). Returns the loss differences."""
    rows = bucket_rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step once, in order"
    ref_loss, ref_hash = series(reference, "loss"), series(reference, "batch_hash")
    assert [r["batch_hash"] for r in rows] == [ref_hash[s] for s in range(1, STEPS + 1)]
    losses = [r["loss"] for r in rows]
    want = [ref_loss[s] for s in range(1, STEPS + 1)]
    if exact:
        assert losses == want
    else:
        np.testing.assert_allclose(losses, want, rtol=2e-5, atol=0)
    return [x - y for x, y in zip(losses, want)]


# The upload of step 4's optimizer-state data (its parameters' and the step's metadata are written
# by then): the object's path (S3), or its name URL-encoded (Cloud Storage's JSON API)
STEP_4_DATA = (b"checkpoints/4/opt_state/ocdbt.process_0/d/",
               b"checkpoints%2F4%2Fopt_state%2Focdbt.process_0%2Fd%2F")


def _run_or_show_stacks(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` run to its end; one that outlives ``timeout`` fails the test with every thread's
    Python stack (Python's fault handler, on the SIGABRT it is sent), not a bare timeout."""
    proc = subprocess.Popen(cmd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"still running after {timeout:.0f} s; its threads:\n{err[-30000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_store_lost_mid_save_is_retried_then_75_and_the_restart_resumes(reference_run, tmp_path,
                                                                        kind):
    """The store goes away while the checkpoint of step 4 uploads (a proxy in front of it resets
    the upload's connection and every later one): the requests are retried (olmax.store's and
    TensorStore's own retries: 5 tries, back-off 0.25 s doubling to 4 s), then ``olmax train``
    exits 75 in one line, no traceback; step 4, written in part, is never committed. With the store back, the
    restart resumes from step 2, the last complete step, bit for bit as the uninterrupted
    reference run."""
    args = [f"train.max_steps={STEPS}", "checkpoint.interval=2", "logging.flush_s=3600"]
    with store_bucket(kind) as bucket:
        var = "AWS_ENDPOINT_URL" if kind == "s3" else "STORAGE_EMULATOR_HOST"
        with cutting_proxy(os.environ[var], cut_on=STEP_4_DATA) as proxy:
            env = {**env_for(8), var: proxy.url}
            env.pop("TENSORSTORE_GCS_HTTP_URL", None)       # olmax sets it from the emulator's
            run = f"{bucket}/runs/lost"
            t0 = time.time()
            out = _run_or_show_stacks(command(run, args), env, timeout=600)
            (tmp_path / "lost.log").write_text(out.stderr)
            print(f"{kind}: exit {out.returncode} after {time.time() - t0:.1f} s, "
                  f"{proxy.cuts} connections lost")
            assert proxy.down.is_set(), "the store was never lost"
            lines = [x for x in out.stderr.splitlines() if x.startswith("olmax train: error")]
            assert out.returncode == 75 and len(lines) == 1, out.stderr[-4000:]
            assert "Traceback" not in out.stderr, out.stderr[-4000:]
            print(lines[0])
            # the first request to find the store gone says so: the save's, or the run lock's
            # (its check after each step), each after its retries
            assert re.match(rf"olmax train: error: (checkpoint save at step 4 to )?{run}/\S+"
                            rf"(: \S+( request)? failed after 5 attempts| failed \()", lines[0]), lines
            assert store.listdir(f"{run}/checkpoints/4"), proxy.requests   # written in part,
            assert not buckets.committed(f"{run}/checkpoints/4")          # never committed
            assert buckets.committed(f"{run}/checkpoints/2")
            proxy.restore()                                              # the store is back
            again = subprocess.run(command(run, args), env=env, capture_output=True, text=True,
                                   timeout=600)
            assert again.returncode == 0, again.stderr[-4000:]
        text = again.stdout + again.stderr
        assert f"resumed from {run}/checkpoints/2" in text, text[-3000:]
        assert (f"ignoring incomplete checkpoint {run}/checkpoints/4 (an interrupted save: no "
                "commit file); removing it") in text, text[-3000:]
        assert_reference_steps(run, reference_run, exact=True)
        assert buckets.committed(f"{run}/checkpoints/{STEPS}")


_EVALS: dict[str, dict] = {}


def eval_numbers(run, out, corpus) -> dict:
    """What ``olmax eval`` reports for ``run`` (perplexity on 4 held-out documents of the byte
    ``corpus``, :func:`helpers.trainrun.make_byte_corpus`)."""
    key = str(run)
    if key not in _EVALS:
        assert main(["eval", key, "--heldout", f"bytes={corpus / 'heldout.npy'}",
                     "--heldout-max-docs", "4", "--tokenizer", str(corpus / "tokenizer"),
                     "--json", str(out), "--no-progress"]) == 0
        _EVALS[key] = json.loads(out.read_text())["metrics"]
    return _EVALS[key]


@pytest.mark.own_unit      # a long test that shares only the session's reference runs
@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_bucket_run_two_processes_write_and_restore_shards(two_process_run, byte_corpus, tmp_path,
                                                           kind):
    """2 jax.distributed processes x 4 devices (gloo) with the run directory in the bucket: each
    process writes its own shards there, process 0 commits; stopped at step 4, the 2 processes
    resume from the bucket, and the losses are those of the uninterrupted 2-process run (made
    once for the session) bit for bit. (Their in-loop evaluation at the end is left out: it reads
    nothing from the bucket.)"""
    local = two_process_run
    args = ["checkpoint.interval=4", "eval.on_end=false"]
    with store_bucket(kind) as bucket:
        run = f"{bucket}/runs/two"
        train_multiprocess(run, ["train.max_steps=4", *args], log_dir=tmp_path)
        step = f"{run}/checkpoints/4"
        assert buckets.committed(step)
        for item in ("params", "opt_state"):
            shards = set(store.listdir(f"{step}/{item}"))
            assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards, (item, shards)
        assert store.stat(f"{run}/.olmax-lock") is None          # released by the stopped run
        logs = train_multiprocess(run, [f"train.max_steps={STEPS}", *args], log_dir=tmp_path)
        assert f"resumed from {step}" in logs[0], logs[0][-3000:]
        assert_reference_steps(run, local, exact=True)
        assert buckets.committed(f"{run}/checkpoints/{STEPS}")
        assert main(["curves", str(local), run]) == 0
        # olmax eval reads the bucket run: the same weights, the same numbers
        want = eval_numbers(local, tmp_path / "local.json", byte_corpus)
        assert want and eval_numbers(run, tmp_path / "bucket.json", byte_corpus) == want


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_bucket_run_resize_8_to_2(reference_run, tmp_path, kind):
    """Checkpointed on 8 devices into the bucket, resumed from it on 2: the contract of
    ``test_resize_8_2_8`` (the same batches, losses within its tolerance, bit for bit before
    the resize)."""
    with store_bucket(kind) as bucket:
        run = f"{bucket}/runs/resize"
        train(run, ["train.max_steps=3", "checkpoint.interval=3"], devices=8)
        out = train(run, [f"train.max_steps={STEPS}", "checkpoint.interval=3"], devices=2)
        assert f"resumed from {run}/checkpoints/3" in out.stdout + out.stderr
        diffs = assert_reference_steps(run, reference_run, exact=False)
        print("8->2 from the bucket, loss differences:", diffs)
        assert diffs[:3] == [0.0, 0.0, 0.0]
