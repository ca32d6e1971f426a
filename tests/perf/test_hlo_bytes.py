"""The per-op bytes of an optimized HLO text (``olmax.perf.hlo.device_ops``, and the summary of
``olmax.perf.hlo.summary``, and ``benchmarks/tpu_hlo_bytes.py`` run as a script), checked on a
hand-written program whose bytes are counted by hand, and the plan's parts written as HLO."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from olmax.model.runtime import Runtime
from olmax.perf import hlo
from olmax.perf.costs import part_costs
from olmax.train.recipes import load_recipe

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tpu_hlo_bytes.py"


def tpu_hlo_bytes(*args: str) -> int:
    """The script's exit status, run as a user runs it."""
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=600).returncode

# A loop of 3 trips copying 8-row slices of x into a buffer (slice and in-place update fusions),
# a bf16 -> f32 square, a copy into another memory space (S(1)) and a transpose. Operands are
# printed by name only, as TPU programs print them.
HAND = """HloModule jit_f, is_scheduled=true

FileNames
1 "/x/model.py"

FunctionNames
1 "outer"
2 "norm"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}

%fused_slice (param_0: f32[64,128], param_1: s32[]) -> f32[8,128] {
  %param_0 = f32[64,128]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[8,128]{1,0} dynamic-slice(%param_0, %param_1, %c), dynamic_slice_sizes={8,128}
}

%fused_dus (param_0.1: f32[64,128], param_1.1: f32[8,128], param_2.1: s32[]) -> f32[64,128] {
  %param_0.1 = f32[64,128]{1,0} parameter(0)
  %param_1.1 = f32[8,128]{1,0} parameter(1)
  %param_2.1 = s32[] parameter(2)
  %c.1 = s32[] constant(0)
  ROOT %dus = f32[64,128]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2.1, %c.1)
}

%fused_mul (param_0.2: bf16[32,128]) -> f32[32,128] {
  %param_0.2 = bf16[32,128]{1,0} parameter(0)
  %cv = f32[32,128]{1,0} convert(%param_0.2)
  ROOT %m = f32[32,128]{1,0} multiply(%cv, %cv)
}

%body (p: (s32[], f32[64,128], f32[64,128])) -> (s32[], f32[64,128], f32[64,128]) {
  %p = (s32[], f32[64,128]{1,0}, f32[64,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %src = f32[64,128]{1,0} get-tuple-element(%p), index=1
  %dst = f32[64,128]{1,0} get-tuple-element(%p), index=2
  %sl = f32[8,128]{1,0} fusion(%src, %i), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(f)/while/body/dynamic_slice" stack_frame_id=1}
  %up = f32[64,128]{1,0} fusion(%dst, %sl, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(f)/while/body/dynamic_update_slice" stack_frame_id=1}
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[64,128]{1,0}, f32[64,128]{1,0}) tuple(%i2, %src, %up)
}

%cond (p.1: (s32[], f32[64,128], f32[64,128])) -> pred[] {
  %p.1 = (s32[], f32[64,128]{1,0}, f32[64,128]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x: f32[64,128], y: bf16[32,128]) -> (f32[64,128], f32[32,128], f32[128,32]) {
  %x = f32[64,128]{1,0} parameter(0)
  %y = bf16[32,128]{1,0} parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], f32[64,128]{1,0}, f32[64,128]{1,0}) tuple(%z, %x, %x)
  %w = (s32[], f32[64,128]{1,0}, f32[64,128]{1,0}) while(%init), condition=%cond, body=%body
  %r = f32[64,128]{1,0} get-tuple-element(%w), index=2
  %sq = f32[32,128]{1,0} fusion(%y), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(f)/transpose(jvp())/mul" stack_frame_id=2}
  %vm = f32[32,128]{1,0:S(1)} copy(%sq), metadata={op_name="jit(f)/copy"}
  %tr = f32[128,32]{0,1} transpose(%sq), dimensions={1,0}, metadata={op_name="jit(f)/transpose" stack_frame_id=2}
  ROOT %out = (f32[64,128]{1,0}, f32[32,128]{1,0}, f32[128,32]{0,1}) tuple(%r, %sq, %tr)
}
"""


def test_bytes_per_op_counted_by_hand(tmp_path):
    rows = {r["name"]: r for r in hlo.device_ops(HAND)}
    slab = 8 * 128 * 4                                   # one f32[8,128] slice
    # slice fusion: reads the slice (not the whole f32[64,128]) and the s32 index, writes the slice
    assert rows["sl"]["mult"] == 3 and rows["sl"]["read"] == 3 * (slab + 4) and rows["sl"]["written"] == 3 * slab
    # in-place update: the update and the index read, the update written; the buffer is aliased
    assert rows["up"]["read"] == 3 * (slab + 4) and rows["up"]["written"] == 3 * slab
    assert rows["sq"]["read"] == 32 * 128 * 2 and rows["sq"]["written"] == 32 * 128 * 4
    assert rows["vm"]["read"] == 32 * 128 * 4 and rows["vm"]["written"] == 0      # S(1) is not HBM
    assert rows["tr"]["bytes"] == 2 * 32 * 128 * 4
    assert rows["lt"]["mult"] == 4 and rows["i2"]["mult"] == 3     # loop condition runs n + 1 times
    assert {"x", "init", "w", "r", "out", "z"}.isdisjoint(rows)     # parameters, tuples, loops move nothing
    s = hlo.summary(list(rows.values()))
    sq, vm, tr = 32 * 128 * (2 + 4), 32 * 128 * 4, 2 * 32 * 128 * 4
    assert s["total_bytes"] == 6 * (2 * slab + 4) + sq + vm + tr + 3 * 12 + 4 * 9
    assert s["kind"]["fusion kLoop"]["ops"] == 7 and s["kind"]["transpose"]["ops"] == 1
    assert s["line"]["model.py:20 norm"]["ops"] == 2 and s["stack"]["norm<outer"]["ops"] == 2
    assert s["pass"]["bwd"]["ops"] == 1 and s["prim"]["dynamic_slice"]["ops"] == 3
    f = tmp_path / "hand.hlo.txt"
    f.write_text(HAND)
    assert tpu_hlo_bytes("compare", f, f, "--top", "3") == 0
    assert tpu_hlo_bytes("show", tmp_path / "missing") == 2



