"""``olmax launch``: the SLURM script, the Kubernetes manifest and the TPU VM script, run against
stand-ins for the cluster tools (``srun``, ``scancel``, ``scontrol``, ``sbatch``, ``gcloud``) and a
recording ``olmax`` that can end with any exit status; the recipe/override checks at generation
time; what each target does after a failure (restart the whole job, or stop for good). The
2-process training runs these files drive (losses equal to a 1-process run, a hang caught and the
job restarted) are in ``tests/fault/``."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from olmax.cli import main
from olmax.launch.k8s import strategic_merge
from olmax.perf.targets import check_topology_name, libtpu_topology
from olmax.topology import parse_tpu


from helpers.cluster_fakes import batch_env, expand_k8s, install, recorded

# Overrides that a careless launcher would mangle: spaces, quotes, $, backticks, YAML lists.
TRICKY = ["train.max_steps=3", "optim.lr=1e-3", "data.paths=[a b.npy, \"c'd.npy\"]",
          "eval.tasks=[]", "logging.wandb_project=it's $HOME `x` \\n"]
GPU_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true"
LAUNCHED = ["distributed.init_timeout_s=1800", "train.watchdog_s=1800"]


def launch(*argv: str) -> int:
    try:
        return main(["launch", *map(str, argv)])
    except SystemExit as e:      # a usage mistake argparse found: one line, status 2
        return e.code


def olmax_calls(d: Path, n: int, timeout: float = 30) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        files = sorted(d.glob("*.json"))
        calls = []
        for f in files:
            try:
                calls.append(json.loads(f.read_text()))
            except json.JSONDecodeError:   # being written
                break
        if len(calls) == n:
            return calls
        time.sleep(0.05)
    raise AssertionError(f"expected {n} olmax processes, found {len(list(d.glob('*.json')))}")


def sbatch_directives(text: str) -> list[str]:
    """The #SBATCH options sbatch reads: those before the first command line."""
    out = []
    for line in text.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            out.append(line.split(None, 1)[1].split("#")[0].strip())
    return out


@pytest.fixture
def slurm(tmp_path):
    """A 2-node batch job's environment on this machine, with stand-in cluster tools."""
    bin_dir = install(tmp_path / "bin")
    calls = tmp_path / "olmax-calls"
    calls.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env = batch_env({**base, "FAKE_OLMAX_DIR": str(calls), "XLA_FLAGS": "--xla_dummy_from_env=1"},
                    bin_dir, tmp_path / "slurm", nodes=2, job_id=4242)
    return env, calls, tmp_path / "slurm"


