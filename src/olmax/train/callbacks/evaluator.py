"""In-loop evaluation: held-out perplexity and OLMES downstream tasks every ``eval.interval`` steps.

OLMo-core's counterparts are ``LMEvaluatorCallbackConfig`` (padded held-out sets, ``CE loss`` and
``PPL`` per label) and ``DownstreamEvaluatorCallbackConfig`` (``olmo_eval`` tasks, request context =
the train module's sequence length), both in ``train/callbacks/evaluator_callback.py``; the stage-1
7B recipe evaluates every 10,000 steps on ``v3_small_ppl_validation`` and the ``fast`` task suite.
Log keys are OLMo-core's: ``eval/lm/<label>/CE loss``, ``eval/lm/<label>/PPL``,
``eval/downstream/<task> (<metric>)``, plus ``eval/seconds``.

Contamination guard (before the first step): every held-out set is checked against the run's
training files (exact documents and 13-grams, :class:`olmax.eval.contamination.OverlapGuard`). An
overlapping set stops the run with one line naming it, unless ``eval.allow_overlap=true`` (warn and
evaluate as is) or ``eval.drop_overlapping=true`` (evaluate without the flagged documents).
``eval.overlap_max_train_tokens`` bounds the scan for very large mixes (the log says when the scan
was partial); ``eval.overlap_check=false`` skips it.

The trainer calls the hooks on every process (the model's forward is a collective when params are
sharded); evaluation data is prepared identically everywhere.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from olmax.config import EvalConfig, RunConfig
from olmax.data.sources import heldout_sets, resolve_paths
from olmax.data.tokenizer import get_tokenizer
from olmax.errors import ConfigError
from olmax.eval.contamination import OverlapGuard
from olmax.eval.runner import EvalSuite, log_metrics
from olmax.eval.scoring import Scorer
from olmax.eval.tasks import expand_tasks, get_task
from olmax.model.runtime import Runtime
from olmax.train.callbacks.base import Callback, RunView


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
        for name in expand_tasks(list(e.tasks)):   # a bad task or file fails before training
            get_task(name)
        tok = get_tokenizer(run_cfg.data.tokenizer) if e.tasks else None
        if tok is not None and not tok.can_encode:  # the tasks' text is encoded with it
            raise ConfigError(f"eval.tasks: data.tokenizer {tok.identity['name']} gives token ids "
                              "only and cannot encode the tasks' text; name a tokenizer that can "
                              "(dolma2, a tokenizer.json, or fields whose identifier is one)")
        heldout_sets(e.heldout, cache_dir=run_cfg.data.cache_dir)
        return cls(e)

    # -- setup ---------------------------------------------------------------------------------

    def on_train_start(self, run: RunView) -> None:
        cfg = run.cfg
        guard = None
        if self.cfg.overlap_check:
            train_paths, _ = resolve_paths(cfg.data)
            mode = "drop" if self.cfg.drop_overlapping else "warn" if self.cfg.allow_overlap else "refuse"
            guard = OverlapGuard(tuple(train_paths), mode, np.dtype(cfg.data.dtype),
                                 self.cfg.overlap_max_train_tokens,
                                 override_hint="eval.drop_overlapping=true (or eval.allow_overlap=true)")
        self.suite = EvalSuite.prepare(
            tasks=self.cfg.tasks, heldout=self.cfg.heldout, tokenizer=get_tokenizer(cfg.data.tokenizer),
            model_ctx_len=self.cfg.seq_len or cfg.train.seq_len, vocab_size=cfg.model.vocab_size,
            limit=self.cfg.limit, heldout_max_docs=self.cfg.heldout_max_docs,
            data_cache_dir=cfg.data.cache_dir, exclude_overlap_with=guard,
            vocab_setting=f"the model's vocabulary (model.vocab_size {cfg.model.vocab_size}; "
                          f"data.tokenizer {cfg.data.tokenizer!r})")
        self.overlap_report = self.suite.overlap_report
        # the training dtype and attention kernel; no remat (nothing is differentiated)
        devices = None if run.mesh is None else run.mesh.devices.flat
        self.scorer = Scorer(cfg.model, Runtime.of(cfg.train, devices, remat="none"), mesh=run.mesh)
        if self.cfg.on_start:
            run.log(run.step, self.evaluate(run))

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, run: RunView) -> dict[str, float]:
        show = run.cfg.logging.progress and run.is_main
        results = self.suite.run(self.scorer, run.params, batch_size=self.cfg.batch_size,
                                 progress=show, desc=f"eval@{run.step}")
        self.last_eval_step = run.step
        return {**log_metrics(results), "eval/seconds": results["seconds"]}

    def on_step_end(self, run: RunView, step: int, metrics: Mapping[str, Any]) -> dict | None:
        if self.cfg.interval and step % self.cfg.interval == 0 and self.suite:
            return self.evaluate(run)
        return None

    def on_train_end(self, run: RunView) -> None:
        if self.cfg.on_end and self.suite and self.last_eval_step != run.step:
            run.log(run.step, self.evaluate(run))
