"""The collective-timing model of ``olmax plan`` (:mod:`olmax.perf.network`), the replica groups it
reads from compiled programs (:mod:`olmax.perf.hlo`) and the MXU occupancy that prices Pallas
kernels (:mod:`olmax.perf.costs`), checked against numbers worked out by hand."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from olmax.perf import hlo, network
from olmax.perf.costs import SPLASH_MATMULS, mxu_occupancy

GB = 1e9


def tpu_slice(kind: str, shape: tuple[int, int, int], cores: int) -> list:
    """Devices of a TPU slice in the order a mesh lists them: chips x, y, z, then cores."""
    out = []
    for z, y, x in itertools.product(*(range(n) for n in reversed(shape))):
        for c in range(cores):
            out.append(SimpleNamespace(coords=[x, y, z], core_on_chip=c, device_kind=kind,
                                       platform="tpu", id=len(out)))
    return out


def op(kind, nbytes, group=None, pair=None, count=1, is_async=True):
    return {"kind": kind, "bytes": nbytes, "count": count, "group": group, "pair": pair,
            "async": is_async}


def test_all_gather_over_a_whole_torus_uses_both_directions_of_every_axis():
    devs = tpu_slice("TPU7x", (4, 8, 8), 2)                 # 512 devices, 256 chips
    s = 2 ** 30
    got = network.collective_seconds(op("all-gather", s), devs, (True, True, True))
    # 3 axes x 2 directions x 100 GB/s, shared by the chip's 2 cores: 300 GB/s per device;
    # steps: (4-1) + (8-1) + (8-1) across chips + (2-1) on the chip, 1 us each
    assert got == pytest.approx(s * 511 / 512 / (300 * GB) + 18e-6)
    # all-reduce: reduce-scatter + all-gather
    assert network.collective_seconds(op("all-reduce", s), devs, (True, True, True)) == \
        pytest.approx(2 * got)
    # without the wraparound links each axis is a line: one direction's worth
    assert network.collective_seconds(op("all-gather", s), devs, ()) == \
        pytest.approx(s * 511 / 512 / (150 * GB) + 18e-6)


def test_groups_along_one_axis_and_part_of_an_axis():
    devs = tpu_slice("TPU v5", (4, 8, 8), 1)                 # v5p: one device per chip
    s = 10 ** 9
    x_ring = [d.id for d in devs if d.coords[1] == 0 and d.coords[2] == 0]    # all 4 of axis x
    assert len(x_ring) == 4
    assert network.collective_seconds(op("reduce-scatter", s, x_ring), devs, (True, True, True)) == \
        pytest.approx(s * 3 / 4 / (200 * GB) + 3e-6)
    y_half = [d.id for d in devs if d.coords[0] == 0 and d.coords[2] == 0 and d.coords[1] < 4]
    assert network.collective_seconds(op("all-gather", s, y_half), devs, (True, True, True)) == \
        pytest.approx(s * 3 / 4 / (100 * GB) + 3e-6)


def test_permutes_and_groups_inside_a_chip():
    devs = tpu_slice("TPU7x", (2, 2, 2), 2)
    s = 10 ** 9
    # the two cores of chip (0, 0, 0): no link crossed, latency only
    assert network.collective_seconds(op("all-gather", s, [0, 1]), devs, ()) == pytest.approx(1e-6)
    assert network.collective_seconds(op("collective-permute", s, pair=(0, 1)), devs, ()) == \
        pytest.approx(1e-6)
    # to the next chip: one direction of one link
    assert network.collective_seconds(op("collective-permute", s, pair=(0, 2)), devs, ()) == \
        pytest.approx(1e-6 + s / (100 * GB))


def test_gpus_inside_a_node_and_across_nodes():
    gpus = [SimpleNamespace(id=i, device_kind="NVIDIA H100 80GB HBM3", platform="gpu") for i in range(16)]
    s = 8 * 10 ** 9
    node = network.collective_seconds(op("all-gather", s, list(range(8))), gpus, ())
    assert node == pytest.approx(s * 7 / 8 / (450 * GB) + 7 * 5e-6)
    across = network.collective_seconds(op("all-gather", s, [0, 8]), gpus, ())
    assert across == pytest.approx(s / 2 / (50 * GB) + 5e-6)


def test_overlap_and_totals():
    devs = tpu_slice("TPU v5", (2, 2, 1), 1)
    ops = [op("all-gather", 10 ** 9, count=3), op("all-reduce", 10 ** 9, is_async=False)]
    t = network.time_collectives(ops, devs, ())
    one = network.collective_seconds(ops[0], devs, ())
    assert t["async_s"] == pytest.approx(3 * one)
    assert t["sync_s"] == pytest.approx(network.collective_seconds(ops[1], devs, ()))
    assert t["collective_s"] == pytest.approx(t["async_s"] + t["sync_s"])
    assert network.overlap(1.0, t) == (pytest.approx(1.0 + t["sync_s"]), pytest.approx(1.0 + t["collective_s"]))
    assert network.overlap(0.0, t)[0] == pytest.approx(t["collective_s"])


def _ins(text: str) -> hlo.Instruction:
    return hlo.Instruction("x", "all-gather", "f32[8]", text, "c")


def test_replica_groups_in_every_printed_form():
    assert hlo.replica_group(_ins("all-gather(a), replica_groups={{0,2},{1,3}}, dimensions={0}")) == [0, 2]
    assert hlo.replica_group(_ins("all-gather(a), replica_groups=[2,4]<=[8], dimensions={0}")) == [0, 1, 2, 3]
    assert hlo.replica_group(_ins("all-gather(a), replica_groups=[4,2]<=[2,4]T(1,0)")) == [0, 4]
    named = "all-gather(a), replica_groups=mesh['data'=2,'fsdp'=4,'context'=1,'tensor'=1] {'fsdp'}"
    assert hlo.replica_group(_ins(named)) == [0, 1, 2, 3]
    named = "all-reduce(a), replica_groups=mesh['data'=2,'fsdp'=4,'context'=1,'tensor'=1] {'data'}"
    assert hlo.replica_group(_ins(named)) == [0, 4]
    assert hlo.replica_group(_ins("all-reduce(a), replica_groups={}, to_apply=%add")) is None


def test_mxu_occupancy_of_splash_matmuls():
    # a 128-wide head dimension fills half of a 256-wide MXU in every splash matmul, all of a 128
    assert mxu_occupancy(128, 512, 256) == 0.5 and mxu_occupancy(512, 128, 256) == 0.5
    assert mxu_occupancy(256, 512, 256) == 1.0 and mxu_occupancy(128, 512, 128) == 1.0
    assert mxu_occupancy(64, 64, 128) == 0.25 and mxu_occupancy(64, 64, None) == 1.0
    # every matmul of every splash kernel has the head dimension on one side and the block on the other
    for phase, mms in SPLASH_MATMULS.items():
        assert all(sorted(m) == ["D", "K"] for m in mms), phase


# A loop of 4 trips whose body starts an asynchronous all-gather (-start/-done), a SparseCore
# thread (custom-call-start) running an all-gather over a named mesh axis, an all-reduce fused
# under an AsyncCollectiveStart custom call, and a synchronous all-reduce in the entry.
PROGRAM = """HloModule jit_step, is_scheduled=true

