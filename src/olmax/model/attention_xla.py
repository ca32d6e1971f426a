"""The reference attention (``impl="xla"``): full T x T scores, softmax in fp32, GQA.

Window semantics are OLMo's: a window of W means each query sees the W keys ending at itself,
``q - W < k <= q`` (flash-attn ``window_size=(W-1, 0)``; HF ``kv_idx > q_idx - sliding_window``).
Every faster implementation (:mod:`olmax.model.attention_impls`) is tested for equality against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e30  # large finite negative: fully masked rows cannot occur (the diagonal is always visible)


def causal_window_mask(q_len: int, k_len: int, window: int | None, q_offset: int = 0) -> jnp.ndarray:
    """Boolean [q_len, k_len] mask: True where query i (at position q_offset+i) may see key j."""
    qi = jnp.arange(q_len)[:, None] + q_offset
    kj = jnp.arange(k_len)[None, :]
    mask = kj <= qi
    if window is not None:
        mask = mask & (kj > qi - window)
    return mask


def xla_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, window: int | None,
                  scale: float) -> jnp.ndarray:
    """q: [B, T, Hq, D], k/v: [B, T, Hkv, D] -> [B, T, Hq, D] (q.dtype)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    mask = causal_window_mask(t, t, window)
    scores = jnp.where(mask, scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)
