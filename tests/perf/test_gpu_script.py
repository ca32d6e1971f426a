"""``benchmarks/gpu_h200.sh`` must run anywhere: without a GPU it runs the same code on a tiny shape."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_attention_kernel_report_on_cpu():
    # No GPU here: the cudnn implementation must compile to the windowed XLA fallback, and say so.
    # (The benchmark runs as a script from its own folder, as it imports its sibling modules.)
    proc = subprocess.run([sys.executable, "-c", "import gpu_bench; print(gpu_bench.cudnn_in_program(16, 48, 4, 8))"],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "XLA chunked (fallback)"


@pytest.mark.slow
def test_gpu_script_runs_tiny_on_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_h200.sh")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| olmo3-7b (4x16) |" in proc.stdout and "| olmo3-7b-16x256 (2x32) |" in proc.stdout
    result = json.loads((tmp_path / "gpu_h200.json").read_text())
    assert [r["attention"] for r in result["rows"]] == ["XLA chunked (fallback)"] * 2
    assert all(r["tokens_per_s"] > 0 and r["mfu_causal"] is None for r in result["rows"])
    # ... then `olmax plan` of the slice on the same device (the tiny recipe here)
    plan = json.loads((tmp_path / "plan_gpu.json").read_text())
    assert plan["device_kind"] == "cpu" and plan["attn_impl"] == "chunked" and plan["memory"]["fits"]
    # ... and what comes back flat beside them: the rates table, each variant's program and profile
    rates = json.loads((tmp_path / "gpu_rates.json").read_text())
    assert rates["device_kind"] == "cpu" and rates["gemm"] and rates["attention"]
    assert all(r["flops_per_s"] == pytest.approx(r["flops"] / r["seconds"]) for r in rates["gemm"])
    for heads in ("4x16", "2x32"):
        assert gzip.decompress((tmp_path / f"hlo_{heads}.txt.gz").read_bytes()).startswith(b"HloModule")
        assert json.loads(gzip.decompress((tmp_path / f"trace_{heads}.json.gz").read_bytes()))["traceEvents"]
    assert "matmul ceiling" in (tmp_path / "log.txt").read_text()
