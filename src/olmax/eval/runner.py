"""One evaluation suite (held-out perplexity + downstream tasks) prepared once, run many times.

Used by ``olmax eval`` and by the in-loop callback (``olmax.train.callbacks.evaluator``). Log keys
follow OLMo-core's evaluator callbacks so curves can be compared with AI2's runs:
``eval/lm/<label>/CE loss``, ``eval/lm/<label>/PPL`` and ``eval/downstream/<task> (<metric>)``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from olmax.checkpoint.weights import load_meta, load_params
from olmax.config import ModelConfig
from olmax.errors import OlmaxError
from olmax.data.heldout import load_heldout_sets
from olmax.data.sources import heldout_sets
from olmax.data.tokenizer import get_tokenizer
from olmax.eval.contamination import OverlapGuard
from olmax.eval.downstream import DownstreamTask, prepare_task
from olmax.eval.metrics import labelled
from olmax.eval.perplexity import perplexity
from olmax.eval.scoring import Scorer
from olmax.eval.tasks import expand_tasks, get_task
from olmax.interop.hf import load_hf
from olmax.interop.olmo_core.checkpoint import is_olmo_core_checkpoint
from olmax.interop.olmo_core.convert import read_weights as read_olmo_core_weights
from olmax.interop.vocab_padding import softmax_vocab
from olmax.store import is_bucket
from olmax.transport import url_scheme

log = logging.getLogger(__name__)


def is_hf_dir(path: str | os.PathLike) -> bool:
    """A Hugging Face model directory (``config.json``; its weights are checked when read: only
    safetensors are accepted)."""
    return (Path(path) / "config.json").is_file()


@dataclass
class LoadedModel:
    params: Any
    cfg: ModelConfig
    source: str           # "olmax" | "olmo-core" | "hf"
    softmax_vocab: int    # logits entering the softmax (see olmax.eval.scoring)


def load_model(path: str | os.PathLike) -> LoadedModel:
    """An olmax checkpoint (step/run/checkpoints dir), an OLMo-core checkpoint (read in place,
    local or a URL) or an HF ``Olmo3ForCausalLM`` directory."""
    if is_olmo_core_checkpoint(path):
        params, cfg, meta = read_olmo_core_weights(path)
        return LoadedModel(jax.tree.map(jax.numpy.asarray, params), cfg, "olmo-core",
                           softmax_vocab(meta, cfg))
    if is_bucket(str(path)):        # an olmax checkpoint in a bucket (s3://, gs://)
        params, cfg = load_params(path)
        return LoadedModel(params, cfg, "olmax", softmax_vocab(load_meta(path), cfg))
    if url_scheme(path) is not None:
        raise OlmaxError(f"{path}: no OLMo-core checkpoint there (at a URL olmax reads OLMo-core "
                         f"checkpoints, and olmax ones in s3:// or gs://; HF directories locally)")
    p = Path(path)
    if not p.exists():
        raise OlmaxError(f"checkpoint not found: {p}")
    if is_hf_dir(p):
        params, cfg, _ = load_hf(p)
        return LoadedModel(jax.tree.map(jax.numpy.asarray, params), cfg, "hf", cfg.vocab_size)
    params, cfg = load_params(p)
    # padding rows the source never had stay out of the softmax (olmax.interop.vocab_padding)
    return LoadedModel(params, cfg, "olmax", softmax_vocab(load_meta(p), cfg))


@dataclass
class EvalSuite:
    """Prepared evaluation data for one model context length."""

    heldout: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    tasks: list[DownstreamTask] = field(default_factory=list)
    overlap_report: Any = None    # the contamination check's report, when one ran

    @classmethod
    def prepare(cls, *, tasks: Sequence[str] = (), heldout: Sequence[str] = (), tokenizer: Any = None,
                model_ctx_len: int, heldout_seq_len: int | None = None, vocab_size: int | None = None,
                limit: int | None = None, heldout_max_docs: int | None = None,
                cache: str | None = None, data_cache_dir: str | None = None,
                exclude_overlap_with: OverlapGuard | None = None,
                vocab_setting: str | None = None) -> "EvalSuite":
        """Tokenized tasks and padded held-out sets. ``cache``: the OLMES data cache;
        ``data_cache_dir``: where the embedded corpus is cached; ``exclude_overlap_with``: check
        the held-out sets against training files first (see :class:`OverlapGuard`);
        ``vocab_setting``: what sets ``vocab_size``, as the user changes it (error lines)."""
        names = expand_tasks(list(tasks))
        for name in names:  # fail on a bad name before any slow work
            get_task(name, cache)
        if (names or heldout) and tokenizer is None:
            tokenizer = get_tokenizer("dolma2")
        files = heldout_sets(heldout, cache_dir=data_cache_dir) if heldout else {}
        report, flagged = None, {}
        if files and exclude_overlap_with is not None:
            report, flagged = exclude_overlap_with.check(files, tokenizer.eos_token_id)
        sets = {}
        if files:
            sets = load_heldout_sets(files, heldout_seq_len or model_ctx_len,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                     vocab_size=vocab_size, max_docs=heldout_max_docs,
                                     vocab_setting=vocab_setting)
        for label, drop in flagged.items():
            tokens, mask = sets[label]
            keep = np.setdiff1d(np.arange(len(tokens)), np.asarray(drop, dtype=np.int64))
            sets[label] = (tokens[keep], mask[keep])
            log.warning("held-out set '%s': evaluating without %d overlapping documents",
                        label, len(tokens) - len(keep))
        prepared = [prepare_task(n, tokenizer, model_ctx_len, limit=limit, cache=cache) for n in names]
        return cls(sets, prepared, report)

    def __bool__(self) -> bool:
        return bool(self.heldout or self.tasks)

    @property
    def total_items(self) -> int:
        return sum(len(t) for t, _ in self.heldout.values()) + sum(len(t.instances) for t in self.tasks)

    def run(self, scorer: Scorer, params: Any, *, batch_size: int = 8, progress: bool = False,
            desc: str = "eval") -> dict[str, Any]:
        """{"heldout": {label: {...}}, "downstream": {task: {...}}, "seconds": s}."""
        bar = None
        if progress:
            bar = tqdm(total=self.total_items, desc=desc, unit="seq", leave=False)
        tick = bar.update if bar is not None else None
        t0 = time.time()
        out: dict[str, Any] = {"heldout": {}, "downstream": {}}
        try:
            for label, (tokens, mask) in self.heldout.items():
                if bar is not None:
                    bar.set_postfix_str(label)
                res = perplexity(scorer, params, tokens, mask, batch_size=batch_size, progress=tick)
                out["heldout"][label] = {**{k.split("/", 1)[1]: v for k, v in res.metrics(label).items()},
                                         "documents": int(len(tokens)), "tokens": res.mask_tokens}
            for task in self.tasks:
                if bar is not None:
                    bar.set_postfix_str(task.name)
                values = task.evaluate(scorer, params, batch_size=batch_size, progress=tick)
                out["downstream"][task.name] = {"metric_type": task.metric_type, "documents": task.num_docs,
                                                "requests": len(task.instances), "metrics": values}
        finally:
            if bar is not None:
                bar.close()
        out["seconds"] = time.time() - t0
        return out


def log_metrics(results: dict[str, Any]) -> dict[str, float]:
    """Flat OLMo-core-style log keys of :meth:`EvalSuite.run` results."""
    flat: dict[str, float] = {}
    for label, r in results.get("heldout", {}).items():
        for k in ("CE loss", "PPL"):
            flat[f"eval/lm/{label}/{k}"] = r[k]
    for task, r in results.get("downstream", {}).items():
        for k, v in labelled(task, r["metrics"]).items():
            flat[f"eval/downstream/{k}"] = v
    return flat

