"""Causal (optionally sliding-window) attention with GQA: one entry point, every implementation.

Window semantics are OLMo's: a window of W means each query sees the W keys ending at itself,
``q - W < k <= q`` (flash-attn ``window_size=(W-1, 0)``; HF ``kv_idx > q_idx - sliding_window``).

``impl="xla"`` is the reference (:mod:`olmax.model.attention_ref`): full T x T scores, softmax in
fp32. The faster ones (:mod:`olmax.model.attention_impls`: block-sparse ``chunked``,
``dot_product``, ``cudnn``; :mod:`olmax.model.splash`: TPU ``splash``) are tested for equality
against it; ``auto`` picks one for the platform. A new implementation is a function and one entry
in :data:`IMPLEMENTATIONS` (and in ``olmax.config.AttnImpl``, the choices of ``train.attn_impl``).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from olmax.model.attention_impls import chunked_attention, cudnn_attention, dot_product_attention
from olmax.model.attention_ref import xla_attention
from olmax.model.logical import context_platform
from olmax.model.splash import splash_attention

AttentionFn = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray, "int | None", float], jnp.ndarray]

IMPLEMENTATIONS: dict[str, AttentionFn] = {
    "xla": xla_attention,
    "chunked": chunked_attention,
    "dot_product": dot_product_attention,
    "cudnn": cudnn_attention,
    "splash": splash_attention,
}


# ``auto``: the fastest exact implementation for the platform the computation compiles for.
AUTO_BY_PLATFORM = {"tpu": "splash", "gpu": "cudnn"}
AUTO_DEFAULT = "chunked"


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
