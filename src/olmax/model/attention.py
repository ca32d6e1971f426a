"""Causal (optionally sliding-window) attention with GQA: one entry point, every implementation.

Window semantics are OLMo's: a window of W means each query sees the W keys ending at itself,
``q - W < k <= q`` (flash-attn ``window_size=(W-1, 0)``; HF ``kv_idx > q_idx - sliding_window``).

``impl="xla"`` is the reference (:mod:`olmax.model.attention_ref`): full T x T scores, softmax in
fp32. The faster ones (:mod:`olmax.model.attention_impls`: block-sparse ``chunked``,
``dot_product``, ``cudnn``; :mod:`olmax.model.splash`: TPU ``splash``) are tested for equality
against it; ``auto`` picks one for the platform. A new implementation is a function and one entry
in :data:`IMPLEMENTATIONS` (and in ``olmax.config.AttnImpl``, the choices of ``train.attn_impl``).
``auto`` is resolved by the platform profile (``olmax.platforms``), before the model runs.

Hardware kernels (:data:`NATIVE_BACKEND`) run natively only when the program compiles for their
backend; elsewhere in their portable form: splash in Pallas interpret mode (exact, slow), cuDNN
through its fallback (``chunked``). Either is logged once; the window is never dropped.

Packed sequences: ``segment_ids`` [B, T] (:mod:`olmax.model.documents`) confine every query to
its own document in every implementation (the window then applies inside the document).

Context parallelism: ``xla`` and ``splash`` split each sequence's queries over the context devices,
load-balanced, with halo exchanges for sliding windows (:mod:`olmax.model.attention_cp`).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from olmax.model.attention_cp import SPLIT_IMPLS, context_parallel_attention
from olmax.model.attention_impls import chunked_attention, cudnn_attention, dot_product_attention
from olmax.model.attention_ref import xla_attention
from olmax.model.splash import DEFAULT_BLOCK as SPLASH_BLOCK, splash_attention

# fn(q, k, v, window, scale, segment_ids=None) -> out
AttentionFn = Callable[..., jnp.ndarray]

IMPLEMENTATIONS: dict[str, AttentionFn] = {
    "xla": xla_attention,
    "chunked": chunked_attention,
    "dot_product": dot_product_attention,
    "cudnn": cudnn_attention,
    "splash": splash_attention,
}


# The backend each hardware kernel needs: there it runs natively (``native=True``).
NATIVE_BACKEND = {"splash": "tpu", "cudnn": "gpu"}


def attention(q, k, v, window: int | None, scale: float, impl: str = "xla",
              backend: str | None = None, segment_ids: jnp.ndarray | None = None,
              context: int = 1, head_stride: int | None = None, block: int = SPLASH_BLOCK,
              fused_bwd: bool = False) -> jnp.ndarray:
    """Attention by the implementation ``impl`` in a program compiled by ``backend``;
    ``segment_ids`` [B, T] (None: one document per row) keeps it inside documents.
    ``context`` > 1 (only for :data:`olmax.model.attention_cp.SPLIT_IMPLS`): the sequence is in the
    zig-zag layout over that many context-parallel devices, each computing its own queries;
    ``head_stride``: key heads whose keys and values are gathered at a time (None: all);
    ``block``: splash's query and key block, ``fused_bwd``: its backward in one kernel (other
    implementations ignore both; a context-parallel splash keeps two backward kernels)."""
    try:
        fn = IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(f"unknown attention implementation '{impl}' "
                         f"(known: {', '.join(IMPLEMENTATIONS)})") from None
    if context > 1:
        if impl not in SPLIT_IMPLS:
            raise ValueError(f"attention '{impl}' does not split sequences over context devices "
                             f"(those that do: {', '.join(SPLIT_IMPLS)})")
        if impl == "splash":
            return fn(q, k, v, window, scale, segment_ids, native=backend == NATIVE_BACKEND[impl],
                      context=context, head_stride=head_stride, block_size=block)
        return context_parallel_attention(q, k, v, window, scale, context, segment_ids,
                                          head_stride=head_stride)
    if impl == "splash":
        return fn(q, k, v, window, scale, segment_ids, native=backend == NATIVE_BACKEND[impl],
                  block_size=block, fused_bwd=fused_bwd)
    if impl in NATIVE_BACKEND:
        return fn(q, k, v, window, scale, segment_ids, native=backend == NATIVE_BACKEND[impl])
    return fn(q, k, v, window, scale, segment_ids)
