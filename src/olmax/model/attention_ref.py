"""The reference attention (``impl="xla"``) and what every implementation shares.

Window semantics are OLMo's: a window of W means each query sees the W keys ending at itself,
``q - W < k <= q`` (flash-attn ``window_size=(W-1, 0)``; HF ``kv_idx > q_idx - sliding_window``).
:func:`xla_attention` computes full T x T scores with the softmax in fp32; every faster
implementation (:mod:`olmax.model.attention_impls`, :mod:`olmax.model.splash`) is tested for
equality against it. Kernels XLA cannot partition run per device through
:func:`per_device_attention` (q, k, v placed by their logical axes).

Intra-document masking: every implementation takes optional ``segment_ids`` int32 [B, T] (the
document each position belongs to, :mod:`olmax.model.documents`); query q then also needs
``segment[q] == segment[k]``. The diagonal stays visible, so no row is ever fully masked. None
is the plain causal / sliding-window attention, computed exactly as without the argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmax.model.logical import per_device

NEG = -1e30  # large finite negative: fully masked rows cannot occur (the diagonal is always visible)


def causal_window_mask(q_len: int, k_len: int, window: int | None, q_offset: int = 0) -> jnp.ndarray:
    """Boolean [q_len, k_len] mask: True where query i (at position q_offset+i) may see key j."""
    qi = jnp.arange(q_len)[:, None] + q_offset
    kj = jnp.arange(k_len)[None, :]
    mask = kj <= qi
    if window is not None:
        mask = mask & (kj > qi - window)
    return mask


def same_segment(seg_q: jnp.ndarray, seg_k: jnp.ndarray) -> jnp.ndarray:
    """[B, Tq, Tk]: True where query i and key j lie in the same document."""
    return seg_q[:, :, None] == seg_k[:, None, :]


def xla_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, window: int | None,
                  scale: float, segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
    """q: [B, T, Hq, D], k/v: [B, T, Hkv, D] -> [B, T, Hq, D] (q.dtype); ``segment_ids`` [B, T]
    adds the document mask."""
    t = q.shape[1]
    mask = causal_window_mask(t, t, window)
    if segment_ids is not None:
        mask = (mask[None] & same_segment(segment_ids, segment_ids))[:, None, None]  # [B,1,1,T,T]
    return masked_attention(q, k, v, mask, scale)


def masked_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray,
                     scale: float) -> jnp.ndarray:
    """q: [B, Tq, Hq, D], k/v: [B, Tk, Hkv, D], ``mask`` (True: visible) broadcastable to
    [B, Hkv, Hq / Hkv, Tq, Tk] -> [B, Tq, Hq, D]: full scores, softmax in fp32."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, tq, hkv, g, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask, scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, tq, hq, d).astype(q.dtype)


# Logical axes of attention's inputs/outputs (as in ``olmax.model.olmo3``), for kernels that run
# per device (``olmax.model.logical.per_device``). Such a kernel sees whole sequences: with
# context parallelism (positions split over devices) q, k and v are gathered over ``context`` and
# each device of a context group computes its rows' attention for every position -- except where
# the implementation splits the queries (``olmax.model.attention_cp``: splash and xla).
QKV_AXES = (("batch", None, "act_heads", "head_dim"), ("batch", None, "act_kv_heads", "head_dim"),
            ("batch", None, "act_kv_heads", "head_dim"))


SEGMENT_AXES = ("batch", None)


def per_device_attention(fn, q, k, v, segment_ids=None):
    """``fn(q, k, v)`` (``fn(q, k, v, segment_ids)`` when given) on each device's sequences (and
    heads) under a mesh; ``fn`` itself otherwise."""
    if segment_ids is None:
        return per_device(fn, (q, k, v), QKV_AXES)
    return per_device(fn, (q, k, v, segment_ids), QKV_AXES + (SEGMENT_AXES,))
