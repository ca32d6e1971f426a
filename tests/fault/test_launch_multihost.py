"""The files ``olmax launch`` writes, driving 2 real training processes x 4 CPU devices (gloo) on
this machine: their losses and batches equal the 1-process reference run's, and a stop signal
makes both save a checkpoint at the same step (resuming 2-process checkpoints is
test_train_multihost.py's subject).

- SLURM: the generated ``sbatch`` script itself runs, with the ``SLURM_*`` variables sbatch and
  ``srun`` set (stand-in ``srun``/``scancel``/``scontrol``, tests/helpers/cluster_fakes.py); JAX's SLURM
  detection connects the processes (coordinator on the first node, 127.0.0.1, port from the job
  id). USR1 (the time-limit warning) makes both save and stop, and the script requeues the job.
- Kubernetes: the JobSet is parsed and each pod's command runs with the pod's environment
  (``JOB_COMPLETION_INDEX``, ``OLMAX_COORDINATOR``, with pod 0's Service name resolved to
  127.0.0.1; the downward-API variables and ``$(NAME)`` references as Kubernetes fills them in).
  SIGTERM to one pod (a preemption) stops both at the same step with a checkpoint and exit status
  143, which the pod failure policy restarts without counting.

Both jobs are written for CPU nodes of 4 JAX devices each (``--cpu-devices-per-node 4``): the job
pins the platform and the device count, as it would pin 4 GPUs.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers.trainrun import STEPS
from olmax.cli import main
from helpers.trainrun import (RECIPE, check_against, checkpoint_steps, env_for, free_port, metrics,
                              run_overrides)


from helpers.cluster_fakes import batch_env, expand_k8s, install, recorded, slurm_port_and_job_id

pytestmark = pytest.mark.slow


# Losses do not depend on evaluation or checkpoint intervals: the same program as the reference.
def overrides() -> list[str]:
    return [*run_overrides(), f"train.max_steps={STEPS}", "checkpoint.interval=1000",
            "eval.tasks=[]", "eval.heldout=[]"]


def wait_for_step(procs: list[subprocess.Popen], run_dir: Path, step: int, log: Path,
                  timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = metrics(run_dir)
        if rows and rows[-1]["step"] >= step:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"exited before step {step}:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def test_slurm_script_on_two_nodes_matches_one_process_and_requeues(reference_run, tmp_path):
    script, run_dir, log = tmp_path / "job.sbatch", tmp_path / "run", tmp_path / "slurm.out"
    assert main(["launch", "slurm", RECIPE, *overrides(), "--nodes", "2", "--cpu-devices-per-node",
                 "4", "--run-dir", str(run_dir), "--out", str(script)]) == 0
    _, job_id = slurm_port_and_job_id()   # JAX derives the coordinator port from the job id
    env = batch_env(env_for(4), install(tmp_path / "bin", real_olmax=True), tmp_path / "slurm",
                    nodes=2, job_id=job_id)
    with open(log, "a") as f:
        p = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stdout=f,
                             stderr=subprocess.STDOUT)
    try:
        wait_for_step([p], run_dir, 2, log)
        p.send_signal(signal.SIGUSR1)     # Slurm: the time limit is GRACE seconds away
        assert p.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if p.poll() is None:
            p.kill()
    stopped = metrics(run_dir)[-1]["step"]
    assert stopped < STEPS and checkpoint_steps(run_dir) == [stopped], log.read_text()[-4000:]
    assert recorded(tmp_path / "slurm" / "scontrol.log") == [["requeue", str(job_id)]]
    print(f"stopped at step {stopped}; 2x4 vs 1x8 loss differences:",
          check_against(reference_run, run_dir, stopped))


def test_k8s_manifest_pods_match_one_process_and_stop_together(reference_run, tmp_path):
    manifest, run_dir = tmp_path / "job.yaml", tmp_path / "runs" / "r1"
    assert main(["launch", "k8s", RECIPE, *overrides(), "--nodes", "2", "--cpu-devices-per-node", "4",
                 "--mount-path", str(tmp_path / "runs"), "--run-dir", str(run_dir),
                 "--image", "registry.example/olmax:test", "--volume-claim", "runs",
                 "--out", str(manifest)]) == 0
    (jobset,) = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    name = jobset["metadata"]["name"]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    spec = job["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["OLMAX_COORDINATOR"].rsplit(":", 1)[0] == f"{name}-node-0-0.{name}"
    base, log = env_for(4), tmp_path / "pods.log"
    bin_dir = install(tmp_path / "bin", ("olmax",), real_olmax=True)
    coordinator = f"127.0.0.1:{free_port()}"   # pod 0's Service name, resolved on this machine
    labels = {"OLMAX_JOB_UID": "4f0e6c1a-2b1d-4c55-9e0a-7d1e4b9c2a10", "OLMAX_RESTART_ATTEMPT": "0"}
    procs = []
    try:
        for i in range(job["completions"]):   # each pod: its command, its environment
            pod_env = {**base, **env, **labels,
                       "XLA_FLAGS": f"{base['XLA_FLAGS']} {env['XLA_FLAGS']}",
                       "OLMAX_COORDINATOR": coordinator, "JOB_COMPLETION_INDEX": str(i),
                       "HOSTNAME": f"{name}-node-0-{i}", "PATH": f"{bin_dir}:{base['PATH']}"}
            command = [expand_k8s(a, pod_env) for a in container["command"]]
            with open(log, "a") as f:
                procs.append(subprocess.Popen(command, env=pod_env, cwd=tmp_path,
                                              stdout=f, stderr=subprocess.STDOUT))
        wait_for_step(procs, run_dir, 2, log)
        procs[1].send_signal(signal.SIGTERM)   # node 1 preempted: its pod gets SIGTERM
        assert [p.wait(timeout=300) for p in procs] == [143, 143], log.read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    stopped = metrics(run_dir)[-1]["step"]
    assert stopped < STEPS and checkpoint_steps(run_dir) == [stopped], log.read_text()[-4000:]
    rules = job["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": container["name"], "operator": "In",
                                                "values": [143]}} in rules
    print(f"stopped at step {stopped}; 2x4 vs 1x8 loss differences:",
          check_against(reference_run, run_dir, stopped))
