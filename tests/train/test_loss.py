"""The loss against OLMo-core's ``cross_entropy_loss``/``get_labels``, chunking, accumulation, bf16."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from olmax.config import OptimConfig, TrainConfig
from olmax.model.olmo3 import forward
from olmax.model.params import init_params
from olmax.train.loss import IGNORE_INDEX, lm_loss_sums, loss_denominator, make_labels
from olmax.train.optim import skip_step_adamw
from olmax.train.state import init_train_state
from olmax.train.step import make_train_step
from helpers.reference import require
from helpers.tiny import small_cfg

CFG = small_cfg(vocab_size=120, padded_vocab_size=128, window_pattern=(8, 8, 8, None), max_seq_len=32)


def _batch(seed=0, b=4, t=24):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 120, size=(b, t)).astype(np.int32)
    mask = np.ones(b, bool)
    mask[1] = False
    return tokens, mask


@pytest.mark.reference
def test_labels_and_denominator_match_olmo_core():
    torch = require("torch")
    from olmo_core.data.utils import get_labels

    tokens, mask = _batch()
    ref = get_labels({"input_ids": torch.tensor(tokens, dtype=torch.long),
                      "instance_mask": torch.tensor(mask)})
    ours = make_labels(jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(ours), ref.numpy())
    assert IGNORE_INDEX == -100
    # train_batch: scored labels + T per masked instance (3 rows x 23 labels + 1 x 24)
    assert float(loss_denominator(ours, jnp.asarray(mask))) == 3 * 23 + 24


@pytest.mark.reference
@pytest.mark.parametrize("chunk", [24, 5])
def test_chunked_loss_sums_match_olmo_core_cross_entropy(chunk):
    torch = require("torch")
    from olmo_core.nn.functional.cross_entropy_loss import cross_entropy_loss

    params = init_params(CFG, jax.random.key(0))
    tokens, mask = _batch(1)
    labels = make_labels(jnp.asarray(tokens), jnp.asarray(mask))
    logits = np.asarray(forward(params, jnp.asarray(tokens), CFG))
    ce_ref, z_ref = cross_entropy_loss(torch.tensor(logits).reshape(-1, 128),
                                       torch.tensor(np.asarray(labels)).reshape(-1).long(),
                                       reduction="sum", compute_z_loss=True, z_loss_multiplier=1e-5)
    from olmax.model.olmo3 import hidden_states

    h = hidden_states(params, jnp.asarray(tokens), CFG)
    sums = lm_loss_sums(h, params["lm_head"], labels, z_loss_multiplier=1e-5, chunk_size=chunk)
    assert float(sums.ce) == pytest.approx(float(ce_ref), rel=2e-6)
    assert float(sums.z) == pytest.approx(float(z_ref), rel=2e-6)


@functools.lru_cache(maxsize=None)
def _one_step(n_micro, compute_dtype="float32"):
    tokens, mask = _batch(2, b=8)
    train = TrainConfig(seq_len=24, global_batch_size=8, compute_dtype=compute_dtype)
    # eps 1e-3 keeps Adam's first step a smooth function of the gradient (with eps 1e-8 it is
    # ~sign(g), which turns rounding-level gradient differences into lr-sized ones)
    tx = skip_step_adamw(OptimConfig(lr=1e-2, eps=1e-3))
    step = jax.jit(make_train_step(CFG, train, tx, n_micro=n_micro, chunk_size=8))
    state = init_train_state(init_params(CFG, jax.random.key(1)), tx)
    state, m = step(state, {"tokens": jnp.asarray(tokens), "instance_mask": jnp.asarray(mask)},
                    jnp.float32(1e-2))
    return state, jax.device_get(m)


def test_micro_batch_accumulation_equals_the_full_batch():
    s1, m1 = _one_step(1)
    s4, m4 = _one_step(4)
    for k in ("loss", "z_loss", "grad_norm", "num_tokens"):
        assert float(m4[k]) == pytest.approx(float(m1[k]), rel=2e-6), k
    for a, b in zip(jax.tree.leaves(s4.params), jax.tree.leaves(s1.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_bf16_compute_keeps_fp32_master_weights():
    s32, m32 = _one_step(1)
    s16, m16 = _one_step(1, "bfloat16")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s16.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s16.opt_state.inner[0].mu))
    assert float(m16["loss"]) == pytest.approx(float(m32["loss"]), rel=2e-2)
    assert float(m16["loss"]) != float(m32["loss"])



def test_target_logits_and_their_gradient_equal_a_gather_bit_for_bit():
    """The target's logit is a masked sum over the vocabulary (its gradient fuses with the softmax
    gradient on TPU): per position it, the logsumexp and the gradients through both equal
    ``take_along_axis``'s exactly."""
    from olmax.model.olmo3 import logits_from_hidden, lse_and_target_logits

    k = jax.random.split(jax.random.key(3), 4)
    h = jax.random.normal(k[0], (2, 24, 32), jnp.bfloat16)
    w = (0.3 * jax.random.normal(k[1], (32, 128))).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (2, 24), 0, 128).at[:, 0].set(jnp.array([0, 127]))
    g = jax.random.normal(k[3], (2, 2, 24))          # cotangents of (lse, target)

    def gathered(h, w, targets):
        logits = logits_from_hidden(h, w)
        return (jax.nn.logsumexp(logits, axis=-1),
                jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0])

    def run(fn):
        out, vjp = jax.vjp(lambda h, w: fn(h, w, y), h, w)
        return out, vjp((g[0], g[1]))

    ours, ref = jax.jit(lambda: run(lse_and_target_logits))(), jax.jit(lambda: run(gathered))()
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
