"""``olmax bench profile``'s accounting: FLOPs and bytes read from compiled HLO text, the split
of perf samples by code, the choice of bandwidth ceiling (hand-computed numbers); and the command
on a tiny shape, its dot FLOPs against the analytic count."""

from __future__ import annotations

import json

import pytest

from olmax.cli import main
from olmax.model.flops import flops_per_token
from olmax.perf import hlo
from olmax.perf import profile
from olmax.train.recipes import load_recipe

HLO = """HloModule jit_step, entry_computation_layout={(bf16[64,32]{1,0}, bf16[32,16]{1,0})->f32[64,16]{1,0}}

%fused_dot (p0: bf16[64,32], p1: bf16[32,16]) -> f32[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_scale (q0: f32[64,16], q1: f32[16]) -> bf16[64,16] {
  %q0 = f32[64,16]{1,0} parameter(0)
  %q1 = f32[16]{0} parameter(1)
  %b = f32[64,16]{1,0} broadcast(%q1), dimensions={1}
  %m = f32[64,16]{1,0} multiply(%q0, %b)
  ROOT %c = bf16[64,16]{1,0} convert(%m)
}

ENTRY %main (a: bf16[64,32], w: bf16[32,16], s: f32[16]) -> (bf16[64,16], f32[2]) {
  %a = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %s = f32[16]{0} parameter(2)
  %ynn_fusion = f32[64,16]{1,0} fusion(%a, %w), kind=kCustom, calls=%fused_dot
  %scale_fusion = bf16[64,16]{1,0} fusion(%ynn_fusion, %s), kind=kLoop, calls=%fused_scale
  %pair = (bf16[64,16]{1,0}, f32[2]{0}) custom-call(%scale_fusion), custom_call_target="x"
  ROOT %t = (bf16[64,16]{1,0}, f32[2]{0}) tuple(%scale_fusion, %scale_fusion)
}
"""


def test_dot_flops_of_a_fusion_are_its_body_dots():
    flops = hlo.dot_flops(HLO)
    assert flops["ynn_fusion"] == 2 * 64 * 16 * 32
    assert flops["dot.1"] == 2 * 64 * 16 * 32
    assert "scale_fusion" not in flops


def test_op_bytes_count_result_and_operands_at_their_own_shapes():
    b = hlo.op_bytes(HLO)
    assert b["ynn_fusion"] == 64 * 16 * 4 + 64 * 32 * 2 + 32 * 16 * 2
    # the broadcast operand is read once, at its own 16 floats
    assert b["scale_fusion"] == 64 * 16 * 2 + 64 * 16 * 4 + 16 * 4
    # a tuple result counts each element
    assert b["pair"] == (64 * 16 * 2 + 2 * 4) + 64 * 16 * 2
    for free in ("a", "w", "s", "t"):       # parameters and tuples move nothing
        assert free not in b


def test_perf_report_split_by_code():
    report = """# Samples: 1K of event 'cpu-clock:ppp'
#
           600  libjax_common.so      [.] ynn::dot_bf16_bf16_fp32_12x32x2_1x16x2_avx512bf16
            40  libjax_common.so      [.] ynn::dot_fp32_5x64x1_1x16x1_avx512
            30  libjax_common.so      [.] ynn::interleave2_x16_avx512
           250  [JIT] tid 5929        [.] 0x00007f2b5611e196
            60  [kernel.kallsyms]     [k] clear_page_erms
            15  libjax_common.so      [.] Eigen::ThreadPoolTempl<tsl::thread::EigenEnvironment>::WorkerLoop
             5  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault
"""
    share, total = profile.parse_perf_report(report)
    assert total == 1000
    assert share[profile.GEMM_KERNELS] == 640
    assert share["GEMM library: packing, transposes, other"] == 30
    assert share["XLA-generated code (element-wise, reductions, copies)"] == 250
    assert share["kernel (page faults, zeroing, scheduling)"] == 60
    assert share["runtime and other libraries"] == 15
    assert share["Python"] == 5


def test_bandwidth_for_takes_the_smallest_working_set_that_holds_the_op():
    ceilings = [{"mib": 1, "traffic_bytes": 8 * 2**18, "bytes_per_s": 100.0},
                {"mib": 4, "traffic_bytes": 32 * 2**18, "bytes_per_s": 80.0},
                {"mib": 16, "traffic_bytes": 128 * 2**18, "bytes_per_s": 30.0}]
    assert profile.bandwidth_for(10, ceilings) == 100.0
    assert profile.bandwidth_for(8 * 2**18, ceilings) == 100.0
    assert profile.bandwidth_for(8 * 2**18 + 1, ceilings) == 80.0
    assert profile.bandwidth_for(10**12, ceilings) == 30.0


