"""Checkpoint saves: every ``checkpoint.interval`` steps, on SIGTERM, and at the end of the run.

- **Each step** (``after_log``, i.e. once the step's line is in ``metrics.jsonl``): every
  ``checkpoint.interval`` steps an async save starts. After SIGTERM (agreed across processes) the
  step is saved whatever the interval, the save is committed, and the run is asked to stop, which
  the trainer honours by ending cleanly; rerunning the same command resumes.
- **End**: the final step is saved (if not already) and every save committed.

A step whose loss or applied gradient is not finite never reaches ``after_log`` (the trainer
stops first), so every checkpoint on disk holds a finite state. Where a run starts from (resume,
warm start, HF weights, fresh) is :func:`olmax.train.start.start_state`'s business.

Meta written with every checkpoint: ``model``, ``config`` (resolved RunConfig), ``seed``,
``data_position`` (= batches consumed = step; the next batch index is ``data_position``),
``data_fingerprint``, ``mesh``, ``process_count``, ``device_count``, ``init`` (where the run
started from) and ``vocab_padding`` (the padding rows are in the softmax: they were trained there),
plus ``format_version`` and ``step`` (added by the Checkpointer).

OLMo-core's counterpart: ``train/callbacks/checkpointer.py`` (periodic saves, ephemeral vs
permanent).
"""

from __future__ import annotations

import signal
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from olmax.config import RunConfig, to_dict
from olmax.interop import vocab_padding
from olmax.train.callbacks.base import Callback, RunView


class CheckpointSaver(Callback):
    order = 20

    def __init__(self) -> None:
        # Installed at construction, before the start state is restored: a SIGTERM during a long
        # restore is honoured at the first step instead of killing the process.
        self.stop = StopSignal().__enter__()

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "CheckpointSaver":
        return cls()

    def meta(self, run: RunView, step: int) -> dict:
        return {
            "model": to_dict(run.cfg.model),
            "config": to_dict(run.cfg),
            "seed": run.cfg.seed,
            "data_position": int(step),
            "data_fingerprint": run.data_fingerprint,
            "mesh": run.mesh_shape,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "init": run.origin,
            vocab_padding.META_KEY: vocab_padding.record(run.cfg.model, in_softmax=True,
                                                         init=vocab_padding.TRAINED),
        }

    def save(self, run: RunView, step: int, force: bool = False) -> bool:
        ckpt = run.checkpointer
        if ckpt is not None and (force or ckpt.should_save(step)):
            run.flush()      # the step's metrics line is durable before its checkpoint
        return run.checkpointer.save(step, run.state, self.meta(run, step), force=force)

    def after_log(self, run: RunView, step: int, metrics: Mapping[str, Any]) -> None:
        stop = self.stop.requested()
        self.save(run, step, force=stop)
        if stop:
            run.checkpointer.wait()
            run.request_stop()
            run.checkpointer.report(f"stopping after SIGTERM: checkpoint {run.checkpointer.step_dir(step)} "
                                    "saved; run the same command to resume")

    def on_train_end(self, run: RunView) -> None:
        if run.step > 0:
            self.save(run, run.step, force=True)
        run.checkpointer.wait()

    def close(self) -> None:
        self.stop.__exit__(None, None, None)


class StopSignal:
    """Turns SIGTERM (and optionally SIGINT) into a flag the training loop polls between steps.

    ``requested()`` is agreed across processes (any process signalled -> all stop at the same step),
    so every process takes part in the final checkpoint. Use as a context manager; the previous
    handlers are restored on exit.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signum

    def __enter__(self) -> "StopSignal":
        for s in self.signals:
            try:
                self._old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def requested(self) -> bool:
        local = self.received is not None
        if jax.process_count() == 1:
            return local
        flags = multihost_utils.process_allgather(np.int32(local))
        return bool(np.any(flags))
