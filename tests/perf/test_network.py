"""The collective-timing model of ``olmax plan`` (:mod:`olmax.perf.network`), the replica groups it
reads from compiled programs (:mod:`olmax.perf.hlo`) and the MXU occupancy that prices Pallas
kernels (:mod:`olmax.perf.costs`), checked against numbers worked out by hand."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from olmax import hardware
from olmax.perf import hlo, network, targets
from olmax.perf.costs import SPLASH_MATMULS, mxu_occupancy

GB = 1e9


def tpu_slice(kind: str, shape: tuple[int, int, int], cores: int, slices: int = 1) -> list:
    """Devices of a TPU slice in the order a mesh lists them: chips x, y, z, then cores (then
    slices)."""
    out = []
    for s in range(slices):
        for z, y, x in itertools.product(*(range(n) for n in reversed(shape))):
            for c in range(cores):
                out.append(SimpleNamespace(coords=[x, y, z], core_on_chip=c, device_kind=kind,
                                           platform="tpu", id=len(out), slice_index=s))
    return out


def op(kind, nbytes, group=None, pair=None, count=1, is_async=True, pairs=None):
    return {"kind": kind, "bytes": nbytes, "count": count, "group": group, "pair": pair,
            "pairs": pairs if pairs is not None else ([pair] if pair else []), "async": is_async}


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


def test_a_permute_takes_as_long_as_its_slowest_pair():
    devs = tpu_slice("TPU7x", (2, 2, 2), 2)                 # devices 2c, 2c+1 share chip c
    s = 10 ** 9
    link = s / (100 * GB)
    # first pair on chip (0, 0, 0), the second from there to chip (1, 0, 0): the permute crosses
    # a link, whatever its first pair does
    crossing = op("collective-permute", s, pairs=[(0, 1), (1, 2)])
    assert network.collective_seconds(crossing, devs, ()) == pytest.approx(1e-6 + link)
    # the same pairs the other way round, and a ring over the 4 chips of the z = 0 plane
    assert network.collective_seconds(op("collective-permute", s, pairs=[(1, 2), (0, 1)]), devs, ()) == \
        pytest.approx(1e-6 + link)
    ring = [(0, 2), (2, 6), (6, 4), (4, 0)]                  # chips (0,0)->(1,0)->(1,1)->(0,1)->(0,0)
    assert network.collective_seconds(op("collective-permute", s, pairs=ring), devs, ()) == \
        pytest.approx(1e-6 + link)
    # a pair to the opposite corner of the cube: 3 hops, each a step of latency
    far = op("collective-permute", s, pairs=[(0, 1), (0, 14)])
    assert network.collective_seconds(far, devs, ()) == pytest.approx(3e-6 + link)
    # every pair on its own chip: latency only
    assert network.collective_seconds(op("collective-permute", s, pairs=[(0, 1), (2, 3)]), devs, ()) == \
        pytest.approx(1e-6)


def test_permute_pairs_read_from_the_hlo_and_priced_by_the_slowest():
    text = ("%cp = f32[1024,256]{1,0} collective-permute(%x), channel_id=3, "
            "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, metadata={op_name=\"shift\"}")
    ins = hlo.Instruction("cp", "collective-permute", "f32[1024,256]{1,0}", text, "main")
    assert hlo.permute_pairs(ins) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert hlo.permute_pair(ins) == (0, 1)
    program = f"HloModule m\n\nENTRY %main (x: f32[1024,256]) -> f32[1024,256] {{\n" \
              f"  %x = f32[1024,256]{{1,0}} parameter(0)\n  ROOT {text}\n}}\n"
    (cp,) = hlo.collective_ops(hlo.analyse(program))
    assert cp["pairs"] == [(0, 1), (1, 2), (2, 3), (3, 0)] and cp["bytes"] == 1024 * 256 * 4
    # on tpu7x 2x2x1 (4 chips of 2 cores): 0 -> 1 stays on chip (0, 0, 0), 1 -> 2 crosses a link
    devs = tpu_slice("TPU7x", (2, 2, 1), 2)
    assert network.collective_seconds(cp, devs, ()) == pytest.approx(1e-6 + 1024 * 256 * 4 / (100 * GB))


def test_all_to_all_on_a_ring_is_a_quarter_of_an_all_gather():
    s = 2 ** 30
    # v5p 16x16x16 (a torus): the 16 chips of axis x, 1 device per chip, 2 directions of 100 GB/s.
    # Shards of s/16 travel min(d, 16-d) hops: 2 (1+...+7) + 8 = 64 = 16^2/4 shard-hops per
    # device over its 2 link directions: s/16 * 64 / 200 GB/s = s * 16/4 / (2 x 100 GB/s)
    devs = tpu_slice("TPU v5", (16, 2, 1), 1)
    x_axis = [d.id for d in devs if d.coords[1] == 0]
    got = network.collective_seconds(op("all-to-all", s, x_axis), devs, (True, False, False))
    assert got == pytest.approx(s * 4 / (200 * GB) + 15e-6)
    # ... a quarter of the all-gather of its 16 s result
    gather = network.collective_seconds(op("all-gather", 16 * s, x_axis), devs, (True, False, False))
    assert got - 15e-6 == pytest.approx((gather - 15e-6) * 16 / 15 / 4)
    # a line of 16 (no wraparound): the middle link carries 8 x 8 shards one way, at 100 GB/s
    assert network.collective_seconds(op("all-to-all", s, x_axis), devs, ()) == \
        pytest.approx(s / 16 * 64 / (100 * GB) + 15e-6)
    # a line of 3 (odd): the middle links carry 1 x 2 shards of s/3 each
    devs3 = tpu_slice("TPU v5", (3, 1, 1), 1)
    assert network.collective_seconds(op("all-to-all", s, [0, 1, 2]), devs3, ()) == \
        pytest.approx(s / 3 * 2 / (100 * GB) + 2e-6)
    # two axes of a 4x4 torus at once: per axis 4^2/4 = 4 shard-hops of s/4 over 2 x 100 GB/s
    devs44 = tpu_slice("TPU v5", (4, 4, 4), 1)
    plane = [d.id for d in devs44 if d.coords[2] == 0]
    assert network.collective_seconds(op("all-to-all", s, plane), devs44, (True, True, True)) == \
        pytest.approx(s / 4 * 4 / (200 * GB) + 6e-6)


@pytest.mark.parametrize("name, wrap", [
    # 2-D (v5e, v6e: pods of 16x16 chips): an axis of 16 wraps
    ("v6e:16x16", (True, True, False)), ("v6e:8x16", (False, True, False)),
    ("v6e:16x8", (True, False, False)), ("v5e:16x16", (True, True, False)),
    ("v5e:8x16", (False, True, False)), ("v6e:8x8", (False, False, False)),
    ("v6e:4x4", (False, False, False)), ("v5e:2x2", (False, False, False)),
    # 3-D (v4, v5p, tpu7x): all three where every side is a multiple of 4, else none
    ("tpu7x:4x4x4", (True, True, True)), ("tpu7x:4x8x8", (True, True, True)),
    ("v5p:4x4x12", (True, True, True)), ("v5p:16x16x24", (True, True, True)),
    ("v4:8x8x8", (True, True, True)), ("tpu7x:2x4x4", (False, False, False)),
    ("tpu7x:2x2x2", (False, False, False)), ("v5p:2x2x4", (False, False, False)),
    ("v5p:4x4x6", (False, False, False)),
])
def test_which_axes_of_a_slice_wrap(name, wrap):
    """As MaxText's table of slices has them (v6e-128 = 8x16: (F, T, F); v6e-256 = 16x16 and
    v5e-256: (T, T, F); 3-D whole cubes all, others none)."""
    assert targets.slice_wrap(name) == wrap
    assert targets.torus_links(name) == ({"wrap": wrap} if any(wrap) else {})


def test_the_16_axis_of_a_2d_slice_is_a_ring():
    devs = tpu_slice("TPU v6 lite", (8, 16, 1), 1)           # v6e-128: 8x16
    wrap = targets.slice_wrap("v6e:8x16")
    s = 10 ** 9
    y = [d.id for d in devs if d.coords[0] == 0]              # the 16 chips of the 16 axis
    x = [d.id for d in devs if d.coords[1] == 0]              # the 8 of the other
    # a ring: both directions of its 100 GB/s links; the 8-axis a line: one
    assert network.collective_seconds(op("all-gather", s, y), devs, wrap) == \
        pytest.approx(s * 15 / 16 / (200 * GB) + 15e-6)
    assert network.collective_seconds(op("all-gather", s, x), devs, wrap) == \
        pytest.approx(s * 7 / 8 / (100 * GB) + 7e-6)
    # a permute from one end of the 16 axis to the other: one hop over the wraparound link
    assert network.collective_seconds(op("collective-permute", s, pair=(y[0], y[-1])), devs, wrap) == \
        pytest.approx(1e-6 + s / (100 * GB))


def test_v5e_links_as_published():
    """Cloud TPU v5e: 400 GBps of bidirectional ICI per chip over 4 ports (50 GB/s per link per
    direction); 2 x 100 Gbps NICs per host of 8 chips (25 Gb/s = 3.125 GB/s DCN per chip)."""
    v5e = hardware.BY_NAME["v5e"]
    assert (v5e.link_bw, v5e.dcn_bw) == (50e9, 3.125e9)
    s = 10 ** 9
    devs = tpu_slice("TPU v5 lite", (16, 16, 1), 1)           # v5e-256: a 2-D torus
    ring = [d.id for d in devs if d.coords[1] == 0]
    assert network.collective_seconds(op("all-gather", s, ring), devs, targets.slice_wrap("v5e:16x16")) == \
        pytest.approx(s * 15 / 16 / (100 * GB) + 15e-6)
    # two v5e-4 slices: the same chip of each, over the data-center network
    two = tpu_slice("TPU v5 lite", (2, 2, 1), 1, slices=2)
    assert network.collective_seconds(op("all-reduce", s, [0, 4]), two, ()) == \
        pytest.approx(2 * (s / 2 / (3.125 * GB) + 1e-6))
    assert network.collective_seconds(op("collective-permute", s, pair=(1, 5)), two, ()) == \
        pytest.approx(1e-6 + s / (3.125 * GB))


def test_a_target_without_a_dcn_figure_cannot_price_across_slices(monkeypatch):
    import dataclasses

    rows = tuple(dataclasses.replace(a, dcn_bw=None) if a.name == "v5e" else a for a in hardware.ACCELERATORS)
    monkeypatch.setattr(hardware, "ACCELERATORS", rows)
    two = tpu_slice("TPU v5 lite", (2, 2, 1), 1, slices=2)
    with pytest.raises(network.Unpriced, match="no data-center network"):
        network.collective_seconds(op("all-gather", 10 ** 9, [0, 4]), two, ())
    with pytest.raises(network.Unpriced, match="no data-center network"):
        network.collective_seconds(op("collective-permute", 10 ** 9, pair=(0, 4)), two, ())
    # within the slice it is still priced
    assert network.collective_seconds(op("all-gather", 10 ** 9, [0, 1]), two, ()) > 0


def test_memory_is_what_a_program_may_use():
    gib = hardware.GiB
    # TPUs: libtpu's compile-time limit, as its out-of-memory error prints it (to 0.01 GiB)
    printed = {"v5e": 15.75, "v5p": 95.73, "v6e": 31.24, "tpu7x": 94.74}
    for name, limit in printed.items():
        assert round(hardware.BY_NAME[name].hbm / gib, 2) == limit, name
    # GPUs with a compile target: the row and the target's device memory agree
    import re

    for name, memory in (("h100", 84_929_347_584), ("h200", 150_754_820_096)):
        row = hardware.BY_NAME[name]
        target = int(re.search(r"device_memory_size: (\d+)", row.gpu_target).group(1))
        assert row.hbm == target == memory, name
    assert 79 * gib < hardware.BY_NAME["h100"].hbm < 80 * gib


def test_gpus_inside_a_node_and_across_nodes():
    gpus = [SimpleNamespace(id=i, device_kind="NVIDIA H100 80GB HBM3", platform="gpu") for i in range(16)]
    s = 8 * 10 ** 9
    node = network.collective_seconds(op("all-gather", s, list(range(8))), gpus, ())
    assert node == pytest.approx(s * 7 / 8 / (450 * GB) + 7 * 5e-6)
    across = network.collective_seconds(op("all-gather", s, [0, 8]), gpus, ())
    assert across == pytest.approx(s / 2 / (50 * GB) + 5e-6)
    # a permute inside the node over NVLink; one of whose pairs leaves it, over the network card
    assert network.collective_seconds(op("collective-permute", s, pairs=[(0, 1), (1, 2)]), gpus, ()) == \
        pytest.approx(5e-6 + s / (450 * GB))
    assert network.collective_seconds(op("collective-permute", s, pairs=[(0, 1), (7, 8)]), gpus, ()) == \
        pytest.approx(5e-6 + s / (50 * GB))
    # an all-to-all through the switch: each GPU sends 7/8 of its buffer over its NVLink
    assert network.collective_seconds(op("all-to-all", s, list(range(8))), gpus, ()) == \
        pytest.approx(s * 7 / 8 / (450 * GB) + 7 * 5e-6)


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


COMBINED = """HloModule combined

