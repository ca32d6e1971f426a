"""Vocabulary padding rows: how they start and whether they take part in the softmax.

olmax (like OLMo-core) pads the vocabulary to ``padded_vocab_size``, a multiple of 128: rows
``[vocab_size, padded_vocab_size)`` of ``embed`` and ``lm_head`` stand for no token. A Hugging Face
``Olmo3ForCausalLM`` has no such rows, so importing one adds them, and two things follow.

**How they start.** OLMo-core's HF loader (``olmo_core.nn.hf.checkpoint.load_hf_model``) calls
transformers' ``resize_token_embeddings(padded_vocab_size)``, whose ``mean_resizing`` gives every
new row of the embedding, and separately of the LM head, the mean of the existing rows plus a draw
from ``N(0, 1e-9 * Sigma)``, Sigma being their covariance (``Xc^T Xc / n`` of the centred rows); when
``1e-9 * Sigma`` is not positive definite (Cholesky fails), the mean alone. Everything is computed in
float32 and the rows are then rounded to the weights' dtype. :func:`mean_resized_rows` is that
computation, so ``init.hf_dir`` and ``olmax convert hf-to-olmax`` start from the model OLMo-core
starts from. The one part that cannot be the same is the draw itself: transformers takes it from
torch's global random state at load time, which no other program can reproduce; olmax draws the
standard-normal vectors from a fixed seed (:data:`NOISE_SEED`; embedding and head separately), so
an import is a pure function of the HF directory. The draw moves each padding row by about
``3e-5`` of the rows' spread (``sqrt(1e-9)``).

**Whether they enter the softmax.** A model trained with padded rows (OLMo-core, olmax) has them
in every softmax, as training had. An imported HF model never had them: evaluating it over the
padded vocabulary would add ``padded - vocab`` logits to every normaliser and change every number.
So checkpoints record it (meta ``vocab_padding``: ``{"rows": [vocab, padded], "in_softmax": bool,
"init": ...}``): ``false`` for an import, ``true`` for training checkpoints. ``olmax eval`` keeps
the rows out of the softmax where the source had none, so an HF directory and its imported
checkpoint give identical numbers. Checkpoints written before this record existed are read by
their ``source``: an HF import has the rows out, anything else in.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from olmax.config import ModelConfig

EPSILON = 1e-9          # transformers' covariance scale
NOISE_SEED = 0
BLOCK_BYTES = 8 << 20
META_KEY = "vocab_padding"

RowReader = Callable[[int, int], np.ndarray]     # rows [a, b) of a [n, d] matrix, any float dtype


def _moments(read: RowReader, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 mean and covariance (``Xc^T Xc / n``) of ``n`` rows, read in blocks of at most
    ``BLOCK_BYTES`` (a streaming import holds one block); sums are carried in float64 so the
    result is within float32 rounding of transformers' own."""
    rows = max(1, BLOCK_BYTES // (4 * d))
    total = np.zeros(d, np.float64)
    for a in range(0, n, rows):
        total += np.asarray(read(a, min(n, a + rows)), np.float32).sum(axis=0, dtype=np.float64)
    mean = (total / n).astype(np.float32)
    cov = np.zeros((d, d), np.float64)
    product = np.empty((d, d), np.float32)
    for a in range(0, n, rows):
        xc = np.array(read(a, min(n, a + rows)), np.float32)
        xc -= mean
        cov += np.matmul(xc.T, xc, out=product)
        del xc
    return mean, (cov / n).astype(np.float32)


def mean_resized_rows(read: RowReader, n: int, d: int, added: int, *, noise: np.ndarray | None = None,
                      seed: int = NOISE_SEED) -> np.ndarray:
    """The ``added`` float32 rows transformers' ``mean_resizing`` appends to an ``[n, d]`` matrix.

    ``noise``: the ``[added, d]`` standard-normal draws (default: from ``seed``); the rows are
    ``mean + L @ noise[i]`` with ``L`` the Cholesky factor of ``1e-9 * Sigma``, or ``mean``."""
    if added <= 0:
        return np.zeros((0, d), np.float32)
    with np.errstate(all="ignore"):      # non-finite weights are refused by name elsewhere
        mean, cov = _moments(read, n, d)
    scaled = (np.float32(EPSILON) * cov).astype(np.float32)
    try:
        chol = np.linalg.cholesky(scaled)
    except np.linalg.LinAlgError:
        return np.repeat(mean[None, :], added, axis=0)
    if not np.all(np.isfinite(chol)):
        return np.repeat(mean[None, :], added, axis=0)
    if noise is None:
        noise = np.random.default_rng(seed).standard_normal((added, d), dtype=np.float32)
    with np.errstate(all="ignore"):
        return (mean[None, :] + noise.astype(np.float32) @ chol.T).astype(np.float32)


def padding_rows(read: RowReader, n: int, d: int, padded: int, stored_dtype: Any, *,
                 which: str) -> np.ndarray:
    """Rows ``[n, padded)`` of the embedding (``which="embed"``) or the LM head (``"lm_head"``,
    HF layout ``[vocab, d]``) for an HF import, rounded to the stored dtype as transformers does."""
    seed = NOISE_SEED + (0 if which == "embed" else 1)
    rows = mean_resized_rows(read, n, d, padded - n, seed=seed)
    return rows.astype(np.dtype(stored_dtype)).astype(np.float32)


def record(cfg: ModelConfig, *, in_softmax: bool, init: str) -> dict:
    """The ``vocab_padding`` meta entry of a checkpoint."""
    return {"rows": [cfg.vocab_size, cfg.padded_vocab_size], "in_softmax": bool(in_softmax),
            "init": init}


IMPORTED = "hf mean-resized (transformers resize_token_embeddings, as OLMo-core loads HF weights)"
TRAINED = "trained in the softmax"


def softmax_vocab(meta: Mapping[str, Any], cfg: ModelConfig) -> int:
    """How many logits of a checkpoint's model enter a softmax (see the module docstring)."""
    entry = meta.get(META_KEY)
    if isinstance(entry, Mapping) and "in_softmax" in entry:
        return cfg.padded_vocab_size if entry["in_softmax"] else cfg.vocab_size
    source = meta.get("source")
    if isinstance(source, Mapping) and source.get("format") == "hf":
        return cfg.vocab_size
    return cfg.padded_vocab_size


__all__ = ["mean_resized_rows", "padding_rows", "record", "softmax_vocab", "META_KEY", "IMPORTED",
           "TRAINED", "NOISE_SEED", "EPSILON"]
