"""``olmax launch``: the SLURM script, the Kubernetes manifest and the TPU VM script, run against
stand-ins for the cluster tools (``srun``, ``scancel``, ``scontrol``, ``gcloud``) and a recording
``olmax``; the recipe/override checks at generation time. The 2-process training runs these files
drive (losses equal to a 1-process run) are in ``tests/fault/test_launch_multihost.py``."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from olmax.cli import main
from olmax.launch.tpu import parse_topology

sys.path.insert(0, str(Path(__file__).parent))

from fakes import batch_env, install, recorded  # noqa: E402

# Overrides that a careless launcher would mangle: spaces, quotes, $, backticks, YAML lists.
TRICKY = ["train.max_steps=3", "optim.lr=1e-3", "data.paths=[a b.npy, \"c'd.npy\"]",
          "eval.tasks=[]", "logging.wandb_project=it's $HOME `x` \\n"]
GPU_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true"


def launch(*argv: str) -> int:
    return main(["launch", *map(str, argv)])


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
    text = out.read_text()
    assert os.access(out, os.X_OK)
    assert {"--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--exclusive", "--requeue",
            "--signal=B:USR1@120", "--partition=gpu", "--qos=high"} <= set(sbatch_directives(text))
    assert "sbatch" in capsys.readouterr().out
    subprocess.run(["bash", "-n", str(out)], check=True)

    r = subprocess.run(["bash", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    got = olmax_calls(calls, 2)
    for c in got:
        assert c["argv"] == ["train", "olmo3_tiny", "--run-dir", str(run_dir), *TRICKY]
        assert c["env"]["XLA_FLAGS"] == f"--xla_dummy_from_env=1 {GPU_FLAGS}"
        assert c["env"]["NCCL_DEBUG"] == "WARN"
        assert c["env"]["SLURM_STEP_NUM_NODES"] == "2" and c["env"]["SLURM_NTASKS"] == "2"
    assert sorted(c["env"]["SLURM_PROCID"] for c in got) == ["0", "1"]
    assert run_dir.is_dir()
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


def k8s_objects(path: Path) -> tuple[dict, dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert sorted(d["kind"] for d in docs) == ["Job", "Service"]
    return next(d for d in docs if d["kind"] == "Service"), next(d for d in docs if d["kind"] == "Job")


def test_k8s_manifest_indexed_job_with_headless_service(tmp_path):
    out = tmp_path / "job.yaml"
    assert launch("k8s", "olmo3_tiny", *TRICKY, "--nodes", 2, "--gpus-per-node", 4, "--out", out,
                  "--run-dir", "/mnt/runs/r1", "--image", "registry.example/olmax:1",
                  "--volume-claim", "runs", "--namespace", "ml", "--node-selector",
                  "pool=h100", "--env", "NCCL_DEBUG=INFO") == 0
    service, job = k8s_objects(out)
    name = job["metadata"]["name"]
    pod = job["spec"]["template"]
    spec, (c,) = pod["spec"], pod["spec"]["containers"]
    assert job["apiVersion"] == "batch/v1" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert spec["subdomain"] == service["metadata"]["name"]
    assert job["metadata"]["namespace"] == service["metadata"]["namespace"] == "ml"
    env = {e["name"]: e["value"] for e in c["env"]}
    # pod i of an Indexed Job is host <job>-<i> in the Service's domain: the coordinator is pod 0
    port = c["ports"][0]["containerPort"]
    assert env["OLMAX_COORDINATOR"] == f"{name}-0.{spec['subdomain']}:{port}"
    assert service["spec"]["ports"][0]["port"] == port
    assert env["OLMAX_NUM_PROCESSES"] == "2" and "OLMAX_PROCESS_ID" not in env
    assert env["XLA_FLAGS"] == GPU_FLAGS and env["NCCL_DEBUG"] == "INFO"
    assert c["command"] == ["olmax", "train", "olmo3_tiny", "--run-dir", "/mnt/runs/r1",
                            "--exit-code-on-stop", "143", *TRICKY]
    assert c["image"] == "registry.example/olmax:1"
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert spec["nodeSelector"] == {"pool": "h100"}
    assert spec["restartPolicy"] == "Never" and spec["terminationGracePeriodSeconds"] == 300
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["runs"] == "/mnt/runs"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "runs"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    by_code = {r["onExitCodes"]["values"][0]: r["action"] for r in rules if "onExitCodes" in r}
    assert by_code == {143: "Ignore", 2: "FailJob"}
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules


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
    _, job = k8s_objects(out)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][-2:] == [f"init.hf_dir={hf}", "train.micro_batch_size=1"]


def test_k8s_manifest_for_a_tpu_slice(tmp_path):
    out = tmp_path / "tpu.yaml"
    assert launch("k8s", "olmo3_tiny", "train.global_batch_size=32", "--topology", "v5p-64",
                  "--out", out) == 0
    _, job = k8s_objects(out)
    spec = job["spec"]["template"]["spec"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 8
    assert spec["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                    "cloud.google.com/gke-tpu-topology": "2x4x4"}
    (c,) = spec["containers"]
    assert c["resources"]["limits"] == {"google.com/tpu": 4}
    assert "XLA_FLAGS" not in {e["name"] for e in c["env"]}
    assert c["image"].startswith("SET-ME") and \
        spec["volumes"][0]["persistentVolumeClaim"]["claimName"].startswith("SET-ME")
    assert launch("k8s", "olmo3_tiny", "--topology", "v5p-64", "--nodes", 2, "--out", out) == 2


def test_tpu_vm_script_runs_the_same_command_on_every_worker(tmp_path):
    out, run_dir = tmp_path / "tpu.sh", tmp_path / "shared runs" / "r1"
    overrides = [*TRICKY, "train.global_batch_size=16"]
    assert launch("tpu-vm", "olmo3_tiny", *overrides, "--topology", "v4-32", "--out", out,
                  "--run-dir", run_dir, "--zone", "us-central2-b", "--env", "LIBTPU_INIT_ARGS=--x=1",
                  "--setup", "export SETUP_RAN=1") == 0
    bin_dir = install(tmp_path / "bin", ("gcloud", "olmax"))
    calls, fake = tmp_path / "olmax-calls", tmp_path / "gcloud"
    calls.mkdir()
    fake.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "FAKE_SLURM_DIR": str(fake), "FAKE_OLMAX_DIR": str(calls), "FAKE_OLMAX_WAIT": "30"}
    r = subprocess.run(["bash", str(out)], env={**env, "TPU_NAME": "my-slice"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    (start,) = recorded(fake / "gcloud.log")
    assert start[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-slice"]
    assert "--zone=us-central2-b" in start and "--worker=all" in start
    command = next(a for a in start if a.startswith("--command=")).split("=", 1)[1]
    # what each worker's shell runs (here: one worker)
    r = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    (c,) = olmax_calls(calls, 1)
    assert c["argv"] == ["train", "olmo3_tiny", "--run-dir", str(run_dir), *overrides]
    assert c["env"]["OLMAX_NUM_PROCESSES"] == "4"       # v4-32: 4 hosts; JAX finds the rest
    assert (run_dir / "logs").is_dir()

    subprocess.run(["bash", str(out), "stop"], env={**env, "TPU_NAME": "my-slice"}, check=True)
    stop = recorded(fake / "gcloud.log")[-1]
    assert "--worker=all" in stop
    command = next(a for a in stop if a.startswith("--command=")).split("=", 1)[1]
    subprocess.run(["bash", "-c", command], env=env, check=True, timeout=30)
    deadline = time.time() + 30
    while not olmax_calls(calls, 1)[0].get("sigterm") and time.time() < deadline:
        time.sleep(0.05)
    assert olmax_calls(calls, 1)[0]["sigterm"], "stop sends the worker's process SIGTERM"

    r = subprocess.run(["bash", str(out)], env={k: v for k, v in env.items() if k != "TPU_NAME"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "TPU_NAME" in r.stderr    # the SET-ME placeholder is refused


@pytest.mark.parametrize("name,chips,hosts,topology,label", [
    ("v4-8", 4, 1, "2x2x1", "tpu-v4-podslice"),
    ("v4-32", 16, 4, "2x2x4", "tpu-v4-podslice"),
    ("v4-4096", 2048, 512, "8x16x16", "tpu-v4-podslice"),
    ("v5p-64", 32, 8, "2x4x4", "tpu-v5p-slice"),
    ("v5p-128", 64, 16, "4x4x4", "tpu-v5p-slice"),
    ("v5litepod-8", 8, 1, "2x4", "tpu-v5-lite-podslice"),
    ("v5litepod-16", 16, 4, "4x4", "tpu-v5-lite-podslice"),
    ("v5litepod-256", 256, 64, "16x16", "tpu-v5-lite-podslice"),
    ("v6e-1", 1, 1, "1x1", "tpu-v6e-slice"),
    ("v6e-128", 128, 32, "8x16", "tpu-v6e-slice"),
])
def test_tpu_slices_match_the_published_shapes(name, chips, hosts, topology, label):
    s = parse_topology(name)
    assert (s.chips, s.hosts, s.topology, s.gke_accelerator) == (chips, hosts, topology, label)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    out.write_text("previous\n")
    cases = [
        (["slurm", "olmo3_tiny", "train.bogus=1", "--nodes", "2"], "train.bogus"),
        (["slurm", "olmo3_tiny", "--nodes", "3"], "divisible"),
        (["slurm", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "3"], "divisible"),
        (["slurm", "olmo3_tiny", "--nodes", "2", "--bogus"], "--bogus"),
        (["slurm", "olmo3_tiny"], "--nodes"),
        (["slurm", "no_such_recipe", "--nodes", "1"], "no_such_recipe"),
        (["slurm", "olmo3_tiny", "--nodes", "1", "--name", "Bad_Name"], "--name"),
        (["k8s", "olmo3_tiny", "--nodes", "1", "--run-dir", "/elsewhere/r"], "--mount-path"),
        (["tpu-vm", "olmo3_tiny", "--topology", "v5p-12"], "v5p-12"),
        (["tpu-vm", "olmo3_tiny", "train.global_batch_size=16", "--topology", "v4-32"], "--run-dir"),
        (["slurm", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "0", "--grace", "65536"],
         "--grace 65536: sbatch --signal takes at most 65535 seconds"),
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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch"]
    # The largest grace sbatch takes, and a namespace that is a DNS label, are accepted.
    assert launch("slurm", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "0", "--grace", "65535",
                  "--out", out, "--force") == 0
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

        def __init__(self, cfg, run_dir, quiet=False):
            pass

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
