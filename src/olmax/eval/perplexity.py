"""Held-out perplexity in OLMo-core's padded form (``eval/lm_evaluator.py: LMEvaluator``).

Data: one instance per document, truncated to ``seq_len`` and right-padded, with a ``label_mask``
that is True on the document's tokens (``olmax.data.heldout.padded_instances``, OLMo-core
``NumpyPaddedFSLDataset``).

Loss per position (OLMo-core ``data/utils.py: get_labels`` + ``cross_entropy(reduction="none")``):
the label of position ``i`` is ``tokens[i+1]`` where ``label_mask[i+1]`` is True and is ignored
(loss 0) otherwise; the last position never has a label.

Normalisation -- two values per labelled set, both token-weighted over every document of the set:

- ``CE loss`` (OLMo-core's logged value, the default): ``sum(loss) / sum(label_mask)``. OLMo-core
  selects losses with the *unshifted* ``label_mask`` (``tokens_loss.masked_select(label_mask)``), so
  each document's final token -- whose label is padding, loss 0 -- is counted in the denominator:
  a document of n tokens contributes n - 1 predictions but n to the count.
- ``CE loss (predicted tokens)``: ``sum(loss) / number of positions that have a label``, i.e.
  the mean over n - 1 predictions per document; it is the larger of the two, by a factor
  ``sum(n) / sum(n - 1)``.

``PPL = exp(CE loss)``, as OLMo-core logs it. Keys: ``<label>/CE loss``, ``<label>/PPL`` and
``<label>/CE loss (predicted tokens)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from olmax.eval.scoring import Scorer, bucket_length


@dataclass(frozen=True)
class PerplexityResult:
    loss_sum: float     # sum of per-token CE (nats)
    mask_tokens: int    # sum(label_mask): OLMo-core's denominator
    predicted: int      # positions with a label

    @property
    def ce_loss(self) -> float:
        return self.loss_sum / self.mask_tokens if self.mask_tokens else float("nan")

    @property
    def ce_loss_predicted(self) -> float:
        return self.loss_sum / self.predicted if self.predicted else float("nan")

    def metrics(self, label: str) -> dict[str, float]:
        return {f"{label}/CE loss": self.ce_loss, f"{label}/PPL": float(np.exp(self.ce_loss)),
                f"{label}/CE loss (predicted tokens)": self.ce_loss_predicted}


def position_labels(tokens: np.ndarray, label_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(targets [N, T], has_label [N, T]): OLMo-core ``get_labels`` (shifted, last position none)."""
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    has_label = np.zeros_like(label_mask)
    has_label[:, :-1] = label_mask[:, 1:]
    return targets, has_label


def perplexity(scorer: Scorer, params: Any, tokens: np.ndarray, label_mask: np.ndarray, *,
               batch_size: int = 8, progress: Callable[[int], None] | None = None) -> PerplexityResult:
    """Padded-form CE over all documents; batches are sorted by length and cut to a bucket."""
    tokens = np.asarray(tokens, np.int32)
    label_mask = np.asarray(label_mask, bool)
    if tokens.shape != label_mask.shape or tokens.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} and label_mask {label_mask.shape} must be equal 2-D shapes")
    targets, has_label = position_labels(tokens, label_mask)
    lengths = label_mask.sum(axis=1)
    order = np.argsort(-lengths, kind="stable")
    loss_sum = 0.0
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        t = bucket_length(int(lengths[idx].max()), tokens.shape[1])
        tok = np.zeros((batch_size, t), np.int32)
        tgt = np.zeros((batch_size, t), np.int32)
        lab = np.zeros((batch_size, t), bool)
        tok[: len(idx)] = tokens[idx, :t]
        tgt[: len(idx)] = targets[idx, :t]
        lab[: len(idx)] = has_label[idx, :t]
        lp = scorer.target_logprobs(params, tok, tgt)
        loss_sum += float(-np.sum(np.where(lab, lp, 0.0), dtype=np.float64))
        if progress is not None:
            progress(len(idx))
    return PerplexityResult(loss_sum, int(label_mask.sum()), int(has_label.sum()))
