"""Context-parallel splash attention compiled by Mosaic for a TPU topology (libtpu on this CPU-only
machine): ``olmax plan`` of the tiny recipe's step on ``v5p:2x2x1`` (priced by its unscanned parts) with context 2 (each 256-token
row in 4 chunks of 64: the sliding windows of 64 take the halo exchange)."""

from __future__ import annotations

import json

import pytest

from olmax.cli import main

pytestmark = [pytest.mark.tpu, pytest.mark.slow]

OVERRIDES = ["train.attn_impl=auto", "train.seq_len=256", "train.micro_batch_size=1"]


def _plan(tmp_path, name, *overrides):
    out = tmp_path / f"{name}.json"
    assert main(["plan", "olmo3_tiny", "--topology", "v5p:2x2x1", *OVERRIDES, *overrides,
                 "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_split_splash_compiles_for_tpu_and_does_one_devices_share(tmp_path):
    one = _plan(tmp_path, "ctx1", "train.global_batch_size=4", "mesh.fsdp=4")
    ctx = _plan(tmp_path, "ctx2", "train.global_batch_size=4", "mesh.context=2", "mesh.fsdp=2")
    assert one["attn_impl"] == ctx["attn_impl"] == "splash"
    kinds = {c["kind"] for c in ctx["collectives"]}
    assert "collective-permute" in kinds                  # the sliding layers' halos
    # Same tokens per device (one row of 256 vs two rows' halves): the split kernels do the same
    # work as one device's whole row (the zig-zag layout balances the causal part), not twice it.
    f1, f2 = one["details"]["kernel_flops"], ctx["details"]["kernel_flops"]
    print("splash kernel FLOPs per device, context 1 vs 2:", f1, f2)
    assert 0.8 * f1 <= f2 <= 1.3 * f1
    # The estimate's parts are what one device runs per micro-batch (one row): under context 2 a
    # row's 128 positions, twice (the same FLOPs outside the kernels as one whole row), not two
    # whole rows.
    assert (one["details"]["n_micro"], ctx["details"]["n_micro"]) == (1, 2)
    g1, g2 = (p["details"]["parts"]["one_layer_group"]["flops"] * p["details"]["n_micro"]
              for p in (one, ctx))
    print("one-layer-group part FLOPs, context 1 vs 2:", g1, g2)
    assert g2 == pytest.approx(g1, rel=0.02)