ENTRY %main (a: bf16[512,64], b: bf16[512], g: bf16[4096,64], h: bf16[4096]) -> bf16[4096,64] {
  %a = bf16[512,64]{1,0} parameter(0)
  %b = bf16[512]{0} parameter(1)
  %g = bf16[4096,64]{1,0} parameter(2)
  %h = bf16[4096]{0} parameter(3)
  %all-gather-start.1 = ((bf16[512,64]{1,0}, /*index=1*/bf16[512]{0}), (bf16[4096,64]{1,0}, bf16[4096]{0})) all-gather-start(%a, %b), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done.1 = (bf16[4096,64]{1,0}, bf16[4096]{0}) all-gather-done(%all-gather-start.1)
  %reduce-scatter-start.2 = ((bf16[4096,64]{1,0}, bf16[4096]{0}), (bf16[512,64]{1,0}, bf16[512]{0})) reduce-scatter-start(%g, %h), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %reduce-scatter-done.2 = (bf16[512,64]{1,0}, bf16[512]{0}) reduce-scatter-done(%reduce-scatter-start.2)
  %ags.3 = (bf16[512,64]{1,0}, bf16[4096,64]{1,0}) all-gather-start(%a), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %agd.3 = bf16[4096,64]{1,0} all-gather-done(%ags.3)
}
"""


def test_combined_collectives_count_every_operand():
    """XLA's GPU combiners put many gathers (or scatters) into one async collective whose start
    returns ((inputs...), (outputs...)): an all-gather moves all of its gathered outputs, a
    reduce-scatter all of its inputs -- not only the largest array of the tuple."""
    ops = {o["name"]: o for o in hlo.collective_ops(hlo.analyse(COMBINED))}
    assert ops["all-gather-start.1"]["bytes"] == (4096 * 64 + 4096) * 2
    assert ops["reduce-scatter-start.2"]["bytes"] == (4096 * 64 + 4096) * 2
    assert ops["ags.3"]["bytes"] == 4096 * 64 * 2          # a single one: its gathered result
    assert all(o["async"] for o in ops.values())

