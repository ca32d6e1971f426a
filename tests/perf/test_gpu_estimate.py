"""olmax plan's GPU step time (:mod:`olmax.perf.gpu_estimate`): the kernels of a program compiled
on an H200 (stored with its measurement in ``benchmarks/results/gpu_h200/``), priced at the rates
measured on that GPU, against hand-computed FLOPs, the measured step and its profile."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import yaml

from olmax.hardware import BY_NAME
from olmax.model.flops import causal_attention_pairs
from olmax.perf import calibration, gpu_estimate

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_h200"
CASES = ROOT / "benchmarks" / "calibration"


def _hlo(heads: str) -> str:
    return gzip.decompress((RESULTS / f"hlo_{heads}.txt.gz").read_bytes()).decode()


@pytest.fixture(scope="module")
def h200():
    rates = gpu_estimate.rates_for(BY_NAME["h200"])
    assert rates is not None
    return rates


def test_gemm_shape_from_dimension_numbers():
    # HLO's own attributes: [2, 8192, 4096] x [2, 4096, 1024], batch 0, contracting 2 and 1
    text = "dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}"
    assert gpu_estimate.gemm_shape([2, 8192, 4096], [2, 4096, 1024], text) == (2, 8192, 1024, 4096)
    # cuBLAS's backend config: [4096, 8192]^T x [4096, 11008] (a weight gradient)
    cfg = ('"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["0"],'
           '"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}')
    assert gpu_estimate.gemm_shape([8192, 4096], [8192, 11008], cfg) == (1, 4096, 11008, 8192)


def test_gemm_rates_interpolate_in_log_size(h200):
    grid = {(r["m"], r["n"], r["k"]): r["flops_per_s"] for r in h200.table["gemm"]}
    for key, rate in list(grid.items())[::7]:
        assert h200.gemm(*key) == pytest.approx(rate)
    # halfway in log2 between two grid points of one axis: the geometric mean of their rates
    a, b = grid[(4096, 1024, 4096)], grid[(4096, 4096, 4096)]
    assert h200.gemm(4096, 2048, 4096) == pytest.approx(math.sqrt(a * b))
    # beyond the grid: its edge
    assert h200.gemm(65536, 4096, 4096) == pytest.approx(grid[(16384, 4096, 4096)])


def test_h100_is_priced_from_the_h200_table_with_its_bandwidth(h200):
    h100 = gpu_estimate.rates_for(BY_NAME["h100"])
    assert h100.gemm(8192, 4096, 4096) == h200.gemm(8192, 4096, 4096)     # same SMs and clocks
    assert h100.bw_elementwise / h200.bw_elementwise == pytest.approx(3.35232 / 4.8)
    assert "h200" in h100.source
    assert gpu_estimate.rates_for(BY_NAME["b200"]) is None                  # no table: no estimate
    assert gpu_estimate.rates_for(BY_NAME["tpu7x"]) is None


@pytest.mark.parametrize("heads,n_heads,head_dim", [("32x128", 32, 128), ("16x256", 16, 256)])
def test_the_stored_program_has_the_models_flops(h200, heads, n_heads, head_dim):
    """The slice: 4 OLMo 3 7B layers (windows 4096, 4096, 4096, full), vocabulary 100,352, 8,192
    tokens, no remat: every matrix product runs once forward and twice backward."""
    rows = gpu_estimate.kernels(_hlo(heads), h200)
    gemm = sum(r["flops"] for r in rows if r["kind"] == "gemm")
    d, mlp, vocab, t = 4096, 11008, 100352, 8192
    weights = 4 * (4 * d * d + 3 * d * mlp) + d * vocab        # the embedding is a lookup
    assert gemm == 6 * weights * t
    attn = [r for r in rows if r["kind"] == "attention"]
    assert len(attn) == 8 and sum(r["mult"] for r in attn) == 8
    pairs = 3 * causal_attention_pairs(t, 4096) + causal_attention_pairs(t, None)
    assert sum(r["flops"] for r in attn) == (4 + 6) * n_heads * head_dim * pairs


def _case(name: str) -> dict:
    return yaml.safe_load((CASES / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name,heads", [("olmo3_7b_slice_h200", "32x128"),
                                        ("olmo3_7b_slice_h200_heads16x256", "16x256")])
def test_estimate_against_the_measured_step(h200, name, heads):
    """The calibration case's ratio, recomputed from the stored program, lies within 0.85-1.15 and
    is the one the shipped table reports."""
    case = _case(name)
    assert case["peer"]["hlo"] == f"results/gpu_h200/hlo_{heads}.txt.gz"
    est = gpu_estimate.estimate(_hlo(heads), h200)["compute_s"]
    ratio = case["measured"]["step_s"] / est
    assert 0.85 <= ratio <= 1.15
    shipped = {c["case"]: c for c in calibration.table()["cases"]}[name]
    assert shipped["estimated_step_s"] == pytest.approx(est)
    assert shipped["ratio"] == pytest.approx(ratio)


def test_each_kind_of_kernel_against_the_profile(h200):
    """The profile of 3 steps recorded beside the measurement: GPU time by kind of kernel per step
    (matrix products, cuDNN attention, the rest), each within 0.85-1.15 of its estimate."""
    trace = json.loads(gzip.decompress((RESULTS / "trace_32x128.json.gz").read_bytes()))
    measured = gpu_estimate.profile_by_kind(trace, steps=3)
    est = gpu_estimate.estimate(_hlo("32x128"), h200)["by_kind"]
    step = json.loads((RESULTS / "gpu_h200.json").read_text())["rows"][0]["step_s"]
    assert sum(measured.values()) <= step          # the GPU is busy within the step
    for kind in ("gemm", "attention", "memory"):
        assert 0.85 <= measured[kind] / est[kind]["seconds"] <= 1.15, (kind, measured[kind], est[kind])


def test_calibration_covers_a_gpu_family():
    shipped = calibration.table()
    h100 = calibration.for_accelerator(BY_NAME["h100"], shipped)
    h200 = calibration.for_accelerator(BY_NAME["h200"], shipped)
    assert h100["family"] == h200["family"] == "h200"
    assert {c["case"] for c in h100["cases"]} == {"olmo3_7b_slice_h200", "olmo3_7b_slice_h200_heads16x256",
                                                  "llama2_7b_h100x8"}
    lo, hi = h100["ratio_range"]
    assert 0.85 <= lo <= hi <= 1.15
    assert calibration.for_accelerator(BY_NAME["b200"], shipped) == "uncalibrated"


def test_plan_prices_a_gpu_program(h200):
    """olmax plan's GPU branch, on the stored program and the H200's row."""
    from olmax.perf import plan

    class Dev:
        platform, device_kind = "gpu", "NVIDIA H200"

    flops = {"olmo_core": 6.824e13, "causal": 6.535e13}
    details = {"chips": 1}
    e = plan._estimate_kernels(_hlo("32x128"), Dev(), 8192, 1, flops, None, details)
    compute = gpu_estimate.estimate(_hlo("32x128"), h200)["compute_s"]
    assert e["step_s"] == e["compute_s"] == pytest.approx(compute)
    assert e["tokens_per_s_per_chip"] == pytest.approx(8192 / compute)
    assert e["mfu_causal"] == pytest.approx(6.535e13 / compute / 989e12)
    assert e["method"].startswith("estimate: every kernel") and "H200" in e["method"]
    assert details["gpu_kernels"]["by_kind"]["attention"]["kernels"] == 8


# one cuDNN attention call as two XLA versions print its backend config: compact (jax 0.11.2, the
# H200's program) and with spaces and other keys first (jax 0.12.0.1, MaxText's H100 program)
_FMHA = ('  %fwd = (bf16[2,32,4096,128]{3,1,2,0}, f32[2,32,4096]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), '
         'custom_call_target="__cudnn$fmhaSoftmax", backend_config={CONFIG}')
_COMPACT = ('{"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["2","32","4096","4096"]},'
            '"mask_type":"CAUSAL","sliding_window_length":0}}')
_SPACED = ('{"operation_queue_id": "0", "cudnn_fmha_backend_config": {"fmha_scale": 1.0, '
           '"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "32", "4096", "4096"], '
           '"tuple_shapes": []}, "mask_type": "CAUSAL", "sliding_window_length": 0}}')


_MODULE = """HloModule m

