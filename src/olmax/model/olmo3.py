"""The OLMo 3 decoder in pure JAX: parameters are a pytree of arrays, the model is functions.

Forward pass (OLMo-core ``ReorderedNormTransformerBlock``; HF ``Olmo3DecoderLayer``)::

    h = embed[tokens]
    for each layer:                       # reordered post-norm
        h = h + attn_norm(attention(h))   # no pre-norm: the norm is on the sub-layer OUTPUT
        h = h + mlp_norm(swiglu(h))
    logits = final_norm(h) @ lm_head      # fp32 logits over the padded vocabulary

Attention: q = q_norm(x Wq), k = k_norm(x Wk) over the full projected width (``qk_norm="full"``)
before the head split; RoPE (fp32) on q and k; causal softmax(q k^T / sqrt(head_dim)) in fp32 with
the layer's sliding window; output projection. MLP: ``down(silu(gate(x)) * up(x))``.

Numerics follow OLMo-core under bf16 mixed precision: parameters are cast to the compute dtype,
every matmul accumulates in fp32 and rounds to the compute dtype, RMSNorm runs in fp32 including
the weight multiply, RoPE and softmax run in fp32, logits are fp32.

The parameters (shapes, logical axes, initialisation, HF names) are declared in
:mod:`olmax.model.params`; how the functions run (compute dtype, attention kernel, remat) is one
:class:`~olmax.model.runtime.Runtime` value. Layers are stacked along a leading ``layers`` axis.
The window pattern (period P) is scanned as groups of P layers with ``jax.lax.scan``, so compile
time does not grow with depth (unless the platform profile unrolls it, as the CPU's does) and every
layer inside a group has a static window (what block-sparse attention kernels need). Dense layers
and norms come from the runtime's kernel set (:mod:`olmax.model.kernels`); this module never asks
which device it runs on.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from olmax.config import ModelConfig
from olmax.model.attention import attention
from olmax.model.documents import positions_in_documents
from olmax.model.kernels import Kernels
from olmax.model.logical import constrain
from olmax.model.rope import apply_rope, rope_tables
from olmax.model.runtime import REMAT_POLICIES, Runtime

Params = dict[str, Any]

# Logical axes of the activations (see ``olmax.model.logical``): the batch stays split over the
# data-parallel devices everywhere, heads / MLP / vocabulary follow the ``tensor`` axis.
HIDDEN = ("batch", "seq", "act_embed")
Q_HEADS = ("batch", "seq", "act_heads", "head_dim")
KV_HEADS = ("batch", "seq", "act_kv_heads", "head_dim")
MLP = ("batch", "seq", "act_mlp")
LOGITS = ("batch", "seq", "act_vocab")
# The embedding and LM-head weights where they are used: whole along the model dimension (FSDP
# gathers them, as it gathers every weight) and split along the vocabulary only by ``tensor``. The
# lookup then runs on each device's own rows; leaving the choice to the partitioner can gather the
# token ids of the whole global batch instead (or replicate the activations under tensor parallelism).
EMBED_TABLE = ("vocab", "act_embed")
HEAD_WEIGHT = ("act_embed", "act_vocab")

# ----------------------------------------------------------------------------------------------
# Building blocks


def _attention_block(p: Params, x: jnp.ndarray, cfg: ModelConfig, window: int | None,
                     sin: jnp.ndarray, cos: jnp.ndarray, rt: Runtime,
                     segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
    dense, rms_norm = rt.kernels.dense, rt.kernels.rms_norm
    b, t, _ = x.shape
    q = checkpoint_name(dense(x, p["q_proj"]), "q_proj")
    k = checkpoint_name(dense(x, p["k_proj"]), "k_proj")
    v = checkpoint_name(dense(x, p["v_proj"]), "v_proj")
    if cfg.qk_norm == "full":
        q = rms_norm(q, p["q_norm"], cfg.norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.norm_eps)
    q = constrain(q.reshape(b, t, cfg.n_heads, cfg.head_dim), Q_HEADS)
    k = constrain(k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), KV_HEADS)
    v = constrain(v.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), KV_HEADS)
    if cfg.qk_norm == "head":
        q = rms_norm(q, p["q_norm"], cfg.norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.norm_eps)
    q = constrain(apply_rope(q, sin, cos), Q_HEADS)
    k = constrain(apply_rope(k, sin, cos), KV_HEADS)
    o = constrain(attention(q, k, v, window, cfg.head_dim ** -0.5, impl=rt.attn_impl, backend=rt.backend,
                            segment_ids=segment_ids, context=rt.context,
                            head_stride=rt.context_head_stride, block=rt.splash_block,
                            fused_bwd=rt.splash_fused_bwd), Q_HEADS)
    return constrain(dense(o.reshape(b, t, cfg.q_dim), p["o_proj"]), HIDDEN)


def _mlp_block(p: Params, x: jnp.ndarray, kernels: Kernels) -> jnp.ndarray:
    dense = kernels.dense
    gate = checkpoint_name(constrain(dense(x, p["gate_proj"]), MLP), "mlp_gate")
    up = checkpoint_name(constrain(dense(x, p["up_proj"]), MLP), "mlp_up")
    return constrain(dense(jax.nn.silu(gate) * up, p["down_proj"]), HIDDEN)


def _layer(p: Params, h: jnp.ndarray, cfg: ModelConfig, window: int | None, sin, cos,
           rt: Runtime, segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
    eps = cfg.norm_eps
    name = checkpoint_name
    rms_norm = rt.kernels.rms_norm
    h = constrain(h, HIDDEN)
    if cfg.block_type == "reordered_norm":
        a = name(_attention_block(p, h, cfg, window, sin, cos, rt, segment_ids), "attn_out")
        h = h + rms_norm(a, p["attn_norm"], eps)
        m = name(_mlp_block(p, h, rt.kernels), "mlp_out")
        return h + rms_norm(m, p["mlp_norm"], eps)
    a = name(_attention_block(p, rms_norm(h, p["attn_norm"], eps), cfg, window, sin, cos, rt, segment_ids),
             "attn_out")
    h = h + a
    m = name(_mlp_block(p, rms_norm(h, p["mlp_norm"], eps), rt.kernels), "mlp_out")
    return h + m


# ----------------------------------------------------------------------------------------------
# Forward


def hidden_states(params: Params, tokens: jnp.ndarray, cfg: ModelConfig, runtime: Runtime = Runtime(),
                  *, positions: jnp.ndarray | None = None,
                  segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
    """Final-normed hidden states [B, T, D] in ``runtime.compute_dtype``.

    ``segment_ids`` [B, T] (packed sequences, :mod:`olmax.model.documents`): attention stays
    inside each document and, unless ``positions`` are given, RoPE positions restart at 0 in
    every document -- as OLMo-core does with ``doc_lens``. None: one document per row."""
    dtype = runtime.compute_dtype
    cast = partial(jax.tree.map, lambda x: x.astype(dtype))
    # The weights in the compute dtype: all cast up front, or (``runtime.cast_in_layer``) each
    # layer's inside the layer loop -- its norm weights there, its matrices by the dense layer
    # that multiplies them (which then gives their gradients in fp32).
    params = ({k: v if k == "layers" else cast(v) for k, v in params.items()}
              if runtime.cast_in_layer else cast(params))
    layer_weights = ((lambda lp: {k: v if v.ndim >= 2 else v.astype(dtype) for k, v in lp.items()})
                     if runtime.cast_in_layer else (lambda lp: lp))
    b, t = tokens.shape
    if segment_ids is not None:
        segment_ids = constrain(segment_ids.astype(jnp.int32), HIDDEN[:2])
        if positions is None:
            positions = positions_in_documents(segment_ids)
    # The profile may ask for the tables of the plain 0..T-1 positions as constants computed when
    # the program is traced (the CPU's: XLA's CPU backend would otherwise evaluate sin/cos inside
    # every fused consumer, per element of each rotation and its gradient).
    static = (positions is None or isinstance(positions, np.ndarray)) and runtime.rope_tables_at_trace
    with jax.ensure_compile_time_eval() if static else contextlib.nullcontext():
        if positions is None:
            positions = jnp.arange(t)
        sin_l, cos_l = rope_tables(positions, cfg.head_dim, cfg.rope_theta,
                                   None if (cfg.rope_scaling and cfg.rope_scaling.full_attention_only)
                                   else cfg.rope_scaling)
        sin_g, cos_g = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    h = constrain(jnp.take(constrain(params["embed"], EMBED_TABLE), tokens, axis=0), HIDDEN)
    period = len(cfg.window_pattern)
    groups = cfg.n_layers // period

    layer_fns = []
    for window in cfg.window_pattern:
        sin, cos = (sin_g, cos_g) if window is None else (sin_l, cos_l)
        fn = partial(_layer, cfg=cfg, window=window, sin=sin, cos=cos, rt=runtime,
                     segment_ids=segment_ids)
        if runtime.remat != "none":
            fn = jax.checkpoint(fn, policy=REMAT_POLICIES[runtime.remat])
        layer_fns.append(fn)

    def group(h, gp):
        # Each layer's weights split off the group's stack (not indexed): the backward pass then
        # writes the layers' weight gradients side by side into the stack's gradient, where an
        # index's is a zero-padded copy of the stack per layer, summed (on TPU: 12 GB more per
        # 8-layer group, which XLA does not always turn back into a concatenation).
        leaves, treedef = jax.tree.flatten(gp)
        pieces = [jax.lax.split(x, (1,) * period) for x in leaves]
        for j, fn in enumerate(layer_fns):
            lp = jax.tree.unflatten(treedef, [jax.lax.squeeze(p[j], (0,)) for p in pieces])
            h = fn(layer_weights(lp), h)
        return h, None

    if isinstance(params["layers"], (tuple, list)):
        # The layers' weights one by one (the training step's per-layer gradient accumulation):
        # straight-line code, and each layer's weight gradients come out in buffers of their own.
        for i, lp in enumerate(params["layers"]):
            h = layer_fns[i % period](layer_weights(lp), h)
    else:
        stacked = jax.tree.map(lambda x: x.reshape(groups, period, *x.shape[1:]), params["layers"])
        # Unrolled where the profile asks (the CPU's and the TPU's: a scanned loop stacks every
        # layer's residuals with dynamic-update-slice and reads them back, copies on XLA's CPU
        # backend, 12 % of a v5e step); elsewhere one compiled body, whatever the depth.
        h, _ = jax.lax.scan(group, h, stacked, unroll=True if runtime.unroll_layers else 1)
    return constrain(runtime.kernels.rms_norm(h, params["final_norm"], cfg.norm_eps), HIDDEN)


def lm_head_weight(params: Params, cfg: ModelConfig) -> jnp.ndarray:
    """[D, padded_vocab] output projection (the transposed embedding when tied)."""
    return constrain(params["embed"].T if cfg.tie_embeddings else params["lm_head"], HEAD_WEIGHT)


def logits_from_hidden(h: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """fp32 logits: the head matmul accumulates in fp32 and is not rounded to the compute dtype."""
    logits = jnp.einsum("...d,dv->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, LOGITS) if logits.ndim == 3 else logits


def lse_and_target_logits(h: jnp.ndarray, w: jnp.ndarray,
                          targets: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """For hidden states ``h`` [..., D] under the head ``w``: the fp32 logsumexp of the logits and
    the logit of each target id in ``[0, V)`` (``log p(target) = target_logit - lse``)."""
    logits = logits_from_hidden(h, w)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # The target's logit as a masked sum (exact: one term, the others exactly 0). Its gradient is
    # then an elementwise select that fuses with the softmax gradient; a gather's would be a
    # scatter into a zeroed fp32 [..., V] buffer of its own.
    hit = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1) == targets[..., None]
    return lse, jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)


def seq_chunks(x: jnp.ndarray, chunk_size: int, shards: int = 1) -> jnp.ndarray:
    """``x`` [B, T, ...] as [n, B, c, ...]: the sequence in chunks of c positions, c the largest
    divisor of T that is at most ``chunk_size``. Scanning over the n chunks bounds the live logits
    of the LM head to ``B * c * V`` (the loss and the evaluation scorer both do).

    ``shards`` > 1 (context parallelism: T split into that many contiguous blocks, one per device):
    chunk k holds the k-th run of c' positions of every block (c = shards * c', c' the largest
    divisor of T / shards at most ``chunk_size``), so that every device scans its own positions."""
    b, t = x.shape[:2]
    tb = t // shards
    c = max(1, min(tb, chunk_size))
    while tb % c:
        c -= 1
    if shards == 1:
        return x.reshape(b, t // c, c, *x.shape[2:]).swapaxes(0, 1)
    y = jnp.moveaxis(x.reshape(b, shards, tb // c, c, *x.shape[2:]), 2, 0)
    return y.reshape(tb // c, b, shards * c, *x.shape[2:])


def seq_unchunks(y: jnp.ndarray, shards: int = 1) -> jnp.ndarray:
    """The inverse of :func:`seq_chunks`: [n, B, c, ...] -> [B, n * c, ...]."""
    n, b, c = y.shape[:3]
    if shards == 1:
        return y.swapaxes(0, 1).reshape(b, n * c, *y.shape[3:])
    z = jnp.moveaxis(y.reshape(n, b, shards, c // shards, *y.shape[3:]), 0, 2)
    return z.reshape(b, n * c, *y.shape[3:])


def forward(params: Params, tokens: jnp.ndarray, cfg: ModelConfig, runtime: Runtime = Runtime(), *,
            positions: jnp.ndarray | None = None, segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
    """Logits [B, T, padded_vocab] in fp32 (``segment_ids``: see :func:`hidden_states`)."""
    h = hidden_states(params, tokens, cfg, runtime, positions=positions, segment_ids=segment_ids)
    return logits_from_hidden(h, lm_head_weight(params, cfg))
