"""olmax.train.callbacks: what the trainer does around its steps, one callback per file.

Adding a callback is one file (a :class:`~olmax.train.callbacks.base.Callback` subclass with a
``from_config``) and one entry here; the trainer builds every registered callback that the run's
config turns on and calls them in ``order``.
"""

from __future__ import annotations

from typing import Iterable

from olmax.config import RunConfig
from olmax.train.callbacks.base import Callback, RunView
from olmax.train.callbacks.dashboard import DashboardCallback
from olmax.train.callbacks.evaluator import EvaluatorCallback
from olmax.train.callbacks.saver import CheckpointSaver
from olmax.train.callbacks.speed_monitor import SpeedMonitor
from olmax.train.callbacks.watchdog import Watchdog

# Built in this order (the evaluator first: it checks the eval tasks and files before anything is
# opened); their hooks run in ``order``.
REGISTRY: dict[str, type[Callback]] = {
    "evaluator": EvaluatorCallback,     # held-out perplexity, OLMES tasks (eval section)
    "speed_monitor": SpeedMonitor,      # tokens/s, MFU
    "checkpoint": CheckpointSaver,      # periodic, SIGTERM and final saves
    "dashboard": DashboardCallback,     # RUN_DIR/dashboard.png
    "watchdog": Watchdog,               # stacks and exit 75 when steps stop completing
}
# Not built from the config: the run directory's lock (callbacks/run_lock.py), which the trainer
# takes before anything else and passes in with the run's other callbacks.


def build_callbacks(cfg: RunConfig, extra: Iterable[Callback] = ()) -> list[Callback]:
    """Every registered callback ``cfg`` turns on, plus ``extra``, sorted by ``order`` (stable)."""
    built: list[Callback] = []
    try:
        for cls in REGISTRY.values():
            cb = cls.from_config(cfg)
            if cb is not None:
                built.append(cb)
    except BaseException:
        for cb in built:   # one that could not be built: release what the others hold
            cb.close()
        raise
    return sorted([*built, *extra], key=lambda cb: cb.order)


__all__ = ["Callback", "RunView", "REGISTRY", "build_callbacks"]
