"""A hung peer, end to end: the generated ``sbatch`` script (stand-in ``srun``/``scancel``/
``scontrol``, tests/helpers/cluster_fakes.py) runs 2 real ``olmax train`` processes x 4 CPU devices (gloo,
127.0.0.1). One process is stopped (SIGSTOP) mid-run, as a wedged driver or a stuck collective
would leave it: alive, silent. The other's watchdog finds no step completed in
``train.watchdog_s``, writes every thread's stack to ``RUN_DIR/hangs/`` and exits 75; ``srun
--kill-on-bad-exit`` ends the stopped one; the script records the statuses and requeues the job.
The requeued job (the script again, ``SLURM_RESTART_COUNT=1``) takes the run directory over from
the dead attempt at once, resumes from the last checkpoint and finishes with the losses and batches
of an uninterrupted run of the same layout, bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from olmax.cli import main
from helpers.trainrun import RECIPE, STEPS, env_for, metrics, run_overrides


from helpers.cluster_fakes import batch_env, install, recorded, slurm_port_and_job_id

pytestmark = pytest.mark.slow


def overrides() -> list[str]:
    return [*run_overrides(), f"train.max_steps={STEPS}", "checkpoint.interval=2",
            "eval.tasks=[]", "eval.heldout=[]"]


WATCHDOG_S = 20


def test_a_stopped_peer_is_caught_by_the_watchdog_and_the_restarted_job_matches(tmp_path,
                                                                              two_process_run):
    reference = two_process_run     # the same layout (2 x 4), never interrupted, made once a run

    script, run_dir, log = tmp_path / "job.sbatch", tmp_path / "run", tmp_path / "slurm.out"
    assert main(["launch", "slurm", RECIPE, *overrides(), f"train.watchdog_s={WATCHDOG_S}",
                 "--nodes", "2", "--cpu-devices-per-node", "4", "--run-dir", str(run_dir),
                 "--out", str(script)]) == 0
    _, job_id = slurm_port_and_job_id()
    slurm_dir = tmp_path / "slurm"
    env = batch_env(env_for(4), install(tmp_path / "bin", real_olmax=True), slurm_dir, nodes=2,
                    job_id=job_id)
    with open(log, "a") as f:
        p = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stdout=f,
                             stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while not (metrics(run_dir) and metrics(run_dir)[-1]["step"] >= 3):
            assert p.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        tasks = (slurm_dir / f"{job_id}.tasks").read_text().split()
        os.killpg(int(tasks[1]), signal.SIGSTOP)   # rank 1: its task shell and olmax train
        stopped = time.monotonic()
        rc = p.wait(timeout=WATCHDOG_S + 120)
        took = time.monotonic() - stopped
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    assert rc != 0 and took < WATCHDOG_S + 60, (took, text[-4000:])
    assert "olmax train: error: watchdog: no step completed in" in text
    (dump,) = (run_dir / "hangs").iterdir()         # rank 0's stacks; rank 1 never woke up
    stacks = dump.read_text()
    assert stacks.startswith("olmax train watchdog: no step completed in ")
    assert "Thread 0x" in stacks and 'File "' in stacks and "trainer.py" in stacks
    exits = run_dir / "exits" / f"{job_id}.0"
    assert sorted(f.name for f in exits.iterdir()) == ["0"]    # rank 1 was killed by srun
    assert (exits / "0").read_text().split()[:2] == ["75", "node0"]
    assert recorded(slurm_dir / "scontrol.log") == [["requeue", str(job_id)]]
    assert "requeueing, restart 1 of 10" in text
    hung_at = metrics(run_dir)[-1]["step"]
    assert hung_at < STEPS

    # Slurm starts the requeued job: the same script, restart count 1
    r = subprocess.run(["bash", str(script)], env={**env, "SLURM_RESTART_COUNT": "1"}, cwd=tmp_path,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"(attempt {job_id}.1 replaces attempt {job_id}.0)" in r.stdout + r.stderr
    assert recorded(slurm_dir / "scontrol.log") == [["requeue", str(job_id)]]   # no new requeue
    rows, ref = metrics(run_dir), metrics(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["batch_hash"]) for r in rows] == [(r["loss"], r["batch_hash"]) for r in ref]
    print(f"watchdog caught the hang at step {hung_at} in {took:.0f} s; restarted run matches")
