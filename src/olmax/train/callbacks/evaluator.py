"""In-loop evaluation: held-out perplexity and OLMES downstream tasks every ``eval.interval`` steps.

OLMo-core's counterparts are ``LMEvaluatorCallbackConfig`` (padded held-out sets, ``CE loss`` and
``PPL`` per label) and ``DownstreamEvaluatorCallbackConfig`` (``olmo_eval`` tasks, request context =
the train module's sequence length), both in ``train/callbacks/evaluator_callback.py``; the stage-1
7B recipe evaluates every 10,000 steps on ``v3_small_ppl_validation`` and the ``fast`` task suite.
Log keys are OLMo-core's: ``eval/lm/<label>/CE loss``, ``eval/lm/<label>/PPL``,
``eval/downstream/<task> (<metric>)``, plus ``eval/seconds``.

Contamination guard (before the first step): every held-out set is checked against the run's
training files (exact documents and 13-grams, :mod:`olmax.eval.contamination.overlap`). An
overlapping set stops the run with one line naming it, unless ``eval.allow_overlap=true`` (warn and
evaluate as is) or ``eval.drop_overlapping=true`` (evaluate without the flagged documents).
``eval.overlap_max_train_tokens`` bounds the scan for very large mixes (the log says when the scan
was partial); ``eval.overlap_check=false`` skips it.

The trainer calls the hooks on every process (the model's forward is a collective when params are
sharded); evaluation data is prepared identically everywhere.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from olmax.config import EvalConfig, RunConfig
from olmax.data.loader import resolve_paths
from olmax.data.tokenizer import get_tokenizer
from olmax.eval.contamination.overlap import check_heldout_disjoint
from olmax.eval.perplexity import parse_heldout
from olmax.eval.runner import EvalSuite, log_metrics
from olmax.eval.scoring import Scorer
from olmax.train.callbacks.base import Callback, Run

log = logging.getLogger(__name__)


class EvaluatorCallback(Callback):
    """Held-out perplexity and downstream tasks at ``eval.interval`` steps (and at start/end)."""

    order = 30

    def __init__(self, cfg: EvalConfig) -> None:
        self.cfg = cfg
        self.suite: Any = None
        self.scorer: Any = None
        self.overlap_report: Any = None
        self.last_eval_step: int | None = None

    @classmethod
    def from_config(cls, run_cfg: RunConfig) -> "EvaluatorCallback | None":
        """None when the run evaluates nothing."""
        e = run_cfg.eval
        if not (e.heldout or e.tasks) or not (e.interval or e.on_start or e.on_end):
            return None
        from olmax.eval.perplexity import parse_heldout
        from olmax.eval.tasks import expand_tasks, get_task

        for name in expand_tasks(list(e.tasks)):   # a bad task or file fails before training
            get_task(name)
        parse_heldout(e.heldout, cache_dir=run_cfg.data.cache_dir)
        return cls(e)

    # -- setup ---------------------------------------------------------------------------------

    def on_train_start(self, run_view: Run) -> None:
        run = run_view.cfg
        seq_len = self.cfg.seq_len or run.train.seq_len
        tok = get_tokenizer(run.data.tokenizer)
        heldout_sets = parse_heldout(self.cfg.heldout, cache_dir=run.data.cache_dir)
        flagged = self._guard(run, heldout_sets, tok.eos_token_id) if heldout_sets else {}
        self.suite = EvalSuite.prepare(tasks=self.cfg.tasks, heldout=self.cfg.heldout, tokenizer=tok,
                                       model_ctx_len=seq_len, vocab_size=run.model.vocab_size,
                                       limit=self.cfg.limit, heldout_max_docs=self.cfg.heldout_max_docs)
        for label, drop in flagged.items():
            tokens, mask = self.suite.heldout[label]
            keep = np.setdiff1d(np.arange(len(tokens)), np.asarray(drop, dtype=np.int64))
            self.suite.heldout[label] = (tokens[keep], mask[keep])
            log.warning("held-out set '%s': evaluating without %d overlapping documents",
                        label, len(tokens) - len(keep))
        self.scorer = Scorer(run.model, compute_dtype=run.train.compute_dtype,
                             attn_impl=run.train.attn_impl)
        if self.cfg.on_start:
            run_view.log(run_view.step, self.evaluate(run_view))

    def _guard(self, run: RunConfig, heldout_sets: dict[str, list[str]], eos: int) -> dict[str, list[int]]:
        """Run the contamination check; returns {label: document indices to drop}."""
        if not self.cfg.overlap_check:
            return {}
        train_paths, _ = resolve_paths(run.data)
        lenient = self.cfg.allow_overlap or self.cfg.drop_overlapping
        report = check_heldout_disjoint(
            train_paths, heldout_sets, eos_token_id=eos, allow=lenient, dtype=np.dtype(run.data.dtype),
            max_train_tokens=self.cfg.overlap_max_train_tokens,
            override_hint="eval.drop_overlapping=true (or eval.allow_overlap=true)")
        self.overlap_report = report
        if report.partial:
            log.warning("contamination check scanned %d of the training tokens (eval.overlap_max_train_tokens)",
                        report.train_tokens_scanned)
        for s in report.contaminated:
            log.warning("held-out set overlaps training data: %s", s.describe())
        if not self.cfg.drop_overlapping:
            return {}
        return {s.name: s.flagged for s in report.contaminated}

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, run: Run) -> dict[str, float]:
        show = run.cfg.logging.progress and run.is_main
        results = self.suite.run(self.scorer, run.params, batch_size=self.cfg.batch_size,
                                 progress=show, desc=f"eval@{run.step}")
        self.last_eval_step = run.step
        return {**log_metrics(results), "eval/seconds": results["seconds"]}

    def on_step_end(self, run: Run, step: int, metrics: Mapping[str, Any]) -> dict | None:
        if self.cfg.interval and step % self.cfg.interval == 0 and self.suite:
            return self.evaluate(run)
        return None

    def on_train_end(self, run: Run) -> None:
        if self.cfg.on_end and self.suite and self.last_eval_step != run.step:
            run.log(run.step, self.evaluate(run))
