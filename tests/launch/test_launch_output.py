"""What ``olmax launch`` writes is checked like what it reads: after ``--patch`` and the options
are applied the pod template still holds the training container with its command, restarts
``Never`` (the pod failure policy requires it) and asks for the devices the job was written for;
counts fit the API's int32; a TPU shape must be a real slice; a patch is read with a recipe's YAML
limits. Each refusal is one line naming the flag, exit 2, and nothing is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmax.cli import main

ROOT = Path(__file__).resolve().parents[2]
K8S = ["launch", "k8s", "olmo3_tiny", "--nodes", "1", "--gpus-per-node", "8",
       "--run-dir", "/mnt/runs/r"]

PATCHES = {
    "no-container.yaml": ("spec:\n  containers:\n  - name: olmax\n    $patch: delete\n",
                          "--patch removes the training container 'olmax' from the pod template"),
    "no-command.yaml": ("spec:\n  containers:\n  - name: olmax\n    command: []\n",
                        "--patch removes the command of the training container 'olmax'"),
    "restart.yaml": ("spec:\n  restartPolicy: OnFailure\n",
                     "--patch sets restartPolicy 'OnFailure'; the job's pod failure policy"),
    "gpus.yaml": ("spec:\n  containers:\n  - name: olmax\n    resources:\n      limits:\n"
                  "        nvidia.com/gpu: 4\n",
                  "--patch sets the training container's nvidia.com/gpu limit to 4, but the job "
                  "was written for 8 per pod"),
    "deep.yaml": ("spec:\n  x: " + "[" * 300 + "]" * 300 + "\n",
                  "--patch deep.yaml: more than 100 levels of nesting"),
    "deeper.yaml": ("spec:\n  x: " + "[" * 5000 + "]" * 5000 + "\n",
                    "--patch deeper.yaml: invalid YAML (nested deeper than olmax reads)"),
}


def _refused(capsys, argv, expect, out):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expect in err, err
    assert not out.exists()


@pytest.mark.parametrize("name", sorted(PATCHES))
def test_a_patch_the_cluster_would_refuse_or_misread_is_refused(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    text, expect = PATCHES[name]
    Path(name).write_text(text)
    _refused(capsys, [*K8S, "--patch", name, "--out", "job.yaml"], expect, tmp_path / "job.yaml")


def test_a_patch_that_keeps_what_the_job_needs_is_applied(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("ok.yaml").write_text("metadata:\n  labels:\n    team: a\nspec:\n  containers:\n"
                               "  - name: olmax\n    resources:\n      limits:\n"
                               "        nvidia.com/gpu: 8\n        rdma/ib: 1\n")
    assert main([*K8S, "--patch", "ok.yaml", "--out", "job.yaml"]) == 0
    text = Path("job.yaml").read_text()
    assert "team: a" in text and "rdma/ib: 1" in text and "restartPolicy: Never" in text


def test_a_resource_that_replaces_the_gpu_count_is_refused(tmp_path, capsys):
    _refused(capsys, [*K8S, "--resource", "nvidia.com/gpu=4", "--out", str(tmp_path / "j.yaml")],
             "--resource nvidia.com/gpu=4 would replace the 8 the job was written for",
             tmp_path / "j.yaml")


@pytest.mark.parametrize("target", ["k8s", "slurm"])
def test_max_restarts_beyond_int32_is_refused(tmp_path, capsys, target):
    argv = ["launch", target, "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "8",
            "--run-dir", "/mnt/runs/r", "--max-restarts", "1100000000", "--out", str(tmp_path / "j")]
    _refused(capsys, argv, "--max-restarts 1100000000 times 2 node(s) exceeds 2,147,483,647",
             tmp_path / "j")


@pytest.mark.parametrize("shape", ["v5p:3x3x3", "v6e:3x3", "tpu7x:2x2x8", "v5e:1x2", "v6e:4x16"])
def test_a_tpu_shape_that_is_no_slice_is_refused(tmp_path, capsys, shape):
    _refused(capsys, ["launch", "k8s", "olmo3_tiny", "--topology", shape, "--run-dir",
                      "/mnt/runs/r", "--out", str(tmp_path / "j.yaml")],
             f"--topology '{shape}': {shape.split(':')[1]} is no {shape.split(':')[0]} slice",
             tmp_path / "j.yaml")


def test_a_patch_alias_bomb_is_refused_at_once(tmp_path):
    """It used to expand (9^10 values) until the machine gave up: a process, with a deadline."""
    bomb = ["spec:", "  a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    bomb += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    (tmp_path / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-m", "olmax.cli", *K8S, "--patch", "bomb.yaml",
                          "--out", "job.yaml"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "--patch bomb.yaml: more than 1,000,000 values once its YAML aliases" in out.stderr
    assert not (tmp_path / "job.yaml").exists()


def test_tpu_vm_overrides_beyond_one_argument_are_refused(tmp_path, capsys):
    """The start command reaches every worker as one argument (gcloud --command): two overrides
    that each fit but together do not used to make a script that failed on every worker."""
    half = ",".join(f"/data/shard-{i:06d}.npy" for i in range(3000))
    argv = ["launch", "tpu-vm", "olmo3_tiny", "--topology", "v5p:2x2x1", "--run-dir", "/mnt/r",
            f"data.paths=[{half}]", f"eval.heldout=[{half}]", "--out", str(tmp_path / "o.sh")]
    _refused(capsys, argv, "more than one argument of gcloud --command may hold (131,072); put long "
                           "values in a recipe file", tmp_path / "o.sh")
    assert main([*argv[:7], f"data.paths=[{half}]", "--out", str(tmp_path / "o.sh")]) == 0
