"""The training loss, exactly as OLMo-core computes it.

References: ``data/utils.py: get_labels``, ``nn/functional/cross_entropy_loss.py``,
``nn/lm_head.py`` and ``train/train_module/transformer/train_module.py: train_batch``.

- Labels are the input ids with ignored positions set to ``IGNORE_INDEX`` (where ``label_mask`` is
  False, or the whole row where ``instance_mask`` is False), shifted left by one with the last
  position ignored: a row of T tokens has T-1 scored labels.
- Per scored position: ``ce = logsumexp(logits) - logits[label]`` and
  ``z = z_loss_multiplier * logsumexp(logits)^2``, over all *padded*-vocabulary logits in fp32.
- Sums over the batch are divided by the batch's number of scored labels, plus T for every
  instance the repetition filter masked (OLMo-core adds ``(~instance_mask).sum() * labels.shape[1]``
  back "so that each rank contributes fairly": masked instances count as zero-loss tokens).
- Gradient accumulation: every micro-batch's sums are divided by the count of the *whole* batch, so
  accumulating micro-batch gradients gives exactly the full-batch gradient. OLMo-core normalises per
  data-parallel rank and then averages the ranks' gradients; with fixed-length data every rank has
  the same count and the two agree. olmax always uses the global count.

The LM head and the loss are one fused, chunked computation (:func:`lm_loss`): the sequence is cut
into chunks, and for each chunk the forward pass computes the fp32 logits, the sums *and* the
gradient of ``ce + z`` with respect to the logits, ``(1 + 2 z_loss_multiplier lse) softmax -
onehot(label)`` (0 on unscored rows), which it immediately contracts into the chunk's gradient of the
hidden states and adds to the head's gradient. Neither pass holds more than one chunk of logits, the
logits are computed once per step (not recomputed in the backward pass), and the backward pass only
scales the stored gradients by the incoming cotangent. Under ``compute_dtype=bfloat16`` the
logits' gradient is rounded to bf16 for the two backward GEMMs (fp32 accumulation), as a bf16
autocast backward does; the head's gradient accumulates in fp32 (by the runtime's kernel set's
``contract_rows``). How many positions a chunk holds is the platform profile's rule
(``olmax.platforms.Profile.loss_chunk``).

On a mesh a chunk's rows stay where the model left them (split over the data-parallel devices and,
under context parallelism, over ``context``): every device computes the logits of its own rows
only, and adds its rows' products to a head-gradient partial of its own; the partials are summed
once, after the last chunk. No logits or logit gradients move between devices.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from olmax.config import ModelConfig
from olmax.model.kernels import KERNELS, Kernels
from olmax.model.logical import constrain, parts
from olmax.model.olmo3 import HIDDEN, hidden_states, lm_head_weight, seq_chunks, seq_unchunks
from olmax.model.runtime import Runtime

IGNORE_INDEX = -100

class LossSums(NamedTuple):
    """Unnormalised sums over scored positions (fp32)."""

    ce: jax.Array       # sum of cross-entropy
    z: jax.Array        # sum of z_loss_multiplier * logsumexp^2


def make_labels(tokens: jax.Array, instance_mask: jax.Array | None = None,
                label_mask: jax.Array | None = None) -> jax.Array:
    """OLMo-core ``get_labels``: int32 [B, T] labels, ``IGNORE_INDEX`` where not scored."""
    labels = tokens.astype(jnp.int32)
    if label_mask is not None:
        labels = jnp.where(label_mask, labels, IGNORE_INDEX)
    if instance_mask is not None:
        labels = jnp.where(instance_mask[:, None], labels, IGNORE_INDEX)
    pad = jnp.full((labels.shape[0], 1), IGNORE_INDEX, jnp.int32)
    return jnp.concatenate([labels[:, 1:], pad], axis=1)


def loss_denominator(labels: jax.Array, instance_mask: jax.Array | None = None) -> jax.Array:
    """Scored labels in the batch, plus ``T`` per masked instance (OLMo-core ``train_batch``)."""
    n = jnp.sum(labels != IGNORE_INDEX).astype(jnp.float32)
    if instance_mask is not None:
        n = n + jnp.sum(~instance_mask).astype(jnp.float32) * labels.shape[1]
    return n


# One chunk's positions as rows: [N, D] hidden states and [N, V] logits, N = B x c (batch-major, so
# the rows stay split like the batch, and under context parallelism like the positions too).
_ROWS = ("rows", "act_embed")
_ROW_LOGITS = ("rows", "act_vocab")
# The same rows in one part per device ([P, N / P, ...]) and the head gradient's per-device partial
# sums [P, D, V]: each device adds its own rows' products to its own partial over the chunks, and
# the parts are summed once after the last chunk, into the head's own sharding. A
# [D, V] accumulator sharded like the head would instead make every chunk gather all devices'
# logit gradients (or reduce a full-size product) to form each device's columns.
_PART_ROWS = ("rows", None, "act_embed")
_PART_LOGITS = ("rows", None, "act_vocab")
_PARTIAL = ("rows", "act_embed", "act_vocab")
_HEAD = ("embed", "vocab")


def _chunk_sums(x: jax.Array, w: jax.Array, labels: jax.Array):
    """One chunk of rows ``x`` [N, D]: the fp32 logits, ``e = exp(logits - max)``, ``s = sum(e)``,
    the logsumexp ``max + log(s)`` (``jax.nn.logsumexp``'s formula) and the CE / z sums.

    ``e`` is computed once and reused by the gradient (:func:`_logits_grad`): on XLA's CPU backend an
    exponential inside a reduction is several times slower than in an element-wise pass. The target
    logit is the row's dot product with its label's head column (the same fp32-accumulated products
    as the GEMM's, summed in another order), not a read of the logits, so ``e``'s pass is the
    logits' last use: XLA writes ``e`` over the logits and the gradient over ``e``, and one
    chunk-sized buffer is live instead of three."""
    logits = constrain(jnp.einsum("nd,dv->nv", x, w, preferred_element_type=jnp.float32), _ROW_LOGITS)
    scored = labels != IGNORE_INDEX
    safe = jnp.where(scored, labels, 0)
    target = jnp.einsum("nd,dn->n", x, jnp.take(w, safe, axis=1), preferred_element_type=jnp.float32)
    m = jnp.max(logits, axis=-1)
    e = jnp.exp(logits - m[:, None])
    s = jnp.sum(e, axis=-1)
    lse = m + jnp.log(s)
    ce = jnp.sum(jnp.where(scored, lse - target, 0.0))
    z = jnp.sum(jnp.where(scored, jnp.square(lse), 0.0))
    return e, s, lse, scored, safe, ce, z


def _logits_grad(e, s, lse, scored, safe, z_loss_multiplier: float, dtype) -> jax.Array:
    """d(ce + z_loss_multiplier * lse^2)/d logits, per row: ``(1 + 2 zm lse) softmax - onehot(label)``
    with ``softmax = e / s``, 0 where the row is not scored; one element-wise pass, in ``dtype``."""
    r = jnp.where(scored, (1.0 + 2.0 * z_loss_multiplier * lse) / s, 0.0)[:, None]
    hit = (jax.lax.broadcasted_iota(jnp.int32, e.shape, 1) == safe[:, None]) & scored[:, None]
    p = e * r
    return constrain(jnp.where(hit, p - 1.0, p).astype(dtype), _ROW_LOGITS)


def _scan_loss(h, w, labels, z_loss_multiplier: float, chunk_size: int, kernels: Kernels,
               with_grads: bool, seq_shards: int = 1):
    b, t, d = h.shape
    wc = w.astype(h.dtype)
    zero = jnp.zeros((), jnp.float32)
    h_chunks = seq_chunks(h, chunk_size, seq_shards)
    n_parts = parts("rows", b * h_chunks.shape[2])

    def head_grad(h_i, x, g):
        if n_parts == 1:
            return kernels.contract_rows(h_i, g)
        xp = constrain(x.reshape(n_parts, -1, d), _PART_ROWS)
        gp = constrain(g.reshape(n_parts, -1, g.shape[-1]), _PART_LOGITS)
        return constrain(jax.vmap(kernels.contract_rows)(xp, gp), _PARTIAL)

    def body(carry, xs):
        h_i, l_i = xs
        c = h_i.shape[1]
        h_i = constrain(h_i, HIDDEN)
        x = constrain(h_i.reshape(b * c, d), _ROWS)
        e, s, lse, scored, safe, ce, z = _chunk_sums(x, wc, l_i.reshape(b * c))
        sums = (carry[0] + ce, carry[1] + z)
        if not with_grads:
            return sums, None
        g = _logits_grad(e, s, lse, scored, safe, z_loss_multiplier, wc.dtype)
        dh = jnp.einsum("nv,dv->nd", g, wc, preferred_element_type=jnp.float32).astype(h.dtype)
        return sums + (carry[2] + head_grad(h_i, x, g),), constrain(dh.reshape(b, c, d), HIDDEN)

    dw0 = jnp.zeros(w.shape, jnp.float32)
    if n_parts > 1:
        dw0 = constrain(jnp.zeros((n_parts,) + w.shape, jnp.float32), _PARTIAL)
    init = (zero, zero) + ((dw0,) if with_grads else ())
    carry, dh = jax.lax.scan(body, init, (h_chunks, seq_chunks(labels, chunk_size, seq_shards)))
    sums = LossSums(carry[0], z_loss_multiplier * carry[1])
    if not with_grads:
        return sums
    dw = carry[2] if n_parts == 1 else constrain(jnp.sum(carry[2], axis=0), _HEAD)
    return sums, constrain(seq_unchunks(dh, seq_shards), HIDDEN), dw


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused_loss(h, w, labels, z_loss_multiplier, chunk_size, kernels, seq_shards):
    sums = _scan_loss(h, w, labels, z_loss_multiplier, chunk_size, kernels, with_grads=False,
                      seq_shards=seq_shards)
    return sums.ce + sums.z, sums


def _fused_loss_fwd(h, w, labels, z_loss_multiplier, chunk_size, kernels, seq_shards):
    sums, dh, dw = _scan_loss(h.value, w.value, labels.value, z_loss_multiplier, chunk_size, kernels,
                              with_grads=True, seq_shards=seq_shards)
    return (sums.ce + sums.z, sums), (dh, dw)


def _fused_loss_bwd(z_loss_multiplier, chunk_size, kernels, seq_shards, res, cotangents):
    del z_loss_multiplier, chunk_size, kernels, seq_shards
    dh, dw = res
    g_total, g_sums = cotangents
    if not all(isinstance(x, SymbolicZero) for x in jax.tree.leaves(
            g_sums, is_leaf=lambda x: isinstance(x, SymbolicZero))):
        raise ValueError("lm_loss: the CE and z-loss sums are statistics without a gradient; "
                         "differentiate the total (the first output)")
    if isinstance(g_total, SymbolicZero):
        return jnp.zeros_like(dh), jnp.zeros_like(dw), None
    g = g_total.astype(jnp.float32)
    return (dh.astype(jnp.float32) * g).astype(dh.dtype), dw * g, None


_fused_loss.defvjp(_fused_loss_fwd, _fused_loss_bwd, symbolic_zeros=True)


def lm_loss(h: jax.Array, w: jax.Array, labels: jax.Array, *, z_loss_multiplier: float,
            chunk_size: int = 1024, kernels: Kernels = KERNELS["reference"],
            seq_shards: int = 1) -> tuple[jax.Array, LossSums]:
    """``(ce_sum + z_sum, LossSums)`` of final hidden states ``h`` [B, T, D] under the head ``w``
    [D, V] (cast to ``h``'s dtype for the GEMMs); the total is differentiable with respect to ``h``
    and ``w`` (the head's gradient in ``w``'s dtype, accumulated in fp32), the sums are statistics.

    Fused and chunked (see the module docstring): chunks of (at most) ``chunk_size`` positions, so
    at most ``B * chunk_size * V`` fp32 logits are live, in the forward pass only. ``kernels``:
    the kernel set whose ``contract_rows`` forms the head's gradient. ``seq_shards``: the devices
    each sequence is split over (context parallelism): each chunk takes ``chunk_size`` positions
    from every device's block (:func:`olmax.model.olmo3.seq_chunks`).
    """
    return _fused_loss(h, w, labels, float(z_loss_multiplier), int(chunk_size), kernels,
                       int(seq_shards))


def lm_loss_sums(h: jax.Array, w: jax.Array, labels: jax.Array, *, z_loss_multiplier: float,
                 chunk_size: int = 1024, kernels: Kernels = KERNELS["reference"]) -> LossSums:
    """CE and z-loss sums of final hidden states ``h`` [B, T, D] under the head ``w`` [D, V]."""
    return lm_loss(h, w, labels, z_loss_multiplier=z_loss_multiplier, chunk_size=chunk_size,
                   kernels=kernels)[1]


def loss_and_sums(params, tokens: jax.Array, labels: jax.Array, denominator: jax.Array,
                  cfg: ModelConfig, runtime: Runtime = Runtime(), *, z_loss_multiplier: float,
                  chunk_size: int = 1024, segment_ids: jax.Array | None = None,
                  seq_shards: int = 1, positions=None) -> tuple[jax.Array, LossSums]:
    """``(ce_sum + z_sum) / denominator`` for one (micro-)batch, and the sums; differentiable.
    ``segment_ids`` [B, T] (packed documents, :mod:`olmax.model.documents`) go to the model; the
    labels are the same with or without them (OLMo-core scores across document boundaries).
    ``seq_shards``: the devices each sequence is split over (context parallelism). ``positions``
    (None: from the segment ids, or 0..T-1): the RoPE positions, e.g. of a permuted sequence."""
    h = hidden_states(params, tokens, cfg, runtime, segment_ids=segment_ids, positions=positions)
    total, sums = lm_loss(h, lm_head_weight(params, cfg), labels, z_loss_multiplier=z_loss_multiplier,
                          chunk_size=chunk_size, kernels=runtime.kernels, seq_shards=seq_shards)
    return total / denominator, sums