def test_slurm_script_starts_one_process_per_node_with_the_exact_command(tmp_path, slurm, capsys):
    env, calls, slurm_dir = slurm
    out, run_dir = tmp_path / "job.sbatch", tmp_path / "run dir"
    assert launch("slurm", "olmo3_tiny", *TRICKY, "--nodes", 2, "--gpus-per-node", 4, "--out", out,
                  "--run-dir", run_dir, "--partition", "gpu", "--env", "NCCL_DEBUG=WARN",
                  "--sbatch-option=--qos=high", "--grace", 120) == 0
    assert "launch settings: " + " ".join([*LAUNCHED, "mesh.data=2", "mesh.fsdp=4"]) in \
        capsys.readouterr().out
    text = out.read_text()
    assert os.access(out, os.X_OK)
    assert {"--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--exclusive", "--requeue",
            "--signal=B:USR1@120", "--partition=gpu", "--qos=high"} <= set(sbatch_directives(text))
    subprocess.run(["bash", "-n", str(out)], check=True)

    r = subprocess.run(["bash", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    got = olmax_calls(calls, 2)
    for c in got:
        # HSDP on GPUs over several nodes: 4-way sharding in a node, replicas across the 2 nodes
        assert c["argv"] == ["train", "olmo3_tiny", "--run-dir", str(run_dir), "--expect-devices",
                             "gpu:8", "--attempt", "4242.0", *LAUNCHED, "mesh.data=2",
                             "mesh.fsdp=4", *TRICKY]
        assert c["env"]["XLA_FLAGS"] == f"--xla_dummy_from_env=1 {GPU_FLAGS}"
        assert c["env"]["NCCL_DEBUG"] == "WARN" and c["env"]["JAX_PLATFORMS"] == "cuda"
        assert c["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"
        assert c["env"]["OLMAX_CACHE"] == f"{run_dir}/cache"     # the run's storage, not $HOME
        assert c["env"]["SLURM_STEP_NUM_NODES"] == "2" and c["env"]["SLURM_NTASKS"] == "2"
    assert sorted(c["env"]["SLURM_PROCID"] for c in got) == ["0", "1"]
    assert run_dir.is_dir() and not (run_dir / "exits").exists()
    assert recorded(slurm_dir / "scontrol.log") == []    # finished: no requeue


def start_waiting_job(tmp_path: Path, env: dict, calls: Path) -> subprocess.Popen:
    """The script of a 2-node CPU job, running, its processes waiting for SIGTERM."""
    out = tmp_path / "job.sbatch"
    assert launch("slurm", "olmo3_tiny", "--nodes", 2, "--gpus-per-node", 0, "--out", out,
                  "--run-dir", tmp_path / "run") == 0
    p = subprocess.Popen(["bash", str(out)], env={**env, "FAKE_OLMAX_WAIT": "30"}, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    olmax_calls(calls, 2)
    return p


def test_slurm_time_limit_signal_stops_the_processes_then_requeues(tmp_path, slurm):
    env, calls, slurm_dir = slurm
    p = start_waiting_job(tmp_path, env, calls)
    p.send_signal(signal.SIGUSR1)          # what Slurm sends GRACE seconds before the time limit
    text = p.communicate(timeout=30)[0]
    assert p.returncode == 0, text
    assert all(c["sigterm"] for c in olmax_calls(calls, 2)), "every process gets SIGTERM (and saves)"
    assert recorded(slurm_dir / "scancel.log") == [["--signal=TERM", "4242"]]
    assert recorded(slurm_dir / "scontrol.log") == [["requeue", "4242"]]


def test_slurm_batch_shell_outlives_sigterm_until_the_processes_stop(tmp_path, slurm):
    """Preemption or scancel: Slurm signals the batch shell and the tasks; the shell must not exit
    (ending the job) before the tasks saved their checkpoint, and must not requeue."""
    env, calls, slurm_dir = slurm
    p = start_waiting_job(tmp_path, env, calls)
    p.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert p.poll() is None, "the batch shell exited while the training processes still ran"
    subprocess.run(["scancel", "--signal=TERM", "4242"], env=env, check=True)  # Slurm -> the tasks
    text = p.communicate(timeout=30)[0]
    assert p.returncode == 0, text
    assert all(c["sigterm"] for c in olmax_calls(calls, 2))
    assert recorded(slurm_dir / "scontrol.log") == []


def run_failing_job(tmp_path: Path, slurm, extra_env: dict, *launch_args, restart: int = 0):
    """The script of a 2-node CPU job whose rank 0 waits while rank 1 ends as ``extra_env``
    says; the batch shell's result and what it asked Slurm for."""
    env, calls, slurm_dir = slurm
    out, run_dir = tmp_path / "job.sbatch", tmp_path / "run"
    if not out.exists():
        assert launch("slurm", "olmo3_tiny", "--nodes", 2, "--gpus-per-node", 0, "--out", out,
                      "--run-dir", run_dir, *launch_args) == 0
    env = {**env, "FAKE_OLMAX_WAIT": "30", "SLURM_RESTART_COUNT": str(restart), **extra_env}
    r = subprocess.run(["bash", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    return r, recorded(slurm_dir / "scontrol.log"), recorded(slurm_dir / "sbatch.log")


@pytest.mark.parametrize("rank1, restarted", [
    ("75", True),        # a failure a restart may cure
    ("kill", True),      # killed by a signal (the OOM killer, JAX's abort of a lost peer)
    ("1", True),         # anything else that is not 2 or 3
    ("2", False),        # a configuration or input error: a restart cannot help
    ("3", False),        # the run needs a person
])
def test_slurm_restarts_the_whole_job_unless_a_restart_cannot_help(tmp_path, slurm, rank1, restarted):
    r, scontrol, _ = run_failing_job(tmp_path, slurm, {"FAKE_OLMAX_EXIT_RANK1": rank1})
    code = 137 if rank1 == "kill" else int(rank1)
    assert r.returncode != 0, r.stdout
    exits = tmp_path / "run" / "exits" / "4242.0"
    (line,) = [f.read_text().split() for f in exits.iterdir()]   # rank 1 failed; rank 0 was killed
    assert line[:2] == [str(code), "node1"] and (exits / "1").exists()
    if restarted:
        assert scontrol == [["requeue", "4242"]], r.stdout
        assert "first failure on node1); requeueing, restart 1 of 10" in r.stdout
        assert (tmp_path / "run" / "exits" / "4242.failures").read_text().strip() == "1"
    else:
        assert scontrol == [] and r.returncode == code, r.stdout
        assert f"a process exited with {code}" in r.stdout and "not restarted" in r.stdout


def test_slurm_restart_budget_and_leaving_the_failed_node_out(tmp_path, slurm):
    r, scontrol, _ = run_failing_job(tmp_path, slurm, {"FAKE_OLMAX_EXIT_RANK1": "75"},
                                     "--max-restarts", 1)
    assert scontrol == [["requeue", "4242"]]
    r, scontrol, _ = run_failing_job(tmp_path, slurm, {"FAKE_OLMAX_EXIT_RANK1": "75"}, restart=1)
    assert scontrol == [["requeue", "4242"]] and r.returncode != 0     # no second requeue
    assert "1 restart(s) after failures already, the most --max-restarts allows: giving up" in r.stdout
    # --exclude-failed-node: a new job without the node (Slurm changes ExcNodeList only while a
    # job is pending), carrying the count of restarts
    (tmp_path / "job.sbatch").unlink()
    r, scontrol, sbatch = run_failing_job(tmp_path, slurm, {"FAKE_OLMAX_EXIT_RANK1": "kill"},
                                          "--exclude-failed-node", "--run-dir", tmp_path / "run2")
    assert len(scontrol) == 1, "no requeue: a new job instead"
    (call,) = sbatch
    assert call[:2] == ["--exclude=node1", "--export=ALL,OLMAX_PRIOR_FAILURES=1"], call


def test_slurm_setup_lines_run_without_nounset(tmp_path, slurm):
    """An activation script that reads unset variables (conda's reads PS1) works as --setup."""
    env, calls, _ = slurm
    activate = tmp_path / "activate"
    activate.write_text('if [ -n "$PS1" ]; then :; fi\nexport OLMAX_SETUP_RAN="$UNSET_THING"yes\n')
    out = tmp_path / "job.sbatch"
    assert launch("slurm", "olmo3_tiny", "--nodes", 2, "--gpus-per-node", 0, "--out", out,
                  "--run-dir", tmp_path / "run", "--setup", f"source {activate}") == 0
    r = subprocess.run(["bash", str(out)], env={k: v for k, v in env.items() if k != "PS1"},
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(c["env"]["OLMAX_SETUP_RAN"] == "yes" for c in olmax_calls(calls, 2))


def test_slurm_container_checks_olmax_inside_the_container(tmp_path, slurm):
    """With --container-image only the srun step runs in the image: the batch shell's host has no
    olmax, and the check happens in each task; a missing olmax there is exit 2, not retried."""
    env, calls, slurm_dir = slurm
    bin_dir = install(tmp_path / "bin-no-olmax", ("srun", "scancel", "scontrol", "sbatch"))
    env = {**env, "PATH": f"{bin_dir}{os.pathsep}{os.defpath}"}
    out = tmp_path / "job.sbatch"
    assert launch("slurm", "olmo3_tiny", "--nodes", 2, "--gpus-per-node", 0, "--run-dir",
                  tmp_path / "run", "--out", out, "--srun-option=--container-image=nvcr.io#org/olmax",
                  "--srun-option=--container-mounts=/shared:/shared") == 0
    text = out.read_text()
    assert "--container-mounts=/shared:/shared" in text and "is not on PATH on $(hostname): set up" not in text
    r = subprocess.run(["bash", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "'olmax' is not on PATH on" in r.stderr and "the container image" in r.stderr
    assert recorded(slurm_dir / "scontrol.log") == [] and "not restarted" in r.stdout


def test_slurm_one_process_per_gpu(tmp_path, slurm):
    env, calls, _ = slurm
    out = tmp_path / "job.sbatch"
    assert launch("slurm", "olmo3_tiny", "train.global_batch_size=16", "--nodes", 2,
                  "--gpus-per-node", 4, "--processes-per-node", "gpus", "--run-dir",
                  tmp_path / "run", "--out", out) == 0
    assert "#SBATCH --ntasks-per-node=4" in sbatch_directives(out.read_text()) or \
        "--ntasks-per-node=4" in sbatch_directives(out.read_text())
    r = subprocess.run(["bash", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    got = olmax_calls(calls, 8)
    assert sorted(int(c["env"]["SLURM_PROCID"]) for c in got) == list(range(8))
    assert {c["env"]["SLURM_LOCALID"] for c in got} == {"0", "1", "2", "3"}
    assert all("gpu:8" in c["argv"] and "mesh.data=2" in c["argv"] for c in got)


def k8s_objects(path: Path, kinds=("JobSet",)) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert sorted(d["kind"] for d in docs) == sorted(kinds)
    return [next(d for d in docs if d["kind"] == k) for k in kinds]


def pod_of(job_spec: dict) -> tuple[dict, dict]:
    pod = job_spec["template"]
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "olmax"]
    return pod, c


def test_k8s_jobset_restarts_every_pod_together_and_stops_for_good_on_2_and_3(tmp_path):
    out = tmp_path / "job.yaml"
    assert launch("k8s", "olmo3_tiny", *TRICKY, "--nodes", 2, "--gpus-per-node", 4, "--out", out,
                  "--run-dir", "/mnt/runs/r1", "--image", "registry.example/olmax:1",
                  "--volume-claim", "runs", "--namespace", "ml", "--node-selector",
                  "pool=h100", "--env", "NCCL_DEBUG=INFO", "--max-restarts", 7, "--queue", "team-q",
                  "--cpu", "180", "--memory", "1600Gi") == 0
    (js,) = k8s_objects(out)
    name = js["metadata"]["name"]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["metadata"]["namespace"] == "ml"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-q"
    spec = js["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert spec["failurePolicy"] == {"maxRestarts": 7, "rules": [
        {"name": "stopForGood", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]}
    (rj,) = spec["replicatedJobs"]
    job = rj["template"]["spec"]
    assert rj["replicas"] == 1 and job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == 2
    assert job["backoffLimit"] == 0          # a failed pod fails the Job: the JobSet restarts all
    rules = job["podFailurePolicy"]["rules"]
    by_code = {tuple(r["onExitCodes"]["values"]): r["action"] for r in rules if "onExitCodes" in r}
    assert by_code == {(2, 3): "FailJob", (143,): "Ignore"}
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    pod, c = pod_of(job)
    env = {e["name"]: e.get("value") for e in c["env"]}
    refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    # pod p of replicated job "node", job 0: host <name>-node-0-<p> in the JobSet's Service <name>
    port = c["ports"][0]["containerPort"]
    assert env["OLMAX_COORDINATOR"] == f"{name}-node-0-0.{name}:{port}"
    assert env["OLMAX_NUM_PROCESSES"] == "2" and "OLMAX_PROCESS_ID" not in env
    assert env["XLA_FLAGS"] == GPU_FLAGS and env["NCCL_DEBUG"] == "INFO"
    assert env["JAX_PLATFORMS"] == "cuda" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"
    assert env["OLMAX_CACHE"] == "/mnt/runs/r1/cache"
    assert refs == {"OLMAX_JOB_UID": "metadata.labels['jobset.sigs.k8s.io/jobset-uid']",
                    "OLMAX_RESTART_ATTEMPT": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}
    # Kubernetes expands $(NAME) in a command: the attempt comes from the pod's labels, while the
    # user's text reaches olmax unchanged (TRICKY has a `$HOME`; a `$(x)` would be doubled)
    pod_env = {"OLMAX_JOB_UID": "0b1c-22", "OLMAX_RESTART_ATTEMPT": "3"}
    assert [expand_k8s(a, pod_env) for a in c["command"]] == [
        "olmax", "train", "olmo3_tiny", "--run-dir", "/mnt/runs/r1", "--expect-devices", "gpu:8",
        "--exit-code-on-stop", "143", "--attempt", "0b1c-22.3", *LAUNCHED, "mesh.data=2",
        "mesh.fsdp=4", *TRICKY]
    assert c["image"] == "registry.example/olmax:1"
    assert c["resources"] == {"requests": {"cpu": "180", "memory": "1600Gi"},
                              "limits": {"nvidia.com/gpu": 4}}
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"pool": "h100"}
    assert spec["restartPolicy"] == "Never" and spec["terminationGracePeriodSeconds"] == 300
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["runs"] == "/mnt/runs"
    assert {v["name"]: v for v in spec["volumes"]}["runs"]["persistentVolumeClaim"]["claimName"] == "runs"


def test_k8s_user_text_with_a_reference_reaches_olmax_unexpanded(tmp_path):
    out = tmp_path / "job.yaml"
    weird = "logging.wandb_project=$(HOME)$$x"
    assert launch("k8s", "olmo3_tiny", weird, "--nodes", 1, "--gpus-per-node", 8, "--out", out,
                  "--env", "NOTE=$(HOME)") == 0
    (js,) = k8s_objects(out)
    _, c = pod_of(js["spec"]["replicatedJobs"][0]["template"]["spec"])
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert expand_k8s(c["command"][-1], {"HOME": "/root"}) == weird
    assert expand_k8s(env["NOTE"], {"HOME": "/root"}) == "$(HOME)"


def test_k8s_gpu_fabric_options_and_a_strategic_merge_patch(tmp_path):
    patch = tmp_path / "tcpxo.yaml"
    patch.write_text(
        "metadata:\n  annotations:\n    devices.gke.io/container.tcpxo-daemon: dev\n"
        "spec:\n"
        "  containers:\n"
        "  - name: tcpxo-daemon\n    image: example/tcpxo:1\n"
        "  - name: olmax\n    env:\n    - name: NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY\n      value: /dev/aperture_devices\n"
        "    - name: XLA_FLAGS\n      value: --xla_gpu_enable_latency_hiding_scheduler=true --x=1\n"
        "    volumeMounts:\n    - name: libraries\n      mountPath: /usr/local/nvidia\n"
        "  volumes:\n  - name: libraries\n    hostPath: {path: /home/kubernetes/bin/nvidia}\n"
        "  - name: dshm\n    $patch: delete\n")
    out = tmp_path / "job.yaml"
    assert launch("k8s", "olmo3_tiny", "train.global_batch_size=16", "--nodes", 2,
                  "--gpus-per-node", 8, "--out", out, "--resource", "rdma/ib=1", "--resource", "vpc.amazonaws.com/efa=32",
                  "--annotation", "networking.gke.io/default-interface=eth0", "--host-network",
                  "--patch", patch, "--controller", "jobset") == 0
    (js,) = k8s_objects(out)
    pod, c = pod_of(js["spec"]["replicatedJobs"][0]["template"]["spec"])
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/ib": 1, "vpc.amazonaws.com/efa": 32}
    assert pod["metadata"]["annotations"] == {"networking.gke.io/default-interface": "eth0",
                                              "devices.gke.io/container.tcpxo-daemon": "dev"}
    spec = pod["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert [x["name"] for x in spec["containers"]] == ["olmax", "tcpxo-daemon"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY"] == "/dev/aperture_devices"
    assert env["XLA_FLAGS"].endswith(" --x=1") and list(env).count("XLA_FLAGS") == 1
    assert {m["name"] for m in c["volumeMounts"]} == {"runs", "dshm", "libraries"}
    assert [v["name"] for v in spec["volumes"]] == ["runs", "libraries"]     # dshm deleted
    assert c["command"][:3] == ["olmax", "train", "olmo3_tiny"]            # the rest untouched
    # the merge rules by themselves
    assert strategic_merge({"a": [1, 2], "b": {"c": 1, "d": 2}}, {"a": [3], "b": {"d": None}}) == \
        {"a": [3], "b": {"c": 1}}


def test_k8s_indexed_job_with_headless_service(tmp_path):
    out = tmp_path / "job.yaml"
    assert launch("k8s", "olmo3_tiny", *TRICKY, "--nodes", 2, "--gpus-per-node", 4, "--out", out,
                  "--run-dir", "/mnt/runs/r1", "--controller", "job", "--max-restarts", 5) == 0
    service, job = k8s_objects(out, ("Service", "Job"))
    name = job["metadata"]["name"]
    assert job["apiVersion"] == "batch/v1" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["backoffLimit"] == 10           # 5 restarts of the whole run, 2 pods each
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    pod, c = pod_of(job["spec"])
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OLMAX_COORDINATOR"] == f"{name}-0.{name}:{c['ports'][0]['containerPort']}"
    # One Job, one attempt: a replaced pod 0 waits out the dead holder's lock (never exit 2)
    assert c["command"][c["command"].index("--attempt") + 1] == "$(OLMAX_JOB_UID).0"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {tuple(r["onExitCodes"]["values"]): r["action"] for r in rules if "onExitCodes" in r} \
        == {(2, 3): "FailJob", (143,): "Ignore"}


def test_launch_reads_nothing_at_the_init_paths(tmp_path):
    """The job's ``init.hf_dir`` names the cluster's storage, which this machine may not see, or see
    holding something else: launch passes the path on unread (the trainer reconciles the weights'
    architecture where it runs). Here the path holds an HF directory of another architecture,
    which ``olmax train`` would refuse; launch writes the job."""
    hf = tmp_path / "step0-hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 100278, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}))
    (hf / "model.safetensors").write_bytes(b"")
    out = tmp_path / "job.yaml"
    assert launch("k8s", "olmo3_7b_stage1", f"init.hf_dir={hf}", "train.micro_batch_size=1",
                  "--nodes", 64, "--gpus-per-node", 8,
                  "--out", out) == 0
    (js,) = k8s_objects(out)
    _, c = pod_of(js["spec"]["replicatedJobs"][0]["template"]["spec"])
    assert c["command"][-2:] == [f"init.hf_dir={hf}", "train.micro_batch_size=1"]
    assert "mesh.data=64" in c["command"] and "mesh.fsdp=8" in c["command"]   # HSDP, as AI2 ran


def test_k8s_tpu_slices_one_node_pool_each_the_data_axis_across_them(tmp_path):
    out = tmp_path / "tpu.yaml"
    assert launch("k8s", "olmo3_tiny", "train.global_batch_size=64", "--topology", "v5p-64",
                  "--num-slices", 2, "--out", out) == 0
    (js,) = k8s_objects(out)
    assert js["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    (rj,) = js["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert rj["name"] == "slice" and rj["replicas"] == 2
    assert job["completions"] == job["parallelism"] == 8          # hosts of one v5p-64
    pod, c = pod_of(job)
    spec, name = pod["spec"], js["metadata"]["name"]
    assert spec["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                    "cloud.google.com/gke-tpu-topology": "2x4x4"}
    assert c["resources"]["limits"] == {"google.com/tpu": 4}
    env = {e["name"]: e.get("value") for e in c["env"]}
    refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    assert env["OLMAX_NUM_PROCESSES"] == "16" and env["JAX_PLATFORMS"] == "tpu"
    assert env["MEGASCALE_NUM_SLICES"] == "2"
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == f"{name}-slice-0-0.{name}"
    assert refs["MEGASCALE_SLICE_ID"] == "metadata.labels['jobset.sigs.k8s.io/job-index']"
    assert "XLA_FLAGS" not in env and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
    i = c["command"].index("--expect-devices")
    assert c["command"][i + 1] == "tpu:64" and "mesh.data=2" in c["command"] \
        and "mesh.fsdp=32" in c["command"]
    assert c["image"].startswith("SET-ME") and \
        spec["volumes"][0]["persistentVolumeClaim"]["claimName"].startswith("SET-ME")
    assert launch("k8s", "olmo3_tiny", "--topology", "v5p-64", "--nodes", 2, "--out", out,
                  "--force") == 2


@pytest.mark.parametrize("name", ["tpu7x:4x4x4", "v5p:4x4x4", "v5p-128", "tpu7x-128"])
def test_launch_and_plan_take_the_same_topology_names(tmp_path, name):
    s = parse_tpu(name)
    assert (s.chips, s.hosts, s.topology) == (64, 16, "4x4x4")
    check_topology_name(name)                       # plan: the same spelling is a TPU topology
    assert libtpu_topology(name) == s.libtpu_name   # ... and compiles for the same slice
    out = tmp_path / "job.yaml"
    assert launch("k8s", "olmo3_tiny", "train.global_batch_size=128", "--topology", name,
                  "--out", out) == 0
    (js,) = k8s_objects(out)
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completions"] == 16
    _, c = pod_of(job)
    i = c["command"].index("--expect-devices")
    assert c["command"][i + 1] == f"tpu:{s.devices}"       # tpu7x: two devices per chip
    assert job["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == \
        ("tpu7x" if name.startswith("tpu7x") else "tpu-v5p-slice")


def tpu_vm_worker(tmp_path: Path, out: Path, env: dict) -> tuple[list[str], str]:
    """Run ``bash FILE`` with the stand-in gcloud; the recorded ssh call and the command each
    worker's shell runs."""
    r = subprocess.run(["bash", str(out)], env={**env, "TPU_NAME": "my-slice"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    call = recorded(Path(env["FAKE_SLURM_DIR"]) / "gcloud.log")[-1]
    return call, next(a for a in call if a.startswith("--command=")).split("=", 1)[1]


def tpu_vm_env(tmp_path: Path, **extra) -> dict:
    bin_dir = install(tmp_path / "bin", ("gcloud", "olmax"))
    calls, fake = tmp_path / "olmax-calls", tmp_path / "gcloud"
    calls.mkdir()
    fake.mkdir()
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "FAKE_SLURM_DIR": str(fake), "FAKE_OLMAX_DIR": str(calls), **extra}


def wait_for_exit(pidfile: Path, timeout: float = 30) -> None:
    pid = int(pidfile.read_text())
    deadline = time.time() + timeout
    while Path(f"/proc/{pid}").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the supervisor is still running"


def test_tpu_vm_script_runs_the_same_command_on_every_worker(tmp_path):
    out, run_dir = tmp_path / "tpu.sh", tmp_path / "shared runs" / "r1"
    overrides = [*TRICKY, "train.global_batch_size=16"]
    assert launch("tpu-vm", "olmo3_tiny", *overrides, "--topology", "v4-32", "--out", out,
                  "--run-dir", run_dir, "--zone", "us-central2-b", "--env", "LIBTPU_INIT_ARGS=--x=1",
                  "--setup", "export SETUP_RAN=1") == 0
    env = tpu_vm_env(tmp_path, FAKE_OLMAX_WAIT="30")
    start, command = tpu_vm_worker(tmp_path, out, env)
    assert start[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-slice"]
    assert "--zone=us-central2-b" in start and "--worker=all" in start
    # what each worker's shell runs (here: one worker)
    r = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    (c,) = olmax_calls(Path(env["FAKE_OLMAX_DIR"]), 1)
    start_id = c["argv"][-1].split(".")[0]
    assert c["argv"] == ["train", "olmo3_tiny", "--run-dir", str(run_dir), "--expect-devices",
                         "tpu:16", *LAUNCHED, *overrides, "--attempt", f"{start_id}.0"]
    assert c["env"]["OLMAX_NUM_PROCESSES"] == "4" and c["env"]["JAX_PLATFORMS"] == "tpu"
    assert (run_dir / "logs").is_dir()
    r = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "already running" in r.stderr      # one supervisor per worker

    subprocess.run(["bash", str(out), "stop"], env={**env, "TPU_NAME": "my-slice"}, check=True)
    stop = recorded(Path(env["FAKE_SLURM_DIR"]) / "gcloud.log")[-1]
    assert "--worker=all" in stop
    command = next(a for a in stop if a.startswith("--command=")).split("=", 1)[1]
    subprocess.run(["bash", "-c", command], env=env, check=True, timeout=30)
    wait_for_exit(next((run_dir / "logs").glob("*.pid")))
    assert olmax_calls(Path(env["FAKE_OLMAX_DIR"]), 1)[0]["sigterm"], "stop reaches olmax train"
    assert "stopped (exit 0)" in next((run_dir / "logs").glob("*.log")).read_text()

    r = subprocess.run(["bash", str(out)], env={k: v for k, v in env.items() if k != "TPU_NAME"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "TPU_NAME" in r.stderr    # the SET-ME placeholder is refused


@pytest.mark.parametrize("exits, calls, status", [
    ("75,0", 2, 0),           # a failure a restart may cure, then the run finishes
    ("kill,0", 2, 0),         # a signal: the same
    ("2", 1, 2),              # a configuration error: never restarted
    ("3", 1, 3),              # needs a person: never restarted
    ("75,75,75", 2, 75),      # --max-restarts 1: one restart, then it gives up
])
def test_tpu_vm_supervisor_restarts_only_what_a_restart_may_cure(tmp_path, exits, calls, status):
    out, run_dir = tmp_path / "tpu.sh", tmp_path / "run"
    assert launch("tpu-vm", "olmo3_tiny", "--topology", "v5litepod-8", "--out", out, "--run-dir",
                  run_dir, "--zone", "z", "--max-restarts", 1) == 0
    env = tpu_vm_env(tmp_path, FAKE_OLMAX_EXITS=exits, OLMAX_RESTART_DELAY_S="0.1")
    _, command = tpu_vm_worker(tmp_path, out, env)
    lock = Path("/tmp/libtpu_lockfile")
    subprocess.run(["bash", "-c", command], env=env, check=True, timeout=30)
    wait_for_exit(next((run_dir / "logs").glob("*.pid")))
    got = olmax_calls(Path(env["FAKE_OLMAX_DIR"]), calls)
    start_id = got[0]["argv"][-1].split(".")[0]
    assert sorted(c["argv"][-1] for c in got) == [f"{start_id}.{n}" for n in range(calls)]
    log = next((run_dir / "logs").glob("*.log")).read_text()
    assert (f"restart 1 of 1 (attempt {start_id}.1)" in log) == (calls > 1), log
    assert f"exited with {status}" in log or status == 0, log
    assert not lock.exists() or lock.stat().st_mtime < time.time() - 60   # cleared before starts


@pytest.mark.parametrize("name,chips,hosts,topology,label", [
    ("v4-8", 4, 1, "2x2x1", "tpu-v4-podslice"),
    ("v4-32", 16, 4, "2x2x4", "tpu-v4-podslice"),
    ("v4-4096", 2048, 512, "8x16x16", "tpu-v4-podslice"),
    ("v5p-64", 32, 8, "2x4x4", "tpu-v5p-slice"),
    ("v5p-128", 64, 16, "4x4x4", "tpu-v5p-slice"),
    ("v5p:4x8x4", 128, 32, "4x8x4", "tpu-v5p-slice"),
    ("v5litepod-8", 8, 1, "2x4", "tpu-v5-lite-podslice"),
    ("v5litepod-16", 16, 4, "4x4", "tpu-v5-lite-podslice"),
    ("v5e:4x4", 16, 4, "4x4", "tpu-v5-lite-podslice"),
    ("v5litepod-256", 256, 64, "16x16", "tpu-v5-lite-podslice"),
    ("v6e-1", 1, 1, "1x1", "tpu-v6e-slice"),
    ("v6e-128", 128, 32, "8x16", "tpu-v6e-slice"),
    ("tpu7x-8", 4, 1, "2x2x1", "tpu7x"),
    ("tpu7x:4x4x4", 64, 16, "4x4x4", "tpu7x"),
])
def test_tpu_slices_match_the_published_shapes(name, chips, hosts, topology, label):
    s = parse_tpu(name)
    assert (s.chips, s.hosts, s.topology, s.gke_accelerator) == (chips, hosts, topology, label)
    assert parse_tpu(s.libtpu_name).shape == s.shape          # both spellings name it
    assert parse_tpu(s.accelerator_type).chips == s.chips


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    out.write_text("previous\n")
    patch = tmp_path / "patch.yaml"
    patch.write_text("kind: Pod\n")
    cases = [
        (["slurm", "olmo3_tiny", "train.bogus=1", "--nodes", "1"], "train.bogus"),
        (["slurm", "olmo3_tiny", "--nodes", "3", "--run-dir", "/r"], "divisible"),
        (["slurm", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "3", "--run-dir", "/r"], "divisible"),
        (["slurm", "olmo3_tiny", "--nodes", "2", "--bogus"], "unknown option '--bogus'"),
        (["slurm", "olmo3_tiny"], "--nodes"),
        (["slurm", "olmo3_tiny", "--nodes", "2"], "--run-dir DIR is required for 2 nodes"),
        (["slurm", "no_such_recipe", "--nodes", "1"], "no_such_recipe"),
        (["slurm", "olmo3_tiny", "--nodes", "1", "--name", "Bad_Name"], "--name"),
        (["slurm", "olmo3_tiny", "--nodes", "1", "--processes-per-node", "gpus",
          "--gpus-per-node", "0"], "--processes-per-node gpus needs GPUs"),
        (["slurm", "olmo3_tiny", "--nodes", "1", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["slurm", "olmo3_tiny", "--nodes", "1", "--cpu-devices-per-node", "4", "--gpus-per-node",
          "8"], "exclude each other"),
        (["k8s", "olmo3_tiny", "--nodes", "1", "--run-dir", "/elsewhere/r"], "--mount-path"),
        (["k8s", "olmo3_tiny", "--nodes", "1", "--resource", "rdma/ib"], "--resource 'rdma/ib'"),
        (["k8s", "olmo3_tiny", "--nodes", "1", "--cpu", "lots"], "--cpu 'lots'"),
        (["k8s", "olmo3_tiny", "--nodes", "1", "--patch", patch], "metadata and/or spec"),
        (["k8s", "olmo3_tiny", "--nodes", "1", "--patch", tmp_path / "none.yaml"], "cannot read"),
        (["k8s", "olmo3_tiny", "--nodes", "1", "--controller", "deployment"], "--controller"),
        (["k8s", "olmo3_tiny", "--nodes", "2", "--num-slices", "2"], "--num-slices needs a TPU"),
        (["k8s", "olmo3_tiny", "--topology", "v5p-64", "--num-slices", "2", "--controller", "job"],
         "--num-slices needs --controller jobset"),
        (["k8s", "olmo3_tiny", "--nodes", "1", "--queue", "Q_1"], "--queue 'Q_1'"),
        (["tpu-vm", "olmo3_tiny", "--topology", "v5p-12"], "v5p-12"),
        (["tpu-vm", "olmo3_tiny", "--topology", "v5p:4x4"], "a v5p shape has 3 dimensions"),
        (["tpu-vm", "olmo3_tiny", "train.global_batch_size=16", "--topology", "v4-32"], "--run-dir"),
        (["slurm", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "0", "--grace", "65536",
          "--run-dir", "/r"], "--grace 65536: sbatch --signal takes at most 65535 seconds"),
        (["k8s", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "0", "--namespace", "Team_A"],
         "--namespace 'Team_A'"),
        (["k8s", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "0", "--namespace", "a" * 64],
         "at most 63"),
    ]
    for argv, needle in cases:   # --force: the mistake is found, and still nothing is written
        assert launch(*argv, "--out", out, "--force") == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, (argv, err)
        assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch", "patch.yaml"]
    # The largest grace sbatch takes, and a namespace that is a DNS label, are accepted.
    assert launch("slurm", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "0", "--grace", "65535",
                  "--run-dir", "/r", "--out", out, "--force") == 0
    assert "#SBATCH --signal=B:USR1@65535" in out.read_text()
    assert launch("k8s", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "0", "--namespace",
                  "team-a", "--out", tmp_path / "job.yaml") == 0


def test_out_never_replaces_without_force_nor_the_recipe(tmp_path, capsys):
    """--out refuses an existing file (the user's notes) unless --force, and the recipe it was
    given, a folder or a FIFO even with --force; nothing there changes."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    recipe = tmp_path / "my.yaml"
    recipe.write_text("model: {preset: olmo3-tiny}\ndata: {embedded: true}\n"
                      "train: {seq_len: 32, global_batch_size: 8, max_steps: 2}\n")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases = [
        ([recipe, "--out", notes], f"--out {notes} already exists (remove it or pass --force)"),
        ([recipe, "--out", recipe, "--force"], f"--out {recipe} is the recipe this command reads"),
        ([recipe, "--out", fifo, "--force"], f"--out {fifo} exists and is not a regular file"),
        ([recipe, "--out", tmp_path, "--force"], f"--out {tmp_path} is a directory"),
    ]
    for argv, line in cases:
        assert launch("slurm", *argv, "--nodes", "1") == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"olmax launch: error: {line}") and "\n" not in err, err
    assert notes.read_text() == "my notes\n" and "olmo3-tiny" in recipe.read_text()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert launch("slurm", recipe, "--out", notes, "--nodes", "1", "--force") == 0
    assert notes.read_text().startswith("#!/bin/bash")


def test_train_exit_code_on_stop(monkeypatch, tmp_path):
    """The status the Kubernetes pod failure policy keys on: CODE after a SIGTERM stop only."""
    import olmax.train.trainer as trainer_mod

    stopped = {}

    class FakeTrainer:
        is_main = True

        def __init__(self, cfg, run_dir, quiet=False, attempt=None, expect_devices=None,
                     step_pricer=None):
            stopped["attempt"], stopped["expect"] = attempt, expect_devices
            stopped["pricer"] = step_pricer

        def run(self):
            return {"run_dir": "r", "start_step": 0, "last_step": 2, "first_loss": 1.0,
                    "last_loss": 1.0, "min_loss": 1.0, "tokens_per_sec": None,
                    "stopped_early": stopped["value"]}

    monkeypatch.setattr(trainer_mod, "Trainer", FakeTrainer)
    argv = ["train", "olmo3_tiny", "--run-dir", str(tmp_path), "train.max_steps=2"]
    for early, extra, code in [(True, ["--exit-code-on-stop", "143"], 143),
                               (False, ["--exit-code-on-stop=143"], 0), (True, [], 0)]:
        stopped["value"] = early
        assert main([*argv, *extra]) == code
    assert main([*argv, "--exit-code-on-stop", "300"]) == 2
    assert main([*argv, "--attempt", "job-7.2", "--expect-devices", "gpu:16"]) == 0
    assert (stopped["attempt"], stopped["expect"]) == ("job-7.2", ("gpu", 16))
    # auto's choice by the estimate: the trainer gets the step's price (by the mesh it builds)
    from olmax.perf.step_price import step_pricer
    assert stopped["pricer"] is step_pricer
