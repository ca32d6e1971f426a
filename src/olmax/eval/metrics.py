"""OLMo in-loop downstream metrics (EV ``src/olmo_eval/metrics.py: ICLMetric``), in numpy.

Each scored request is a :class:`Scored` record: the summed log-likelihood of its continuation plus
the lengths EV normalises by. :func:`compute_metrics` reproduces ``ICLMetric.update`` +
``ICLMetric.compute`` for ``metric_type`` in ``acc``, ``len_norm``, ``bpb``, ``ce_loss`` and ``f1``:

- per request: ``acc``/``f1`` keep the raw sum ``ll``; ``len_norm``/``ce_loss``/``bpb`` divide it by
  the continuation's character count. ``ce = -ll_sum / n_chars``; ``bpb = -ll_sum / n_bytes * log2(e)``.
- v2 uses the full continuation string; v1 (EV's "no leading space" lists) drops its first character.
- per document (``doc_id``): choices are placed at ``cont_id``; ``acc``-like metrics are
  ``argmax(ll) == label`` (first maximum wins, as ``torch.argmax``), ``bpb``/``ce`` are taken at the
  label (single-answer ``bpb``/``ce_loss`` tasks: at choice 0); a document whose ``cont_id`` exceeds its
  number of scored choices is skipped. The first record of a (doc, choice) pair wins.
- EV quirk kept on purpose: ``acc_v1`` and ``len_norm_v1`` are computed from the v2 predictions
  (``compute`` returns ``sum(correct)`` for both), so they always equal their v2 twins.

Means are accumulated in float64 (EV sums float32 values for the ``bpb``/``ce_loss`` types; the
difference is rounding only). ``LOG_2_OF_E`` is EV's constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

LOG_2_OF_E = 1.44269504089

# OLMo-core train/callbacks/evaluator_callback.py: DownstreamEvaluator.metric_type_to_label
METRIC_LABELS = {
    "f1_v1": "F1 score", "acc_v1": "accuracy", "len_norm_v1": "length-normalized accuracy",
    "pmi_dc_v1": "PMI-DC accuracy", "ce_loss_v1": "CE loss", "bpb_v1": "BPB", "soft_v1": "soft loss",
    "soft_log_v1": "log soft loss", "f1_v2": "F1 score v2", "acc_v2": "accuracy v2",
    "len_norm_v2": "length-normalized accuracy v2", "pmi_dc_v2": "PMI-DC accuracy v2",
    "ce_loss_v2": "CE loss v2", "bpb_v2": "BPB v2", "soft_v2": "soft loss v2",
    "soft_log_v2": "log soft loss v2",
}


@dataclass(frozen=True)
class Scored:
    """One scored (context, continuation) pair (for fast MC: one answer-letter token)."""

    doc_id: int
    cont_id: int
    label_id: int
    logprob: float          # sum of log p(continuation tokens)
    cont_str_len: int
    cont_byte_len: int
    cont_str_len_nls: int   # "no leading space": len(continuation) - 1
    cont_byte_len_nls: int


def _div(a: float, b: int) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float64(a) / np.float64(b))


def _per_request(r: Scored, metric_type: str) -> tuple[float, float, float, float, float, float]:
    """(ll, ll_v1, ce, ce_v1, bpb, bpb_v1) of one record, as ``ICLMetric.update``."""
    lp = r.logprob
    ce, ce_v1 = _div(-lp, r.cont_str_len), _div(-lp, r.cont_str_len_nls)
    bpb = _div(-lp, r.cont_byte_len) * LOG_2_OF_E
    bpb_v1 = _div(-lp, r.cont_byte_len_nls) * LOG_2_OF_E
    if metric_type in ("acc", "f1"):
        return lp, lp, ce, ce_v1, bpb, bpb_v1
    if metric_type in ("len_norm", "ce_loss", "bpb"):
        return _div(lp, r.cont_str_len), _div(lp, r.cont_str_len_nls), ce, ce_v1, bpb, bpb_v1
    raise ValueError(f"unsupported metric type '{metric_type}'")


def _f1(labels: list[int], preds: list[int], pos_label: int = 0) -> float:
    tp = sum(y == pos_label and p == pos_label for y, p in zip(labels, preds))
    fp = sum(y != pos_label and p == pos_label for y, p in zip(labels, preds))
    fn = sum(y == pos_label and p != pos_label for y, p in zip(labels, preds))
    if tp + fp == 0 or tp + fn == 0:
        return 0.0
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def _softmax(x: np.ndarray) -> np.ndarray:
    z = x - np.max(x)
    e = np.exp(z)
    return e / e.sum()


def compute_metrics(records: Iterable[Scored], metric_type: str) -> dict[str, float]:
    """EV ``ICLMetric.compute`` over the records: {"acc_v1": ..., "bpb_v2": ..., ...}."""
    labels: dict[int, int] = {}
    values: dict[int, dict[int, tuple[float, ...]]] = {}
    for r in records:
        labels.setdefault(r.doc_id, r.label_id)
        values.setdefault(r.doc_id, {}).setdefault(r.cont_id, _per_request(r, metric_type))

    correct: list[float] = []
    ce: list[float] = []
    ce_v1: list[float] = []
    bpb: list[float] = []
    bpb_v1: list[float] = []
    soft: list[float] = []
    soft_v1: list[float] = []
    soft_log: list[float] = []
    soft_log_v1: list[float] = []
    preds: list[int] = []
    preds_v1: list[int] = []
    gold: list[int] = []
    for doc_id, conts in values.items():
        n = len(conts)
        if any(c >= n for c in conts):  # EV: IndexError -> skip the document
            continue
        arr = np.empty((6, n))
        arr[[0, 1]] = -np.inf
        arr[2:] = np.inf
        for c, vals in conts.items():
            arr[:, c] = vals
        ll, ll1, ces, ces1, bpbs, bpbs1 = arr
        label = labels[doc_id]
        if metric_type in ("ce_loss", "bpb"):
            ce.append(ces[0]); ce_v1.append(ces1[0]); bpb.append(bpbs[0]); bpb_v1.append(bpbs1[0])
        elif metric_type == "f1":
            preds.append(int(np.argmax(ll))); preds_v1.append(int(np.argmax(ll1))); gold.append(label)
        else:
            correct.append(1.0 if int(np.argmax(ll)) == label else 0.0)
            ce.append(ces[label]); ce_v1.append(ces1[label])
            bpb.append(bpbs[label]); bpb_v1.append(bpbs1[label])
            p, p1 = _softmax(ll), _softmax(ll1)
            soft.append(p[label]); soft_v1.append(p1[label])
            soft_log.append(float(np.log(p[label]))); soft_log_v1.append(float(np.log(p1[label])))

    def mean(xs: list[float]) -> float:
        return float(np.mean(xs)) if xs else float("nan")

    if metric_type == "f1":
        return {"f1_v1": _f1(gold, preds), "f1_v2": _f1(gold, preds_v1)}
    if metric_type == "ce_loss":
        return {"ce_loss_v1": mean(ce_v1), "ce_loss_v2": mean(ce)}
    if metric_type == "bpb":
        return {"bpb_v1": mean(bpb_v1), "bpb_v2": mean(bpb)}
    acc = mean(correct)
    return {
        f"{metric_type}_v1": acc, f"{metric_type}_v2": acc,
        "ce_loss_v1": mean(ce_v1), "ce_loss_v2": mean(ce),
        "bpb_v1": mean(bpb_v1), "bpb_v2": mean(bpb),
        "soft_v1": mean(soft_v1), "soft_v2": mean(soft),
        "soft_log_v1": mean(soft_log_v1), "soft_log_v2": mean(soft_log),
    }


def labelled(task: str, metrics: dict[str, float]) -> dict[str, float]:
    """OLMo-core's log names: ``"<task> (BPB v2)"`` etc."""
    return {f"{task} ({METRIC_LABELS[k]})": v for k, v in metrics.items()}
