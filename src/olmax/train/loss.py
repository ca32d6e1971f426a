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

The logits are produced chunk by chunk along the sequence under ``jax.checkpoint`` so that neither
the forward nor the backward pass holds the full ``[B, T, 100352]`` fp32 logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmax.config import ModelConfig
from olmax.model.logical import constrain
from olmax.model.olmo3 import HIDDEN, hidden_states, lm_head_weight, lse_and_target_logits, seq_chunks
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


def lm_loss_sums(h: jax.Array, w: jax.Array, labels: jax.Array, *, z_loss_multiplier: float,
                 chunk_size: int = 1024) -> LossSums:
    """CE and z-loss sums of final hidden states ``h`` [B, T, D] under the head ``w`` [D, V].

    The sequence is processed in chunks of (at most) ``chunk_size`` positions, each recomputed in
    the backward pass, bounding live logits to ``B * chunk_size * V`` floats.
    """
    hc = seq_chunks(h, chunk_size)                     # [n, B, c, D]
    lc = seq_chunks(labels, chunk_size)                # [n, B, c]

    @jax.checkpoint
    def chunk(h_i, l_i):
        scored = l_i != IGNORE_INDEX
        lse, target = lse_and_target_logits(constrain(h_i, HIDDEN), w, jnp.where(scored, l_i, 0))
        ce = jnp.sum(jnp.where(scored, lse - target, 0.0))
        z = jnp.sum(jnp.where(scored, jnp.square(lse), 0.0))
        return ce, z

    def body(carry, xs):
        ce, z = chunk(*xs)
        return (carry[0] + ce, carry[1] + z), None

    zero = jnp.zeros((), jnp.float32)
    (ce, z), _ = jax.lax.scan(body, (zero, zero), (hc, lc))
    return LossSums(ce, z_loss_multiplier * z)


def loss_and_sums(params, tokens: jax.Array, labels: jax.Array, denominator: jax.Array,
                  cfg: ModelConfig, runtime: Runtime = Runtime(), *, z_loss_multiplier: float,
                  chunk_size: int = 1024) -> tuple[jax.Array, LossSums]:
    """``(ce_sum + z_sum) / denominator`` for one (micro-)batch, and the sums; differentiable."""
    h = hidden_states(params, tokens, cfg, runtime)
    w = lm_head_weight(params, cfg).astype(runtime.compute_dtype)
    sums = lm_loss_sums(h, w, labels, z_loss_multiplier=z_loss_multiplier, chunk_size=chunk_size)
    return (sums.ce + sums.z) / denominator, sums
