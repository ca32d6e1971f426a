"""olmax plan's TPU step time from a table of rates measured on the chip
(:func:`olmax.perf.gpu_estimate.tpu_kernels`): the program forms it reads (matmuls written as
convolutions, multi-output fusions updating stacked buffers in place, asynchronous copies), the
products' forms, the grid's dispatch-bound points, and a step compiled for v5e:1x1 priced against
hand-computed FLOPs and against its measurement on a v5e chip."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import yaml

from olmax.hardware import BY_NAME
from olmax.model.flops import flops_per_token
from olmax.model.splash import kernel_flops
from olmax.perf import gpu_estimate, hlo
from olmax.perf.gpu_rates import measure, splash_rates
from olmax.train.recipes import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "tpu_v5e_2026-12-06_round3"
CASE = ROOT / "benchmarks" / "calibration" / "olmax_olmo3_190m_v5e_1x1_round3.yaml"

# A TPU writes the backward of ``...o,io->...i`` over 16 heads as a convolution whose spatial
# dimension is the heads: a window of 16, padded by 15 on each side, over a one-element input.
# Each output element then meets one input element, not 16.
CONV_HLO = """HloModule m

ENTRY %main (a: f32[4096,1,64], w: f32[16,64,128], x: f32[8,5,4], k: f32[3,4,2]) -> (f32[4096,16,128], f32[8,3,2]) {
  %a = f32[4096,1,64]{2,1,0} parameter(0)
  %w = f32[16,64,128]{2,1,0} parameter(1)
  %heads = f32[4096,16,128]{2,1,0} convolution(%a, %w), window={size=16 pad=15_15 rhs_reversal=1}, dim_labels=b0f_0io->b0f
  %x = f32[8,5,4]{2,1,0} parameter(2)
  %k = f32[3,4,2]{2,1,0} parameter(3)
  %plain = f32[8,3,2]{2,1,0} convolution(%x, %k), window={size=3}, dim_labels=b0f_0io->b0f
  ROOT %t = (f32[4096,16,128]{2,1,0}, f32[8,3,2]{2,1,0}) tuple(%heads, %plain)
}
"""


def test_a_convolution_counts_the_window_taps_that_meet_its_input():
    flops = hlo.dot_flops(CONV_HLO)
    assert flops["heads"] == 2 * 4096 * 16 * 128 * 64 * 1      # one tap per output element
    assert flops["plain"] == 2 * 8 * 3 * 2 * 4 * 3              # no padding: every tap of 3


# A rolled layer scan stores each layer's activations into stacked buffers: a fusion whose root
# is a tuple of dynamic-update-slices of its parameters updates them in place.
STACK_HLO = """HloModule m

%fused (p0: bf16[3,8,128], p1: bf16[3,8,128], p2: bf16[8,128], p3: s32[]) -> (bf16[3,8,128], bf16[3,8,128]) {
  %p0 = bf16[3,8,128]{2,1,0} parameter(0)
  %p1 = bf16[3,8,128]{2,1,0} parameter(1)
  %p2 = bf16[8,128]{1,0} parameter(2)
  %p3 = s32[] parameter(3)
  %z = s32[] constant(0)
  %u = bf16[1,8,128]{2,1,0} bitcast(%p2)
  %e = bf16[1,8,128]{2,1,0} exponential(%u)
  %d0 = bf16[3,8,128]{2,1,0} dynamic-update-slice(%p0, %u, %p3, %z, %z)
  %d1 = bf16[3,8,128]{2,1,0} dynamic-update-slice(%p1, %e, %p3, %z, %z)
  ROOT %r = (bf16[3,8,128]{2,1,0}, bf16[3,8,128]{2,1,0}) tuple(%d0, %d1)
}

