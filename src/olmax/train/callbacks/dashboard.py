"""Writes ``RUN_DIR/dashboard.png`` (loss, LR, grad norm, tokens/s, MFU, eval metrics) at the end of
a run, on process 0 (``logging.dashboard: false`` leaves it out). Runs last, after the final
in-loop evaluation has been logged. A plotting failure is reported and never fails the run."""

from __future__ import annotations

import logging

from olmax.analysis.curves import write_dashboard
from olmax.config import RunConfig
from olmax.train.callbacks.base import Callback, RunView

log = logging.getLogger(__name__)


class DashboardCallback(Callback):
    order = 90

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "DashboardCallback | None":
        return cls() if cfg.logging.dashboard else None

    def on_train_end(self, run: RunView) -> None:
        if not run.is_main:
            return
        try:
            run.flush()      # a bucket run's last metrics lines, which the plot reads
            path = write_dashboard(run.run_dir)
        except Exception as e:  # a plot must not fail a finished run
            log.warning("could not write the run dashboard: %s", e)
            return
        if path is not None:
            log.info("dashboard: %s", path)
