"""Batched token log-probabilities with the olmax model (shared by perplexity and downstream).

``log p(target | prefix)`` is ``logit[target] - logsumexp(logits)`` with fp32 logits, i.e. the
negative of ``F.cross_entropy`` as OLMo-core and EV compute it. Logits are produced in chunks of
positions so a batch never materialises ``[B, T, vocab]`` at once.

``softmax_vocab`` is how many logits enter the normaliser: the padded vocabulary (OLMo-core: its LM
head has ``padded_vocab_size`` outputs and ``cross_entropy`` sees all of them) or the real vocabulary
(HF ``Olmo3ForCausalLM``, whose head has ``vocab_size`` rows; used for HF directories and for
checkpoints imported from them, which record that their padding rows were never in a softmax:
:mod:`olmax.interop.vocab_padding`). Shapes are bucketed (batch fixed, length a power of two >= 128) so a
run compiles a handful of programs.

On a mesh (``mesh=``, the training run's), the programs are traced with the model's activations
placed as in training (rows over the data-parallel devices, :func:`olmax.parallel.sharding.placed_on`)
and the batch is put row-sharded: without it XLA keeps the hidden states split along the model
dimension as the FSDP-sharded embedding produces them, and every device computes the whole batch's
full-vocabulary logits chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from olmax.config import ModelConfig
from olmax.model import olmo3
from olmax.model.runtime import Runtime
from olmax.parallel.mesh import data_parallel_size
from olmax.parallel.sharding import batch_sharding, placed_on, replicated

MIN_BUCKET = 128


def bucket_length(n: int, max_len: int | None = None, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two >= max(n, minimum), capped at ``max_len`` (but never below n)."""
    b = minimum
    while b < n:
        b *= 2
    return b if max_len is None else min(b, max(max_len, n))


class Scorer:
    """Jitted log-probability functions for one model configuration."""

    def __init__(self, cfg: ModelConfig, runtime: Runtime = Runtime(), *,
                 softmax_vocab: int | None = None, chunk: int = 128, mesh: Mesh | None = None) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.mesh = mesh
        self.softmax_vocab = softmax_vocab or cfg.padded_vocab_size
        if not cfg.vocab_size <= self.softmax_vocab <= cfg.padded_vocab_size:
            raise ValueError(f"softmax_vocab {self.softmax_vocab} outside [{cfg.vocab_size}, "
                             f"{cfg.padded_vocab_size}]")
        self.chunk = chunk
        # results replicated: every process (of a multi-host mesh too) reads them whole
        out = None if mesh is None else replicated(mesh)
        self._targets = jax.jit(self._placed(self._target_logprobs), out_shardings=out)
        self._choices = jax.jit(self._placed(self._choice_logprobs), out_shardings=out)
        self._spans = jax.jit(self._placed(self._span_logprobs), out_shardings=out)

    def _placed(self, fn):
        @functools.wraps(fn)
        def traced(*args):
            with placed_on(self.mesh):
                return fn(*args)
        return traced

    def _rows(self, x: np.ndarray) -> jax.Array:
        """An int32 batch input, split by rows over the mesh's data-parallel devices when they
        divide it (otherwise placed as XLA chooses; the traced constraints still apply)."""
        x = np.asarray(x, np.int32)
        if self.mesh is not None and x.shape[0] % data_parallel_size(self.mesh) == 0:
            return jax.device_put(x, batch_sharding(self.mesh, x.ndim))
        return jnp.asarray(x)

    def _hidden(self, params, tokens):
        return olmo3.hidden_states(params, tokens, self.cfg, self.runtime)

    def _head(self, params):
        w = olmo3.lm_head_weight(params, self.cfg).astype(self.runtime.compute_dtype)
        return w[:, : self.softmax_vocab]

    def _target_logprobs(self, params, tokens, targets):
        """[B, T] log p(targets[b, t] | tokens[b, :t+1])."""
        h = self._hidden(params, tokens)
        w = self._head(params)

        def step(_, xs):
            lse, picked = olmo3.lse_and_target_logits(xs[0], w, xs[1])
            return None, picked - lse

        _, out = jax.lax.scan(step, None, (olmo3.seq_chunks(h, self.chunk),
                                           olmo3.seq_chunks(targets, self.chunk)))
        return out.swapaxes(0, 1).reshape(tokens.shape)

    def _choice_logprobs(self, params, tokens, positions, choices):
        """[B, K] log p(choices[b, k] | tokens[b, :positions[b]+1]) (fast MC)."""
        h = self._hidden(params, tokens)
        hp = jnp.take_along_axis(h, positions[:, None, None], axis=1)[:, 0]
        logits = olmo3.logits_from_hidden(hp, self._head(params))
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, jnp.maximum(choices, 0), axis=-1)

    def _span_logprobs(self, params, tokens, starts, targets):
        """[B, K] log p(targets[b, k] | tokens[b, :starts[b]+k+1]): the LM head only at the K
        positions of each row's span (a continuation), not at every position."""
        h = self._hidden(params, tokens)
        k = targets.shape[1]
        pos = jnp.minimum(starts[:, None] + jnp.arange(k)[None, :], tokens.shape[1] - 1)
        hs = jnp.take_along_axis(h, pos[..., None], axis=1)
        lse, picked = olmo3.lse_and_target_logits(hs, self._head(params), targets)
        return picked - lse

    def span_logprobs(self, params, tokens: np.ndarray, starts: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """Host wrapper of the span scorer: tokens [B, T], starts [B], targets [B, K] -> [B, K]."""
        return np.asarray(self._spans(params, self._rows(tokens), self._rows(starts), self._rows(targets)))

    def target_logprobs(self, params, tokens: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """Host wrapper: int arrays [B, T] -> float32 [B, T]."""
        return np.asarray(self._targets(params, self._rows(tokens), self._rows(targets)))

    def choice_logprobs(self, params, tokens: np.ndarray, positions: np.ndarray,
                        choices: np.ndarray) -> np.ndarray:
        return np.asarray(self._choices(params, self._rows(tokens), self._rows(positions),
                                        self._rows(choices)))
