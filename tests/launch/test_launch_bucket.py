"""``olmax launch`` with a bucket run directory (``--run-dir gs://...`` / ``s3://...``): the jobs it
writes need no shared file system and say so (no volume claim on Kubernetes, the workers' logs
node-local on TPU VMs, no cache in the bucket); Slurm, whose job script keeps its exit files in
the run directory, refuses one in one line."""

from __future__ import annotations

import yaml

from olmax.cli import main


def test_k8s_bucket_run_dir_has_no_shared_volume(tmp_path, capsys):
    out = tmp_path / "job.yaml"
    assert main(["launch", "k8s", "olmo3_tiny", "--topology", "v5p-16", "--image", "img:1",
                 "--run-dir", "gs://my-runs/tiny/", "--out", str(out)]) == 0
    text = out.read_text()
    assert "no shared volume is needed" in text and "SET-ME-shared-volume-claim" not in text
    assert "--volume-claim" not in capsys.readouterr().out        # nothing left to set by hand
    pod = next(d for d in yaml.safe_load_all(text) if d and d.get("kind") == "JobSet")
    spec = pod["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["dshm"]
    container = spec["containers"][0]
    command = container["command"]
    assert command[command.index("--run-dir") + 1] == "gs://my-runs/tiny"
    assert "OLMAX_CACHE" not in {e["name"] for e in container["env"]}   # caches stay local


def test_tpu_vm_bucket_run_dir_keeps_logs_on_the_workers(tmp_path):
    out = tmp_path / "run.sh"
    assert main(["launch", "tpu-vm", "olmo3_tiny", "--topology", "v5p-16", "--tpu-name", "t",
                 "--zone", "z", "--run-dir", "gs://my-runs/tiny", "--out", str(out)]) == 0
    text = out.read_text()
    assert "is a bucket path: no shared file system" in text
    assert 'dir="$HOME/olmax-logs/"olmax-olmo3-tiny' in text
    assert "gs://my-runs/tiny/logs" not in text


def test_slurm_refuses_a_bucket_run_dir_in_one_line(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", "olmo3_tiny", "--nodes", "2", "--gpus-per-node", "8",
                 "--run-dir", "s3://my-runs/tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a bucket path; the Slurm job script" in err, err
    assert not out.exists()