ENTRY %main (a: bf16[3,8,128], b: bf16[3,8,128], x: bf16[8,128], i: s32[]) -> (bf16[3,8,128], bf16[3,8,128]) {
  %a = bf16[3,8,128]{2,1,0} parameter(0)
  %b = bf16[3,8,128]{2,1,0} parameter(1)
  %x = bf16[8,128]{1,0} parameter(2)
  %i = s32[] parameter(3)
  ROOT %f = (bf16[3,8,128]{2,1,0}, bf16[3,8,128]{2,1,0}) fusion(%a, %b, %x, %i), kind=kLoop, calls=%fused
}
"""


def test_a_multi_output_fusion_updating_stacked_buffers_moves_its_updates_only():
    row = next(r for r in hlo.device_ops(STACK_HLO) if r["name"] == "f")
    update = 8 * 128 * 2
    assert row["written"] == 2 * update                # two slices written, not two whole stacks
    assert row["read"] == update + 4                  # the new rows and the index, not the stacks


@pytest.mark.parametrize("equation,form", [
    ("...i,io->...o", "forward"), ("nd,dv->nv", "forward"),
    ("...o,io->...i", "input_grad"), ("nv,dv->nd", "input_grad"),
    ("...i,...o->io", "weight_grad"), ("ni,no->io", "weight_grad")])
def test_the_form_of_a_product_from_its_equation(equation, form):
    assert gpu_estimate.gemm_form(f"jit(step)/jvp()/{equation}/dot_general") == form
    # a backward product in a loop body is named inside the transforms that made it (the
    # per-layer accumulation's step, profiled on a v5e chip: results/tpu_v5e_2026-12-07_round9)
    assert gpu_estimate.gemm_form(f"jit(step)/while/body/closed_call/transpose(jvp({equation}))/dot_general") == form
    assert gpu_estimate.gemm_form(f"jit(step)/while/body/closed_call/jvp({equation})/dot_general") == form
    assert gpu_estimate.gemm_form("jit(step)/exp") is None


def _tpu_table(one_call_s: float) -> dict:
    grid = [{"m": m, "n": 1024, "k": 1024, "seconds": 2.0 * m * 1024 * 1024 / rate, "flops_per_s": rate,
             "dispatch_bound": False} for m, rate in ((1024, 20e12), (4096, 150e12), (16384, 180e12))]
    return {"platform": "tpu", "hbm": {"elementwise_bytes_per_s": 1e12, "reduce_bytes_per_s": 1e12},
            "kernel": {"per_kernel_s": 1e-7, "one_call_s": one_call_s}, "gemm": grid}


def test_a_tpu_grid_point_timed_by_dispatch_takes_the_rate_of_more_rows():
    # 1024 x 1024 x 1024 at 20 TFLOP/s took 107 us: less than 1.5 calls of a tiny program (100 us
    # each) -- the host's dispatch, not the chip. 4096 rows took 57 us: also bound. 16384: not.
    rates = gpu_estimate.Rates(_tpu_table(100e-6))
    assert rates.gemm(1024, 1024, 1024) == rates.gemm(4096, 1024, 1024) == pytest.approx(180e12)
    kept = gpu_estimate.Rates(_tpu_table(10e-6))     # with a 10 us dispatch, every point is the chip's
    assert kept.gemm(1024, 1024, 1024) == pytest.approx(20e12)


def test_the_in_step_rate_of_a_form_bounds_the_grids():
    table = dict(_tpu_table(10e-6), gemm_in_step={"flops_per_s": {"weight_grad": 100e12}})
    rates = gpu_estimate.Rates(table)
    assert rates.gemm_in_step(16384, 1024, 1024, "weight_grad") == pytest.approx(100e12)
    assert rates.gemm_in_step(16384, 1024, 1024, "forward") == pytest.approx(180e12)
    assert rates.gemm_in_step(1024, 1024, 1024, "weight_grad") == pytest.approx(20e12)


def test_the_in_step_rate_is_read_at_the_steps_tokens_per_micro_batch():
    """Rates of a form profiled in steps of 4,096 and 16,384 tokens per micro-batch: log-linear in
    log2 of the tokens between them, the nearest outside them, never above the grid's rate."""
    table = dict(_tpu_table(10e-6), gemm_in_step={"by_rows": [
        {"rows": 16384, "flops_per_s": {"weight_grad": 160e12, "forward": 170e12}},
        {"rows": 4096, "flops_per_s": {"weight_grad": 100e12}}]})
    rates = gpu_estimate.Rates(table)
    wg = lambda rows: rates.gemm_in_step(16384, 1024, 1024, "weight_grad", rows)  # noqa: E731
    assert wg(4096) == pytest.approx(100e12) and wg(16384) == pytest.approx(160e12)
    assert wg(8192) == pytest.approx((100e12 * 160e12) ** 0.5)       # halfway in log2
    assert wg(1024) == pytest.approx(100e12) and wg(65536) == pytest.approx(160e12)
    # a form profiled in one step only: that rate; a form in none: the grid's
    assert rates.gemm_in_step(16384, 1024, 1024, "forward", 4096) == pytest.approx(170e12)
    assert rates.gemm_in_step(16384, 1024, 1024, "input_grad", 4096) == pytest.approx(180e12)
    # the grid bounds it: 4096 rows of the grid run at 150
    assert rates.gemm_in_step(4096, 1024, 1024, "weight_grad", 65536) == pytest.approx(150e12)
    # the step's tokens unknown: the product's own rows (a weight gradient's contracted ones)
    assert rates.gemm_in_step(16384, 1024, 4096, "weight_grad") == pytest.approx(100e12)
    assert rates.gemm_in_step(16384, 1024, 8192, "weight_grad") == pytest.approx(wg(8192))


