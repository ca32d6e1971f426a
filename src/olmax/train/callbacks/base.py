"""The trainer's callback contract: a :class:`Callback` base and the :class:`RunView` a callback sees.

The trainer calls every hook of every callback, in ``order`` (lower first; ties keep registry
order), with no special cases:

====================================  ========================================================
``on_train_start(run)``               once, after the start state is chosen, before step 1
``on_step_end(run, step, metrics)``   after each step; a dict returned is merged into the
                                      step's metrics line (throughput, evaluation results)
``after_log(run, step, metrics)``     after that line is in ``metrics.jsonl`` (checkpoints
                                      are taken here: a resume rewinds the file to the
                                      restored step, so its line must already be there)
``on_train_end(run)``                 once, after the last step (or a requested stop)
``on_error(run, exc)``                when the run fails (``exc`` is then re-raised)
``close()``                           always, last (release signal handlers, files)
``summary()``                         what the callback adds to the run's summary
====================================  ========================================================

A callback is one file under ``olmax/train/callbacks/`` plus one entry in
:data:`olmax.train.callbacks.REGISTRY`; ``from_config`` builds it from the run's config (None: the
run does not use it). OLMo-core's ``train/callbacks/callback.py`` has the same shape (hooks,
``priority``, ``on_error``, ``close``); like Levanter's ``StepInfo``, callbacks get a narrow view of
the run rather than the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from jax.sharding import Mesh

from olmax.checkpoint.checkpointer import Checkpointer
from olmax.config import ModelConfig, RunConfig


@dataclass
class RunView:
    """What callbacks see of a run. The trainer keeps ``step`` and ``state`` current."""

    cfg: RunConfig
    run_dir: Any                               # a Path, or a bucket path (str)
    is_main: bool                              # process 0 (the one that writes run-dir files)
    checkpointer: Checkpointer | None = None   # RUN_DIR/checkpoints (every process)
    origin: dict = field(default_factory=lambda: {"kind": "fresh"})  # where the weights came from
    mesh: Mesh | None = None                   # the devices the step runs on (evaluation runs there too)
    mesh_shape: dict[str, int] | None = None
    data_fingerprint: dict | None = None
    step: int = 0                              # the last completed step
    state: Any = None                          # TrainState after ``step``
    stop_requested: bool = False
    log_fn: Callable[[int, Mapping[str, Any]], None] | None = None
    flush_fn: Callable[[], None] | None = None

    @property
    def model_cfg(self) -> ModelConfig:
        return self.cfg.model

    @property
    def params(self) -> Any:
        return self.state.params

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write a line to ``metrics.jsonl`` (and TensorBoard) at ``step``."""
        if self.log_fn is not None:
            self.log_fn(step, metrics)

    def flush(self) -> None:
        """Make what was logged durable (a bucket run uploads its metrics segment; see
        :mod:`olmax.train.run_log`): before a checkpoint save, whose step a resume rewinds to."""
        if self.flush_fn is not None and self.is_main:
            self.flush_fn()

    def request_stop(self) -> None:
        """End the run cleanly after the current step (``on_train_end`` still runs)."""
        self.stop_requested = True


class Callback:
    """No-op hooks; subclasses override what they need (see the module docstring)."""

    order: ClassVar[int] = 50

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "Callback | None":
        return cls()

    def on_train_start(self, run: RunView) -> None:
        pass

    def on_step_end(self, run: RunView, step: int, metrics: Mapping[str, Any]) -> dict | None:
        return None

    def after_log(self, run: RunView, step: int, metrics: Mapping[str, Any]) -> None:
        pass

    def on_train_end(self, run: RunView) -> None:
        pass

    def on_error(self, run: RunView, exc: BaseException) -> None:
        pass

    def close(self) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}