%sc_gather (p: f32[4,64]) -> f32[16,64] {
  %p = f32[4,64]{1,0} parameter(0)
  ROOT %all-gather.9 = f32[16,64]{1,0} all-gather(%p), channel_id=9, replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}, dimensions={0}
}

%fused_ar (q: bf16[32]) -> bf16[32] {
  %q = bf16[32]{0} parameter(0)
  ROOT %all-reduce.5 = bf16[32]{0} all-reduce(%q), channel_id=5, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %t = (s32[], f32[8,64]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,64]{1,0} get-tuple-element(%t), index=1
  %ags = (f32[1,64]{1,0}, f32[8,64]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = f32[8,64]{1,0} all-gather-done(%ags)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[8,64]) tuple(%j, %agd)
}

%cond (c: (s32[], f32[8,64])) -> pred[] {
  %c = (s32[], f32[8,64]) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (x: f32[8,64], y: f32[4,64], z: bf16[32]) -> f32[8,64] {
  %x = f32[8,64]{1,0} parameter(0)
  %y = f32[4,64]{1,0} parameter(1)
  %z = bf16[32]{0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,64]) tuple(%zero, %x)
  %loop = (s32[], f32[8,64]) while(%init), condition=%cond, body=%body
  %scs = ((f32[4,64]), f32[16,64], s32[]) custom-call-start(%y), custom_call_target="SparseCoreThread", called_computations={%sc_gather}
  %acs = bf16[32]{0} custom-call(%z), custom_call_target="AsyncCollectiveStart", called_computations={%fused_ar}
  %sync = f32[8,64]{1,0} all-reduce(%x), channel_id=7, replica_groups={}, to_apply=%add
  ROOT %out = f32[8,64]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_collective_ops_of_a_program_read_by_hand():
    ops = {o["name"]: o for o in hlo.collective_ops(hlo.analyse(PROGRAM))}
    assert set(ops) == {"ags", "all-gather.9", "all-reduce.5", "sync"}
    loop = ops["ags"]
    assert (loop["kind"], loop["count"], loop["async"], loop["group"]) == ("all-gather", 4, True, list(range(8)))
    assert loop["bytes"] == 8 * 64 * 4                      # the gathered result
    sc = ops["all-gather.9"]
    assert (sc["count"], sc["async"], sc["group"], sc["bytes"]) == (1, True, [0, 1, 2, 3], 16 * 64 * 4)
    fused = ops["all-reduce.5"]
    assert (fused["async"], fused["group"], fused["bytes"]) == (True, [0, 4], 32 * 2)
    sync = ops["sync"]
    assert (sync["async"], sync["group"], sync["count"]) == (False, None, 1)