ASYNC = """HloModule async_slices

%update (buf: bf16[8,64,128], i: s32[], u: bf16[64,128]) -> bf16[8,64,128] {
  %buf = bf16[8,64,128]{2,1,0} parameter(0)
  %u = bf16[64,128]{1,0} parameter(2)
  %b = bf16[1,64,128]{2,1,0} bitcast(%u)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %dus = bf16[8,64,128]{2,1,0} dynamic-update-slice(%buf, %b, %i, %zero, %zero)
}

ENTRY %main (stack: bf16[8,64,128], i: s32[], u: bf16[64,128]) -> bf16[1,64,128] {
  %stack = bf16[8,64,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %u = bf16[64,128]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %fs = ((bf16[8,64,128]{2,1,0}, s32[], bf16[64,128]{1,0}), bf16[8,64,128]{2,1,0}, u32[]) fusion-start(%stack, %i, %u), kind=kLoop, calls=%update
  %fd = bf16[8,64,128]{2,1,0} fusion-done(%fs)
  ROOT %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%fd, %i, %zero, %zero), dynamic_slice_sizes={1,64,128}
}
"""


def test_async_in_place_updates_and_slices_move_their_slice():
    """GPU programs wrap an in-place update of a stacked buffer (a scanned layer's saved
    activations) in an async fusion, and read a layer's slice back with a plain dynamic-slice:
    each moves the slice, not the stacked buffer (8 slices here)."""
    rows = {r["name"]: r for r in hlo.device_ops(ASYNC)}
    slab = 64 * 128 * 2
    assert (rows["fs"]["read"], rows["fs"]["written"]) == (slab + 4, slab)
    assert (rows["ds"]["read"], rows["ds"]["written"]) == (slab + 2 * 4 + 4, slab)
    assert "fd" not in rows                 # the async pair is one op, counted at its start


@pytest.mark.slow
def test_plan_parts_written_as_hlo_and_stacked_groups(tmp_path):
    """The parts' HLO is written where asked; part A at 2 layer groups adds one group's FLOPs
    (A at 1 group minus the head part: the embedding's FLOPs aside, the same)."""
    overrides = ["train.remat=full", "model.vocab_size=256", "model.padded_vocab_size=256"]
    cfg = load_recipe("olmo3_tiny", overrides)
    runtime = Runtime.of(cfg.train, attn_impl="xla")
    one = part_costs(cfg, jax.devices()[0], 1, 1, 1, runtime, only=("A", "H"), hlo_dir=str(tmp_path))
    assert set(one) == {"A", "H"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part_A.hlo.txt", "part_H.hlo.txt"]
    rows = hlo.device_ops((tmp_path / "part_H.hlo.txt").read_text())
    # the head's logits [1, 128, 256] in fp32 are written at least once
    assert sum(r["written"] for r in rows) >= 128 * 256 * 4
    two = part_costs(cfg, jax.devices()[0], 1, 1, 1, runtime, only=("A",), groups=2)
    group = two["A"]["flops"] - one["A"]["flops"]
    assert group == pytest.approx(one["A"]["flops"] - one["H"]["flops"], rel=0.01)


def test_group_matmuls_counts_every_product_once(tmp_path):
    """The floor program holds each of a group's products, none shared: XLA's FLOPs equal
    2 x rows x the weights' elements x layers x passes (fwd, recomputed fwd, dx, dW under full
    remat; 3 without remat), counted by hand for olmo3-tiny. In fp32: the CPU computes bf16
    products in fp32 and XLA counts the conversions as FLOPs."""
    out = tmp_path / "mm.json"
    assert tpu_hlo_bytes("matmuls", "olmo3_tiny", "train.remat=full", "--dtype", "float32", "--json", out) == 0
    r = json.loads(out.read_text())
    cfg = load_recipe("olmo3_tiny", ["train.remat=full"])
    m = cfg.model
    d, q, kv, f = m.d_model, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.mlp_hidden
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    rows = r["rows_per_device"]
    assert r["layers_per_group"] == len(m.window_pattern) == 4
    assert r["flops_xla"] == r["flops_counted"] == 2 * rows * per_layer * 4 * 4
    assert tpu_hlo_bytes("matmuls", "olmo3_tiny", "train.remat=none", "--dtype", "float32", "--json", out) == 0
    assert json.loads(out.read_text())["flops_xla"] == 2 * rows * per_layer * 4 * 3
    assert tpu_hlo_bytes("matmuls", "olmo3_tiny", "train.remat=dots") == 2
