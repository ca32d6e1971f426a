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

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from olmax.config import OlmaxError
from olmax.data.remote import is_pattern, is_remote, remote_files
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


# ----------------------------------------------------------------------------------------------
# Held-out set specifications


def parse_heldout(entries: Sequence[str], *, cache_dir: str | None = None) -> dict[str, list[str]]:
    """``eval.heldout`` / ``--heldout`` entries -> {label: [token files]}.

    An entry is ``embedded`` (the embedded corpus's held-out split), ``LABEL=PATH[,PATH...]``,
    an OLMo-core mix file (``*.txt``: its ``label,path`` lines, labels kept), or a path/glob
    (label: the file's stem, or its parent folder's name when the stem is generic, e.g.
    ``c4_en/val/part-0-00000.npy`` -> ``c4_en``). Paths and globs may be ``s3://``, ``gs://`` or
    ``http(s)://`` URLs (read in place, :mod:`olmax.data.remote`).
    """
    sets: dict[str, list[str]] = {}
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        if entry == "embedded":
            from olmax.data.embedded import embedded_token_files

            sets.setdefault("embedded-heldout", []).extend(embedded_token_files("heldout", cache_dir))
            continue
        if "=" in entry:
            label, paths = entry.split("=", 1)
            files = [f for p in paths.split(",") if p for f in _expand(p)]
            sets.setdefault(label.strip(), []).extend(files)
            continue
        if entry.endswith(".txt"):
            from olmax.data.mixfile import read_mix_file

            for e in read_mix_file(entry):
                sets.setdefault(e.label, []).append(e.path)
            continue
        for f in _expand(entry):
            sets.setdefault(_label_of(f), []).append(f)
    for label, files in sets.items():
        for f in files:
            if not is_remote(f) and os.path.isdir(f):
                from olmax.data.manifests import directory_hint

                raise OlmaxError(f"held-out set '{label}': {f} is a directory, not a token file"
                                 f"{directory_hint(f)}")
            if not (remote_files().exists(f) if is_remote(f) else os.path.isfile(f)):
                raise OlmaxError(f"held-out set '{label}': token file not found: {f}")
    return sets


def _expand(pattern: str) -> list[str]:
    if is_pattern(pattern):
        files = remote_files().glob(pattern) if is_remote(pattern) else sorted(glob.glob(pattern))
        if not files:
            raise OlmaxError(f"held-out pattern matches no file: {pattern}")
        return files
    return [pattern]


def _label_of(path: str) -> str:
    p = Path(path)
    generic = p.stem.startswith("part-") or p.stem in ("val", "validation", "test", "data")
    if generic:
        parents = [q.name for q in p.parents if q.name and q.name not in ("val", "validation", "test")]
        if parents:
            return parents[0]
    return p.stem