def test_the_in_step_rates_of_profiled_steps_by_their_tokens(tmp_path):
    """``benchmarks/tpu_gemm_forms.py``: one point per profile, keyed by micro-batch x sequence, each
    form's FLOPs over its milliseconds; a profile that does not say its micro-batch is refused."""
    import json
    import subprocess
    import sys

    def profile(name: str, micro: int | None, ms: float) -> Path:
        ops = [{"op": "fusion.1", "ms": ms, "dot_flops": 2e12, "op_name": "jit(step)/transpose(jvp(...i,...o->io))/dot_general"},
               {"op": "fusion.2", "ms": 10.0, "dot_flops": 2e12, "op_name": "jit(step)/jvp(...i,io->...o)/dot_general"},
               {"op": "splash_mha_fwd", "ms": 5.0, "dot_flops": 1e12, "op_name": "jit(step)/jvp(...i,io->...o)/dot_general"},
               {"op": "add.3", "ms": 1.0, "dot_flops": 0, "op_name": "jit(step)/add"}]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"steps": 2, "jax": "0", "seq_len": 4096, "ops": ops,
                                    "overrides": [] if micro is None else [f"train.micro_batch_size={micro}"]}))
        return path

    table = tmp_path / "table.json"
    table.write_text(json.dumps({"platform": "tpu"}))
    script = ROOT / "benchmarks" / "tpu_gemm_forms.py"
    run = lambda *paths: subprocess.run([sys.executable, str(script), *map(str, paths), str(table)],  # noqa: E731
                                        capture_output=True, text=True, timeout=120)
    assert run(profile("m4", 4, 12.5), profile("m1", 1, 20.0)).returncode == 0
    points = json.loads(table.read_text())["gemm_in_step"]["by_rows"]
    assert [p["rows"] for p in points] == [4096, 16384]
    assert points[0]["flops_per_s"] == pytest.approx({"weight_grad": 100e12, "forward": 200e12})
    assert points[1]["flops_per_s"]["weight_grad"] == pytest.approx(160e12)
    bad = run(profile("auto", None, 10.0))
    assert bad.returncode != 0 and "does not say its micro-batch size" in bad.stderr
    assert json.loads(table.read_text())["gemm_in_step"]["by_rows"] == points     # left as it was


def test_splash_rates_count_the_flops_the_kernels_execute():
    """The table's splash rows (run here in Pallas interpret mode): FLOPs of every visited block
    pair, forward and the fused backward, as a compiled step's kernel calls are counted. The
    backward is timed alone, from residuals computed once: a time is never a difference of two
    (forward + backward less forward: on a 2-core host, single timings of a millisecond made it
    negative)."""
    rows = splash_rates(((256, 16, None), (256, 16, 128)), heads=2, batch=1, repeats=1, native=False)
    for r in rows:
        fwd = kernel_flops(r["seq"], r["window"], 2, 16, 1, "fwd")
        bwd = kernel_flops(r["seq"], r["window"], 2, 16, 1, "dkv", fused=True)
        assert (r["fwd"], r["fwd_bwd"]) == (fwd, fwd + bwd) and bwd == 5 * fwd // 2
        assert r["fwd_flops_per_s"] == pytest.approx(fwd / r["fwd_s"])
        assert r["bwd_flops_per_s"] == pytest.approx(bwd / r["bwd_s"])
        assert r["kernel"] == "splash" and r["fwd_s"] > 0 and r["bwd_s"] > 0
        assert r["fwd_bwd_s"] == pytest.approx(r["fwd_s"] + r["bwd_s"])


def test_a_table_measurement_keeps_each_part_as_it_is_measured():
    seen = []
    table = measure(gemm=False, attention=False, log=lambda line: None,
                    progress=lambda t: seen.append((t["complete"], sorted(t))))
    assert seen[0][0] is False and {"hbm", "kernel"} <= set(seen[0][1])
    assert seen[-1][0] is True and table["complete"] is True


