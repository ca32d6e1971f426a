"""FSDP over a whole TPU torus gathers its weights with all-gathers, not full-size all-reduces.

The TPU compiler plans collectives on the links the topology has. ``olmax plan`` used to describe
every slice without its wraparound links; on such a mesh of 64 devices or more the compiler's
all-gather decomposer rewrites each all-gather over the whole slice as an all-reduce of the full,
zero-padded weight (the 7B step on tpu7x 4x8x8: no all-gather, 342 full-weight all-reduces, 36 GiB
per device per step). Real slices whose sides are multiples of 4 are tori
(``olmax.perf.targets.torus_links``); compiled for one, the same step all-gathers its weights.
Here the olmo3-tiny step (d_model 256) on tpu7x 4x4x4 (128 devices, the smallest tpu7x torus),
FSDP over all of them, compiled both ways: without the wraparound no all-gather and 77 full-size
weight all-reduces (30 weight matrices); on the torus every layer weight all-gathered and 30
full-size all-reduces, one per gradient."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from olmax.model.params import param_shapes
from olmax.perf import hlo, targets
from olmax.perf.plan import plan
from olmax.train.recipes import load_recipe

TOPOLOGY = "tpu7x:4x4x4"
# d_model 256: 2 rows of every weight matrix per device (at 64, fsdp would not divide it and
# the weights would stay whole)
OVERRIDES = ["model.d_model=256", "train.global_batch_size=128", "train.micro_batch_size=1",
             "train.seq_len=128"]


def compile_step(tmp_path, recipe: str = "olmo3_tiny", overrides=OVERRIDES):
    """The plan (without parts) of ``recipe`` on :data:`TOPOLOGY`, its model, its analysed HLO."""
    cfg = load_recipe(recipe, list(overrides), find_mix=False)
    out = tmp_path / "step.hlo"
    p = plan(cfg, TOPOLOGY, parts=False, hlo_out=str(out))
    return p, cfg.model, hlo.analyse(out.read_text())


def weight_collectives(tmp_path) -> tuple[dict, Counter, int]:
    """The step's mesh; per (all-gather | all-reduce | reduce-scatter, matrix shape), how many
    full weight matrices the compiled step moves (loop trip counts included); the number of weight
    matrices."""
    p, model, prog = compile_step(tmp_path)
    shapes = param_shapes(model)
    layer = [s[1:] for s in shapes["layers"].values() if len(s) == 3]
    top = [s for k, s in shapes.items() if k != "layers" and len(s) == 2]
    matrices = {tuple(sorted(s)) for s in layer + top}
    moved: Counter = Counter()
    for ins, times in prog.instructions():
        kind = hlo.collective_kind(ins)
        if kind not in ("all-gather", "all-reduce", "reduce-scatter"):
            continue
        for _, a in hlo.array_shapes(ins.shape):
            if len(a) >= 2 and math.prod(a[:-2]) == 1 and tuple(sorted(a[-2:])) in matrices:
                moved[kind, tuple(sorted(a[-2:]))] += times
    return p.details["mesh"], moved, len(layer) * model.n_layers + len(top)


def gathered_by_all_reduce(moved: Counter, n_matrices: int) -> bool:
    """Weights gathered with full-size all-reduces: no all-gather of a full weight matrix, or more
    full-size all-reduces of weight matrices than one per gradient."""
    gathers = sum(v for (kind, _), v in moved.items() if kind == "all-gather")
    reduces = sum(v for (kind, _), v in moved.items() if kind == "all-reduce")
    return gathers == 0 or reduces > n_matrices


@pytest.mark.parametrize("name, wrap", [
    ("tpu7x:4x4x4", (True,) * 3), ("tpu7x:4x8x8", (True,) * 3), ("v5p:4x4x8", (True,) * 3),
    ("v4:8x8x8", (True,) * 3), ("tpu7x:2x4x4", None), ("tpu7x:2x2x2", None), ("v5p:2x2x4", None),
    ("v5p:4x4x12", (True,) * 3), ("v6e:16x16", (True, True, False)), ("v6e:8x16", (False, True, False)),
    ("v6e:8x8", None), ("v5e:2x2", None)])
def test_torus_links(name, wrap):
    """As MaxText 0.2.5's table of slices has them (all 207 of its 3-D slices agree; a 2-D
    slice's axis of 16 wraps)."""
    assert targets.torus_links(name) == ({"wrap": wrap} if wrap else {})


