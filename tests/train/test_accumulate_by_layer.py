"""``train.accumulate_by_layer``: the micro-batch loop takes the gradients with respect to each
layer's weights apart and sums them into one accumulator per layer (``olmax.train.step``).

It is a different program for the same sums in the same order: the training it runs is the
stacked accumulation's bit for bit, on the CPU's code path and on the TPU's (the ``tpu`` profile's
kernels, run here on the CPU). What it changes is what the loop carries, which the traced step
shows: one fp32 accumulator per layer instead of the stacked gradient of all layers.

``train.accumulate_embedding_by_row`` (with it, by default) adds each micro-batch's embedding
gradient into the table's accumulator row by row: the same sums in another order, held against
the gradient of the whole batch in one micro-batch.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.model.runtime import Runtime
from olmax.parallel.mesh import make_mesh
from olmax.train.loss import loss_and_sums
from olmax.train.optim import build_optimizer
from olmax.train.recipes import load_recipe
from olmax.train.step import (Placement, accumulate_gradients, batch_rows, build_sharded_training,
                              make_train_step)
from helpers.jaxprs import all_eqns

# 8 sequences of 64 tokens: 4 micro-batches
BASE = ["train.micro_batch_size=2", "train.attn_impl=xla", "train.seq_len=64"]


def _cfg(*overrides: str):
    return load_recipe("olmo3_tiny", [*BASE, *overrides])


def _train(profile: str, by_layer: bool, steps: int = 2):
    """(The embedding's rows accumulated as a whole table, as the stacked accumulation does.)"""
    cfg = _cfg(f"train.profile={profile}", f"train.accumulate_by_layer={str(by_layer).lower()}",
               "train.accumulate_embedding_by_row=false")
    st = build_sharded_training(cfg.model, cfg.train, build_optimizer(cfg.optim),
                                make_mesh(cfg.mesh, jax.devices()[:1]), jax.random.key(0))
    assert st.n_micro == 4
    state = st.fresh_state()
    b, t = cfg.train.global_batch_size, cfg.train.seq_len
    rng = np.random.default_rng(0)
    metrics = []
    for _ in range(steps):
        tokens = rng.integers(0, cfg.model.vocab_size, size=(b, t), dtype=np.int32)
        state, m = st.step_fn(state, {"tokens": tokens, "instance_mask": np.ones(b, bool)},
                              jnp.float32(3e-3))
        metrics.append({k: float(v) for k, v in m.items()})
    return metrics, [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.slow      # two compiles each (11-17 s on 2 cores); the training tests with micro-batches run the per-layer path
@pytest.mark.parametrize("profile", ["cpu", "tpu"])
def test_per_layer_accumulation_trains_bit_for_bit_as_the_stacked_one(profile):
    stacked, by_layer = _train(profile, False), _train(profile, True)
    assert by_layer[0] == stacked[0]                  # loss, z-loss, grad norm, every step
    assert len(by_layer[1]) == len(stacked[1])
    for a, b in zip(by_layer[1], stacked[1]):
        np.testing.assert_array_equal(a, b)


def _micro_loop(*overrides: str):
    """The traced step's micro-batch loop (4 micro-batches) and the config it was traced with."""
    cfg = _cfg(*overrides)
    tx = build_optimizer(cfg.optim)
    step = make_train_step(cfg.model, cfg.train, tx, n_micro=4)
    st = build_sharded_training(cfg.model, cfg.train, tx, make_mesh(cfg.mesh, jax.devices()[:1]),
                                jax.random.key(0))
    b, t = cfg.train.global_batch_size, cfg.train.seq_len
    batch = {"tokens": jax.ShapeDtypeStruct((b, t), jnp.int32),
             "instance_mask": jax.ShapeDtypeStruct((b,), jnp.bool_)}
    jaxpr = jax.make_jaxpr(step)(st.abstract_state, batch, jax.ShapeDtypeStruct((), jnp.float32))
    loops = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(loops) == 1        # the micro-batch loop (the model's own loops are inside it)
    return loops[0], cfg


def _loop_carries(*overrides: str) -> list[tuple[int, ...]]:
    """The shapes of the fp32 arrays the step's micro-batch loop carries."""
    loop, _ = _micro_loop(*overrides)
    carry = loop.outvars[:loop.params["num_carry"]]
    return [tuple(v.aval.shape) for v in carry if v.aval.dtype == jnp.float32]


def test_the_loop_carries_one_accumulator_per_layer():
    cfg = _cfg()
    n, d = cfg.model.n_layers, cfg.model.d_model
    stacked = _loop_carries("train.accumulate_by_layer=false", "train.profile=tpu")
    by_layer = _loop_carries("train.accumulate_by_layer=true", "train.profile=tpu")
    # the stacked gradients of the layers' weights, e.g. the q projections' [L, D, D]
    assert (n, d, cfg.model.q_dim) in stacked
    assert not [s for s in by_layer if len(s) >= 2 and s[0] == n]
    # the same arrays otherwise, and L accumulators of each of the stack's shapes
    layer = [s for s in stacked if len(s) >= 2 and s[0] == n]
    rest = [s for s in stacked if s not in layer]
    assert sorted(by_layer) == sorted(rest + [s[1:] for s in layer for _ in range(n)])


def test_a_rolled_layer_scan_keeps_the_stacked_accumulation():
    """The per-layer path needs the layers unrolled; with the scan kept it is not taken."""
    assert (_loop_carries("train.accumulate_by_layer=true", "train.profile=gpu")
            == _loop_carries("train.accumulate_by_layer=false", "train.profile=gpu"))


def _batch_gradients(profile: str, n_micro: int, by_row: bool, dtype: str = "float32"):
    """The fp32 gradients of one batch of 8 sequences over ``n_micro`` micro-batches, the tokens
    drawn from 6 ids so that every id occurs many times in every micro-batch."""
    cfg = _cfg(f"train.profile={profile}", f"train.compute_dtype={dtype}")
    rt = Runtime.of(cfg.train)
    grad_fn = jax.value_and_grad(partial(loss_and_sums, cfg=cfg.model, runtime=rt,
                                         z_loss_multiplier=1e-4, chunk_size=64), has_aux=True)
    st = build_sharded_training(cfg.model, cfg.train, build_optimizer(cfg.optim),
                                make_mesh(cfg.mesh, jax.devices()[:1]), jax.random.key(0))
    params = st.fresh_state().params
    b, t = cfg.train.global_batch_size, cfg.train.seq_len
    tokens = np.random.default_rng(1).integers(0, 6, size=(b, t), dtype=np.int32)
    rows = batch_rows({"tokens": jnp.asarray(tokens), "instance_mask": jnp.ones(b, bool)}, 1)
    by_layer = n_micro > 1
    fn = jax.jit(lambda p: accumulate_gradients(grad_fn, p, rows, n_micro, Placement(None, None),
                                                by_layer=by_layer, embed_by_row=by_row)[0])
    return jax.tree.map(np.asarray, fn(params))


@pytest.mark.parametrize("profile", ["cpu", "tpu"])
def test_embedding_rows_accumulate_to_the_whole_batchs_gradient(profile):
    """Four micro-batches, the embedding accumulated row by row: its gradient is the one-micro-
    batch gradient of the whole batch up to fp32 summation order, and so is every other weight's;
    rows of ids that never occur stay exactly zero."""
    whole = _batch_gradients(profile, 1, False)
    by_row = _batch_gradients(profile, 4, True)
    table, ref = by_row["embed"], whole["embed"]
    assert np.abs(ref[:6]).min(axis=1).max() > 0
    np.testing.assert_allclose(table, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_array_equal(table[6:], 0.0)
    refs = dict(jax.tree_util.tree_leaves_with_path(whole))
    for path, g in jax.tree_util.tree_leaves_with_path(by_row):
        r = refs[path]
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6 * np.abs(r).max(),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow      # two compiles of the bf16 step
def test_embedding_rows_in_bf16_differ_by_the_whole_tables_rounding():
    """In a bf16 model the whole-table path sums a micro-batch's position gradients of an id in
    bf16 before adding them to the fp32 accumulator; row by row they are summed in fp32. The two
    tables then differ, by no more than bf16's rounding of the gradient; ids that never occur
    stay exactly zero on both."""
    by_row = _batch_gradients("tpu", 4, True, "bfloat16")["embed"]
    table = _batch_gradients("tpu", 4, False, "bfloat16")["embed"]
    scale = np.abs(by_row[:6]).max()
    diff = np.abs(table[:6] - by_row[:6]).max() / scale
    assert 2.0 ** -16 < diff <= 2.0 ** -7, diff
    np.testing.assert_array_equal(by_row[6:], 0.0)
    np.testing.assert_array_equal(table[6:], 0.0)


def _table_writes(by_row: bool) -> dict[str, int]:
    """Primitives in the micro-batch loop's body that write an array of the embedding table's
    shape, by name."""
    loop, cfg = _micro_loop("train.profile=tpu",
                            f"train.accumulate_embedding_by_row={str(by_row).lower()}")
    shape = (cfg.model.padded_vocab_size, cfg.model.d_model)
    found: dict[str, int] = {}
    for e in all_eqns(loop.params["jaxpr"].jaxpr):
        if any(tuple(getattr(v.aval, "shape", ())) == shape for v in e.outvars):
            found[e.primitive.name] = found.get(e.primitive.name, 0) + 1
    return found


def test_embedding_rows_are_added_into_the_accumulator_without_a_table_per_micro_batch():
    """Row by row, the loop body writes the table's shape once: the scatter-add of its rows into
    the accumulator. Autodiff of the lookup writes a table of zeros, scatters the rows into it
    and adds that to the accumulator."""
    whole = _table_writes(False)
    assert whole.get("scatter-add") == 1 and whole.get("add", 0) + whole.get("add_any", 0) >= 1
    assert _table_writes(True) == {"scatter-add": 1}