def test_a_table_is_measured_with_the_steps_compiler_options(monkeypatch):
    """Every program of the table compiles with the options the platform's training step gets
    (on v5e, 32 MiB of scoped VMEM), and the table records them: an option the compiler refuses
    stops the first measurement, so none of its programs compiles without them."""
    from olmax import platforms

    platforms._cpu_compiler_options.cache_clear()
    table = measure(gemm=False, attention=False, log=lambda line: None)
    assert table["compiler_options"] == platforms.compiler_options("cpu") != {}
    monkeypatch.setattr(platforms, "compiler_options", lambda backend, devices=None, run=None:
                        {"xla_no_such_option_in_any_xla": "1"})
    with pytest.raises(Exception, match="xla_no_such_option_in_any_xla"):
        measure(gemm=False, attention=False, log=lambda line: None)
    rows = splash_rates(((256, 16, None),), heads=1, batch=1, repeats=1, native=False,
                        options={"xla_no_such_option_in_any_xla": "1"})
    assert "xla_no_such_option_in_any_xla" in rows[0]["error"]


@pytest.fixture(scope="module")
def step_190m():
    """olmo3-190m, 16 x 4096, micro-batch 4 without remat, as `auto` picked it by memory on a v5e
    chip (the largest that fits): the step compiled for v5e:1x1 (libtpu 0.0.52), and its case."""
    text = gzip.decompress((RESULTS / "hlo_190m_micro4.txt.gz").read_bytes()).decode()
    case = yaml.safe_load(CASE.read_text())
    return text, case, gpu_estimate.rates_for(BY_NAME["v5e"])


def test_the_190m_step_s_products_and_kernels_against_hand_counts(step_190m):
    text, case, rates = step_190m
    rows = gpu_estimate.tpu_kernels(text, rates)
    cfg = load_recipe(case["peer"]["recipe"], case["peer"]["args"])
    m, tokens = cfg.model, 16 * 4096
    # every matmul of the model, no remat: 6 x (the layers' projections + the LM head) per token
    per_layer = 2 * m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + \
        2 * m.n_heads * m.head_dim * m.d_model + 3 * 2 * m.d_model * m.mlp_hidden
    matmul = 3 * tokens * (m.n_layers * per_layer + 2 * m.d_model * m.padded_vocab_size)
    gemm = sum(r["flops"] for r in rows if r["kind"] == "gemm")
    assert gemm == pytest.approx(matmul, rel=0.01)
    # the attention kernels: 12 layers x 4 micro-batches of 4 rows, 12 heads of 64, full causal
    # blocks of 1,024 over 4,096 positions; forward and fused backward
    per_call = kernel_flops(4096, None, 12, 64, 4, "fwd") + kernel_flops(4096, None, 12, 64, 4, "dkv", fused=True)
    attn = sum(r["flops"] for r in rows if r["kind"] == "attention")
    assert attn == pytest.approx(12 * 4 * per_call)
    # analytic model FLOPs (causal) sit between: matmuls plus the causal half of attention
    assert matmul < flops_per_token(m, 4096, "causal") * tokens < matmul + attn
    # the step's tokens per micro-batch, read from its attention calls: 4 rows of 4,096
    assert gpu_estimate.step_rows(hlo.analyse(text)) == 4 * 4096


def test_the_190m_step_estimate_against_the_chip():
    """The estimate of today's compiled step against that step measured on a v5e chip: olmo3-190m,
    16 x 4096, micro-batch 1 without remat, `auto`'s choice (benchmarks/tpu.sh), compiled for
    v5e:1x1 with the defaults it ran with (32 MiB of scoped VMEM, per-layer accumulation): within
    0.9-1.1. Neither the rates table nor its in-step product rates (the 7B slice's profiles) were
    measured on this step."""
    text = gzip.decompress((ROOT / "benchmarks" / "results" / "tpu_v5e_2026-12-07_round9" /
                            "hlo_190m_micro1.txt.gz").read_bytes()).decode()
    case = yaml.safe_load((ROOT / "benchmarks" / "calibration" / "olmax_olmo3_190m_v5e_1x1_round5.yaml").read_text())
    assert "train.micro_batch_size=1" in case["peer"]["args"]
    rates = gpu_estimate.rates_for(BY_NAME["v5e"])
    assert gpu_estimate.step_rows(hlo.analyse(text)) == 4096
    est = gpu_estimate.estimate(text, rates, "tpu")
    ratio = case["measured"]["step_s"] / est["compute_s"]
    assert 0.9 <= ratio <= 1.1, ratio
    by = est["by_kind"]
    assert by["async"]["seconds"] > 0                 # listed beside the compute, not added to it
    assert est["compute_s"] == pytest.approx(sum(v["seconds"] for k, v in by.items() if k != "async"))
    assert est["rates_source"].startswith("measured on TPU v5 lite")