@pytest.mark.tpu
@pytest.mark.slow
def test_without_the_wraparound_fsdp_gathers_weights_with_all_reduces(tmp_path, monkeypatch):
    """The slice as ``olmax plan`` described it before: the check below catches it."""
    monkeypatch.setattr(targets, "torus_links", lambda name: {})
    mesh, moved, n = weight_collectives(tmp_path)
    assert mesh["fsdp"] == 128 and math.prod(mesh.values()) == 128
    assert not any(kind == "all-gather" for kind, _ in moved)
    assert gathered_by_all_reduce(moved, n)


@pytest.mark.tpu
@pytest.mark.slow
def test_on_the_torus_fsdp_gathers_weights_with_all_gathers(tmp_path):
    assert targets.torus_links(TOPOLOGY) == {"wrap": (True, True, True)}
    mesh, moved, n = weight_collectives(tmp_path)
    assert mesh["fsdp"] == 128 and math.prod(mesh.values()) == 128
    assert not gathered_by_all_reduce(moved, n)
    gathered = {shape for kind, shape in moved if kind == "all-gather"}
    assert len(gathered) == 3          # (256, 64) q/o, (256, 32) k/v, (256, 256) MLP: every layer weight
    assert sum(v for (kind, _), v in moved.items() if kind == "all-reduce") == n   # the gradients


# The 7B's layer shapes (d_model 4096, MLP 11008), 4 layers, short rows and a small vocabulary:
# about 90 CPU s to compile (125 at 1,024 positions; the weights and their gradients, what the
# test reads, do not depend on the rows' length). The MLP weights' gradients are what libtpu's
# default scoped VMEM turns into full-size all-reduces.
SEVEN_B = ["model.n_layers=4", "train.micro_batch_size=1", "train.global_batch_size=128",
           "train.seq_len=256", "data.max_target_seq_len=256", "model.vocab_size=1024",
           "model.padded_vocab_size=1024"]


@pytest.mark.tpu
@pytest.mark.slow
def test_7b_layer_gradients_are_reduce_scattered_asynchronously(tmp_path):
    """FSDP 128 on the torus, compiled with Ironwood's options
    (tpu7x's ``compiler_options`` in ``olmax.hardware``: 64 MiB of scoped VMEM): every layer weight's
    gradient is reduce-scattered, no full-size weight is all-reduced, and no collective of more
    than 1 MiB blocks the step (one of 136 KiB does: the optimizer's statistics, once per step).
    With libtpu's default the same program all-reduces all 12 MLP gradients at full size, and the
    check below fails on it (checked at these shapes; when the option was chosen, at 1,024
    positions, 14 full-size all-reduces of 1.0 GiB per step were also synchronous)."""
    p, model, prog = compile_step(tmp_path, "olmo3_7b_stage1", SEVEN_B)
    assert p.details["compiler_options"] == {"xla_tpu_scoped_vmem_limit_kib": "65536"}
    assert p.details["mesh"]["fsdp"] == 128
    layer = {tuple(sorted(s[1:])) for s in param_shapes(model)["layers"].values() if len(s) == 3}
    assert (4096, 11008) in layer
    shards = {tuple(sorted((a // 128 if i == j else a) for j, a in enumerate(s)))
              for s in layer for i in range(2)}
    full, scattered = Counter(), Counter()
    for ins, times in prog.instructions():
        kind = hlo.collective_kind(ins)
        for _, a in hlo.array_shapes(ins.shape):
            m = tuple(sorted(a[-2:])) if len(a) >= 2 and math.prod(a[:-2]) == 1 else None
            if kind == "all-reduce" and m in layer:
                full[m] += times
            if kind == "reduce-scatter" and m in shards:
                scattered[m] += times
    assert not full, f"full-size all-reduces of weights: {dict(full)}"
    assert sum(scattered.values()) >= 7 * model.n_layers     # q, k, v, o, gate, up, down per layer
    blocking = [op for op in hlo.collective_ops(prog) if not op["async"] and op["bytes"] > 2**20]
    assert not blocking, blocking
