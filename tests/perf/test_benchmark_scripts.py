"""The benchmark scripts that need no peer framework run end to end on a tiny shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--set=model.d_model=32", "--set=model.mlp_hidden=64", "--set=train.seq_len=32",
        "--set=train.global_batch_size=2"]

pytestmark = pytest.mark.slow


def _failure(stderr: str) -> str:
    """What a failed script said: from its own error line on when it printed one (the
    tracebacks libraries print at exit come after it), else the end of stderr."""
    at = stderr.find(": error: ")
    start = stderr.rfind("\n", 0, at) + 1 if at >= 0 else max(0, len(stderr) - 3000)
    return stderr[start:start + 3000]


def test_xla_flags_ab(tmp_path):
    out = tmp_path / "flags.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "xla_flags.py"), *TINY,
                           "--rounds", "2", "--variant", "same=", "--variant",
                           "bogus=--xla_cpu_no_such_flag=1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc.stderr)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    # the defaults in a second process reproduce the baseline's losses bit for bit
    assert rows["same"]["losses_bit_identical"] is True and rows["same"]["loss_max_rel_diff"] == 0
    assert rows["same"]["program_identical"] is True
    assert len(rows["same"]["speedup_per_round"]) == 2 and rows["same"]["speedup_median"] > 0
    # an unknown flag is reported as that variant's failure, not a crash of the benchmark
    assert "xla_cpu_no_such_flag" in rows["bogus"]["error"]
    assert "| same | `` |" in proc.stdout


def test_convert_scale_round_trip(tmp_path):
    out = tmp_path / "convert.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "convert_scale.py"),
                           "--preset", "olmo3-1m", "--shard-gb", "0.0005", "--work",
                           str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc.stderr)
    r = json.loads(out.read_text())
    assert r["round_trip_bit_exact"] and r["tensors_compared"] == r["n_tensors"] > 0
    from olmax.interop.hf import hf_tensor_shapes
    from olmax.model.presets import get_preset

    shapes = hf_tensor_shapes(get_preset("olmo3-1m"))
    assert r["hf_bytes"] == 2 * sum(int(np.prod(s)) for s in shapes.values())  # bf16, all tensors
    assert r["import"]["peak_rss_bytes"] > 0 and r["export"]["peak_rss_bytes"] > 0
    assert not (tmp_path / "work").exists()  # cleaned up without --keep


def test_convert_scale_sparse(tmp_path):
    """``--sparse``: headers and holes with a first and last row per tensor, the import alone,
    the checkpoint read back through the export's reader."""
    out = tmp_path / "convert.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "convert_scale.py"),
                           "--preset", "olmo3-1m", "--sparse", "--shard-gb", "0.0005", "--work",
                           str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc.stderr)
    r = json.loads(out.read_text())
    assert r["checkpoint_equal"] and r["tensors_compared"] == r["n_tensors"] > 0
    assert r["import"]["peak_rss_bytes"] > 0 and "export" not in r


def test_remote_read(tmp_path):
    out = tmp_path / "remote.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "remote_read.py"),
                           "--files", "2", "--tokens-per-file", "20000", "--seq-len", "64",
                           "--batch", "4", "--batches", "2", "--rounds", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc.stderr)
    r = json.loads(out.read_text())
    assert r["same_batches"] is True and set(r["sources"]) == {"local", "http", "s3"}
    assert all(len(s["seconds_per_round"]) == 2 and s["MB_per_s"] > 0 for s in r["sources"].values())


def test_bucket_checkpoint(tmp_path):
    out = tmp_path / "ckpt.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bucket_checkpoint.py"),
                           "--gb", "0.003", "--d-model", "32", "--set=model.vocab_size=256",
                           "--set=model.padded_vocab_size=256", "--rounds", "1", "--steps", "2",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc.stderr)
    r = json.loads(out.read_text())
    assert 0.002e9 < r["state_bytes"] < 0.004e9
    assert set(r["summary"]) == {"local", "s3", "gs"}
    for s in r["summary"].values():
        assert s["restored_equal"] is True and s["save_s"] > 0 and s["restore_s"] > 0
        assert s["async_steps"] >= 1 and 0 < s["save_blocking_s"] <= s["save_s"]
    assert "| s3 |" in proc.stdout and "| gs |" in proc.stdout
