"""Throughput: tokens/s and MFU per step (OLMo-core ``SpeedMonitorCallback`` counterpart).

``tokens_per_sec`` is the global batch's tokens (B x T) over the wall time since the previous step
ended (step 1 includes compilation); ``mfu`` is :func:`olmax.model.flops.mfu` (OLMo-core's
window-aware FLOPs convention) against the devices' bf16 peak, and is null where the peak is
unknown (CPU).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import jax

from olmax.model.flops import mfu, peak_flops
from olmax.train.callbacks.base import Callback, RunView


class SpeedMonitor(Callback):
    order = 10

    def __init__(self) -> None:
        self._last: float | None = None
        self.peak: float | None = None
        self.history: list[tuple[int, int, float]] = []   # (step, tokens, seconds)

    def on_train_start(self, run: RunView) -> None:
        self.peak = peak_flops(jax.devices()[0])
        self._last = time.perf_counter()

    def on_step_end(self, run: RunView, step: int, metrics: Mapping[str, Any]) -> dict:
        now = time.perf_counter()
        dt = now - (self._last if self._last is not None else now)
        self._last = now
        t = run.cfg.train
        tokens = t.global_batch_size * t.seq_len
        tps = tokens / dt if dt > 0 else float("nan")
        self.history.append((step, tokens, dt))
        return {"tokens_per_sec": tps,
                "mfu": mfu(tps, run.cfg.model, t.seq_len, self.peak, devices=jax.device_count())}

    def summary(self) -> dict[str, Any]:
        return {"tokens_per_sec": self.steady_tokens_per_sec()}

    def steady_tokens_per_sec(self, skip: int = 2) -> float | None:
        """Tokens/s over the steps after the first ``skip`` (compilation, warm-up)."""
        rows = self.history[skip:] or self.history[-1:]
        seconds = sum(r[2] for r in rows)
        return sum(r[1] for r in rows) / seconds if seconds > 0 else None
