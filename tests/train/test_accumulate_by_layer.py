"""``train.accumulate_by_layer``: the micro-batch loop takes the gradients with respect to each
layer's weights apart and sums them into one accumulator per layer (``olmax.train.step``).

It is a different program for the same sums in the same order: the training it runs is the
stacked accumulation's bit for bit, on the CPU's code path and on the TPU's (the ``tpu`` profile's
kernels, run here on the CPU). What it changes is what the loop carries, which the traced step
shows: one fp32 accumulator per layer instead of the stacked gradient of all layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.train.optim import build_optimizer
from olmax.train.recipes import load_recipe
from olmax.train.step import build_sharded_training, make_train_step
from olmax.parallel.mesh import make_mesh

# 8 sequences of 64 tokens: 4 micro-batches
BASE = ["train.micro_batch_size=2", "train.attn_impl=xla", "train.seq_len=64"]


def _cfg(*overrides: str):
    return load_recipe("olmo3_tiny", [*BASE, *overrides])


def _train(profile: str, by_layer: bool, steps: int = 2):
    cfg = _cfg(f"train.profile={profile}", f"train.accumulate_by_layer={str(by_layer).lower()}")
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


def _loop_carries(*overrides: str) -> list[tuple[int, ...]]:
    """The shapes of the fp32 arrays the step's micro-batch loop carries."""
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
    carry = loops[0].outvars[:loops[0].params["num_carry"]]
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