def test_bandwidth_ceiling_counts_bytes_read_and_written():
    (c,) = profile.bandwidth_ceilings((1,), min_bytes=2e8)
    assert c["mib"] == 1 and c["traffic_bytes"] == 2 * 2**20   # 1 MiB read, 1 MiB written
    assert 1e8 < c["bytes_per_s"] < 1e13


@pytest.mark.slow
def test_bench_profile_command_on_a_tiny_shape(tmp_path, capsys):
    out, hlo_out = tmp_path / "profile.json", tmp_path / "step.hlo.txt"
    overrides = ["train.global_batch_size=2", "train.seq_len=64"]
    assert main(["bench", "profile", "olmo3_tiny", *overrides, "--steps", "1", "--top", "5",
                 "--json", str(out), "--hlo", str(hlo_out)]) == 0
    table = capsys.readouterr().out
    assert "floor estimate" in table and "| component | ms | % |" in table
    p = json.loads(out.read_text())
    assert p["recipe"] == "olmo3_tiny" and p["steps"] == 1 and p["batch"] == 2 and p["seq_len"] == 64
    # the executor's wall time is shared out among the ops, so their ms add up to it
    assert p["op_ms_total"] == pytest.approx(p["executor_ms"], rel=1e-3)
    # the dots of one step (dense attention, no remat) do at least the causal count's matmul work
    # and no more than OLMo-core's, which counts attention over the full T x T
    cfg = load_recipe("olmo3_tiny", overrides)
    dots = sum(r["dot_flops"] for r in p["ops"])
    assert flops_per_token(cfg.model, 64, "causal") * 128 <= dots <= flops_per_token(cfg.model, 64, "olmo_core") * 128
    assert {"fwd", "bwd", "update"} <= {r["phase"] for r in p["ops"]}
    assert hlo_out.read_text().startswith("HloModule")
    assert main(["bench", "profile", "olmo3_tiny", "--json", str(out)]) == 2     # exists: refused


class _Ev:
    def __init__(self, name, start_ns, duration_ns):
        self.name, self.start_ns, self.duration_ns = name, start_ns, duration_ns


class _Line:
    def __init__(self, name, events):
        self.name, self.events = name, events


class _Plane:
    def __init__(self, name, lines):
        self.name, self.lines = name, lines


def test_a_tpu_timeline_gives_each_op_its_own_time_less_its_nested_ops():
    """A TPU's ``XLA Ops`` line, hand-made: a loop of 100 us around two runs of a fusion (20 + 30 us)
    and a copy (10 us), then a convolution (50 us) and the same fusion again (5 us); two module
    runs of 90 + 80 us. Each op gets its own time (the loop only the 40 us its body leaves), runs
    are counted, and another device's plane and the host's lines are not read."""
    us = 1000
    ops = [_Ev("while.3", 0, 100 * us), _Ev("%fusion.1", 10 * us, 20 * us), _Ev("copy.2", 30 * us, 10 * us),
           _Ev("fusion.1", 50 * us, 30 * us), _Ev("convolution.4", 120 * us, 50 * us),
           _Ev("fusion.1", 170 * us, 5 * us)]
    tpu0 = _Plane("/device:TPU:0", [_Line("Steps", [_Ev("0", 0, 200 * us)]), _Line("XLA Ops", ops),
                                    _Line("XLA Modules", [_Ev("jit_step(1)", 0, 90 * us),
                                                          _Ev("jit_step(1)", 95 * us, 80 * us)])])
    tpu1 = _Plane("/device:TPU:1", [_Line("XLA Ops", [_Ev("fusion.1", 0, 999 * us)])])
    host = _Plane("/host:CPU", [_Line("tf_XLAPjRtCpuClient", [_Ev("fusion.1", 0, 777 * us)])])
    agg, exec_ms = profile.device_op_events([host, tpu1, tpu0])
    assert agg == {"while.3": [1, pytest.approx(0.040)], "fusion.1": [3, pytest.approx(0.055)],
                   "copy.2": [1, pytest.approx(0.010)], "convolution.4": [1, pytest.approx(0.050)]}
    assert exec_ms == pytest.approx(0.170)
    assert profile.device_op_events([host]) is None
