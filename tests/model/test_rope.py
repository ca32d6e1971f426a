"""RoPE as applied by the model is the textbook rotate-half formula, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.model.rope import apply_rope, rope_tables


def _textbook(x, sin, cos):
    """HF / OLMo-core: ``x * cos + rotate_half(x) * sin`` in fp32, cast back to x's dtype."""
    if sin.ndim == 2:
        sin, cos = sin[None], cos[None]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("per_row", [False, True])
def test_apply_rope_is_rotate_half_bit_for_bit(dtype, per_row):
    b, t, h, d = 2, 24, 3, 16
    x = jax.random.normal(jax.random.PRNGKey(0), (b, t, h, d), jnp.float32).astype(dtype) * 3
    if per_row:   # documents: each row has its own positions
        positions = jnp.stack([jnp.arange(t), jnp.concatenate([jnp.arange(10), jnp.arange(t - 10)])])
    else:
        positions = jnp.arange(t) + 1000
    sin, cos = rope_tables(positions, d, 500_000.0)
    got, want = apply_rope(x, sin, cos), _textbook(x, sin, cos)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    # the first half mixes with the second, not with its neighbour: swapping halves changes it
    assert not np.array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(
        _textbook(jnp.concatenate([x[..., d // 2:], x[..., :d // 2]], -1), sin, cos).astype(jnp.float32)))

    def loss(f):
        return lambda v: jnp.sum(f(v, sin, cos).astype(jnp.float32) * jnp.arange(d, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(jax.grad(loss(apply_rope))(x).astype(jnp.float32)),
                                  np.asarray(jax.grad(loss(_textbook))(x).astype(jnp.float32)))
