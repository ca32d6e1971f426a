"""``benchmarks/tpu.sh`` must run anywhere: without a TPU it runs the same code on tiny shapes, and
what it writes for the chip's run (the table, the JSON, each row as a calibration case) is checked
here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from olmax.perf.calibration_cases import validate

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tpu_script_runs_tiny_on_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "tpu.sh"), "--rows", "olmo3-190m,7b-slice",
                           "--steps", "2"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| olmo3-190m | 4 x 64 | 4 | none |" in proc.stdout and "| 7b-slice | 4 x 64 |" in proc.stdout
    result = json.loads((tmp_path / "tpu.json").read_text())
    assert result["tiny"] and result["versions"]["device"] == "cpu"
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["auto"] == ["micro_batch_size", "remat"]
        assert row["peak_memory_bytes"] <= row["memory_limit_bytes"]
        assert row["plan"]["fits"] is True        # planned for the local devices on a CPU
    for path in sorted((tmp_path / "cases").glob("*.yaml")):
        case = validate(yaml.safe_load(path.read_text()), path.stem)
        assert case["peer"]["program"] == "olmax" and case["topology"] == "v5e:1x1"
        assert "train.micro_batch_size=4" in case["peer"]["args"] and "train.remat=none" in case["peer"]["args"]
        # the kernels, the layer loop, the loss chunk (the tpu profile's 4096 rows per device at
        # micro-batch 4) and the gradient accumulation as measured, whatever the defaults become
        assert {"train.splash_block=1024", "train.splash_fused_bwd=true", "train.unroll_layers=true",
                "train.loss_chunk_rows=4096", "train.accumulate_by_layer=true",
                "train.accumulate_embedding_by_row=true"} <= set(case["peer"]["args"])
        # and the compiler's options: v5e's scoped VMEM (olmax.hardware), whatever its default becomes
        assert "train.compiler_options=[xla_tpu_scoped_vmem_limit_kib=32768]" in case["peer"]["args"]
        assert case["measured"]["step_s"] > 0
    assert "matmul ceiling" in (tmp_path / "log.txt").read_text()


@pytest.mark.slow
def test_tpu_ab_script_runs_tiny_on_cpu(tmp_path):
    """``benchmarks/tpu_ab.sh``, the TPU defaults against the ones before them, runs the same
    commands on tiny shapes without a TPU: every leg compiled and timed; the legs before pin what
    the defaults were (blocks of 128 here, where the chip's are 512). Tiny, the 190m and 370m rows
    are the same program: they run the compiler's legs and the micro-batch's."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "tpu_ab.sh"), "600m", "slice"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for row, remat, micro in (("600m", "save_kernels", 2), ("slice", "none", 2)):
        result = json.loads((tmp_path / f"ab_{row}.json").read_text())
        assert list(result["legs"]) == ["base", "before"] + (["full"] if row == "600m" else [])
        assert result["legs"]["before"]["overrides"] == [
            "train.splash_block=128", "train.unroll_layers=false", f"train.loss_chunk_rows={64 * micro}"]
        for name, leg in result["legs"].items():
            assert leg["remat"] == ("full" if name == "full" else remat) and leg["step_s"] > 0
        assert result["legs"]["base"]["ratio_to_first"] == 1.0
    log = (tmp_path / "log.txt").read_text()
    assert "== A/B slice" in log and "== done" in log
    bad = subprocess.run(["bash", str(ROOT / "benchmarks" / "tpu_ab.sh"), "1b"], env=dict(env, OUT=""),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown row '1b'" in bad.stdout

    def legs_of(mode: str, row: str) -> dict:     # the row with TPU_AB_LEGS=mode
        proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "tpu_ab.sh"), row],
                              env=dict(env, OUT=str(tmp_path / mode), TPU_AB_LEGS=mode),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return json.loads((tmp_path / mode / f"ab_{row}.json").read_text())["legs"]

    # the compiler's legs, each compiled with its options (the CPU's in place of the TPU's VMEM)
    legs = legs_of("compiler", "190m")
    assert {n: leg["overrides"] for n, leg in legs.items()} == {
        "base": [], "vmem96": ["train.compiler_options=[xla_cpu_enable_fast_math=false]"],
        "b2048": ["train.compiler_options=[xla_cpu_enable_fast_math=false]", "train.splash_block=256"],
        "nolicm": ["train.compiler_options=[xla_disable_hlo_passes=while-loop-invariant-code-motion]"]}
    assert all(leg["step_s"] > 0 for leg in legs.values())
    # the defaults against libtpu's own scoped VMEM (the CPU's option in its place)
    legs = legs_of("vmem", "slice")
    assert {n: leg["overrides"] for n, leg in legs.items()} == {
        "base": [], "vmem16": ["train.compiler_options=[xla_cpu_enable_fast_math=false]"]}
    # the per-layer accumulation against the stacked one, on the 600m's best row
    legs = legs_of("accumulate", "600m1")
    assert {n: (leg["overrides"], leg["micro_batch_size"], leg["remat"]) for n, leg in legs.items()} == {
        "base": ([], 1, "none"), "stacked": (["train.accumulate_by_layer=false"], 1, "none")}
    # the embedding's rows against a whole table per micro-batch
    legs = legs_of("embedding", "370m")
    assert {n: (leg["overrides"], leg["micro_batch_size"]) for n, leg in legs.items()} == {
        "base": ([], 1), "whole": (["train.accumulate_embedding_by_row=false"], 1)}
    # a micro-batch against twice it
    legs = legs_of("micro", "370m")
    assert [(n, leg["micro_batch_size"]) for n, leg in legs.items()] == [("base", 1), ("double", 2)]
    # the micro-batches auto chooses among, side by side (tiny: 2 rows per device)
    legs = legs_of("micros", "190m")
    assert [(n, leg["micro_batch_size"], leg["remat"]) for n, leg in legs.items()] == [
        ("m1", 1, "none"), ("m2", 2, "none")]