ENTRY %m (q: bf16[2,4096,32,128], k: bf16[2,4096,32,128], v: bf16[2,4096,32,128]) -> bf16[2,32,4096,128] {
  %q = bf16[2,4096,32,128]{3,2,1,0} parameter(0)
  %k = bf16[2,4096,32,128]{3,2,1,0} parameter(1)
  %v = bf16[2,4096,32,128]{3,2,1,0} parameter(2)
{CALL}
  ROOT %o = bf16[2,32,4096,128]{3,1,2,0} get-tuple-element(%fwd), index=0
}
"""


def test_attention_read_from_either_printing_of_its_config():
    from olmax.perf import hlo

    def read(config):
        (ins,) = [i for i, _ in hlo.analyse(_MODULE.replace("{CALL}", _FMHA.replace("{CONFIG}", config)))
                  .instructions() if i.opcode == "custom-call"]
        return gpu_estimate._attention(ins)

    expected = ("fwd", 4 * 2 * 32 * causal_attention_pairs(4096, None) * 128, 4096, 128, False)
    assert read(_COMPACT) == read(_SPACED) == expected
    assert read(_SPACED.replace('"CAUSAL"', '"NO_MASK"'))[1] == 4 * 2 * 32 * 4096 * 4096 * 128


def test_maxtext_llama2_on_8_h100s_from_its_stored_program(h200):
    """The MaxText calibration case's program (compiled here for 8 compile-only H100s): FSDP's
    reduce-scatters carry every parameter's bf16 gradient once (Llama-2-7B's 6,738,415,616
    parameters, counted by hand), its 96 cuDNN attention calls are priced, and the estimate is the
    one the shipped table reports, within 0.85-1.15 of the published step."""
    from olmax.perf import hlo

    (path,) = (ROOT / "benchmarks" / "results" / "calibration" / "compiles").glob("step_a3_*.hlo.gz")
    text = gzip.decompress(path.read_bytes()).decode()
    d, mlp, vocab, layers = 4096, 11008, 32000, 32
    params = layers * (4 * d * d + 3 * d * mlp + 2 * d) + 2 * d * vocab + d
    assert params == 6_738_415_616
    ops = hlo.collective_ops(hlo.analyse(text))
    total = {k: sum(o["bytes"] * o["count"] for o in ops if o["kind"] == k) for k in ("all-gather", "reduce-scatter")}
    assert total["reduce-scatter"] == 2 * params
    assert 2 * params < total["all-gather"] <= 2 * 2 * params      # forward, and again for the backward
    rows = gpu_estimate.kernels(text, gpu_estimate.rates_for(BY_NAME["h100"]))
    attn = [r for r in rows if r["kind"] == "attention"]
    assert sum(r["mult"] for r in attn) == 96          # 32 forward, 32 recomputed, 32 backward
    shipped = {c["case"]: c for c in calibration.table()["cases"]}["llama2_7b_h100x8"]
    assert 0.85 <= shipped["ratio"] <= 1.15
    compute = sum(r["seconds"] for r in rows)
    assert compute <= shipped["estimated_step_s"] <= 1.01 * compute   # its collectives hide under it

