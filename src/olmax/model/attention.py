"""Causal (optionally sliding-window) attention with GQA.

Window semantics are OLMo's: a window of W means each query sees the W keys ending at itself,
``q - W < k <= q`` (flash-attn ``window_size=(W-1, 0)``; HF ``kv_idx > q_idx - sliding_window``).

``impl="xla"`` is the reference: full T x T scores, softmax in fp32. Faster implementations
register themselves in ``IMPLEMENTATIONS`` and are tested for equality against it.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

_NEG = -1e30  # large finite negative: fully masked rows cannot occur (the diagonal is always visible)


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
    scores = jnp.where(mask, scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


AttentionFn = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray, "int | None", float], jnp.ndarray]

IMPLEMENTATIONS: dict[str, AttentionFn] = {"xla": xla_attention}

# Faster implementations (block-sparse chunked, jax.nn.dot_product_attention, cuDNN) live in
# ``olmax.model.attention_impls`` and add themselves to IMPLEMENTATIONS on import.
from olmax.model import attention_impls as _impls  # noqa: E402,F401  (registers implementations)


# ``auto``: the fastest exact implementation for the platform the computation compiles for.
AUTO_BY_PLATFORM = {"tpu": "splash", "gpu": "cudnn"}
AUTO_DEFAULT = "chunked"


def context_platform() -> str:
    """The platform being compiled for: that of the mesh traced under, else JAX's default backend
    (they differ when compiling ahead of time for a TPU topology on a CPU host)."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


# Logical axes of attention's inputs/outputs (as in ``olmax.model.olmo3``), for kernels that run
# per device (``olmax.model.logical.per_device``).
QKV_AXES = (("batch", "seq", "act_heads", "head_dim"), ("batch", "seq", "act_kv_heads", "head_dim"),
            ("batch", "seq", "act_kv_heads", "head_dim"))


def per_device_attention(fn, q, k, v):
    """``fn(q, k, v)`` on each device's sequences (and heads) under a mesh; ``fn`` itself otherwise."""
    from olmax.model.logical import per_device

    return per_device(fn, (q, k, v), QKV_AXES)


def resolve_attn_impl(impl: str, platform: str | None = None) -> str:
    """``impl`` itself, or for ``"auto"`` the implementation for ``platform`` ('tpu': splash,
    'gpu': cudnn, anything else: chunked). Without a platform: the platform of the mesh being
    traced under, else JAX's default backend."""
    if impl != "auto":
        return impl
    platform = platform or context_platform()
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    return AUTO_BY_PLATFORM.get(platform, AUTO_DEFAULT)


def attention(q, k, v, window: int | None, scale: float, impl: str = "xla") -> jnp.ndarray:
    impl = resolve_attn_impl(impl)
    try:
        fn = IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(f"unknown attention implementation '{impl}' "
                         f"(known: auto, {', '.join(IMPLEMENTATIONS)})") from None
    return fn(q, k, v, window, scale)
