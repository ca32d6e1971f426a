"""Throughput: tokens/s and MFU per step (OLMo-core ``SpeedMonitorCallback`` counterpart).

``tokens_per_sec`` is the global batch's tokens (B x T) over the wall time since the previous step
ended (step 1 includes compilation); ``mfu`` uses :mod:`olmax.model.flops` (OLMo-core's
window-aware FLOPs convention) against the devices' bf16 peak, and is null where the peak is
unknown (CPU).
"""

from __future__ import annotations

import time
from typing import Any


class SpeedMonitor:
    def __init__(self) -> None:
        self._last: float | None = None
        self.flops_per_token: float | None = None
        self.peak: float | None = None
        self.history: list[tuple[int, int, float]] = []   # (step, tokens, seconds)

    def on_train_start(self, trainer: Any) -> None:
        import jax

        try:
            from olmax.model.flops import flops_per_token, peak_flops
        except ImportError:  # the FLOPs module is optional for training
            flops_per_token = peak_flops = None  # type: ignore[assignment]
        if flops_per_token is not None:
            self.flops_per_token = flops_per_token(trainer.model_cfg, trainer.cfg.train.seq_len)
            self.peak = peak_flops(jax.devices()[0])
        self._last = time.perf_counter()

    def on_step_end(self, trainer: Any, step: int, metrics: dict) -> dict:
        import jax

        now = time.perf_counter()
        dt = now - (self._last if self._last is not None else now)
        self._last = now
        tokens = trainer.cfg.train.global_batch_size * trainer.cfg.train.seq_len
        tps = tokens / dt if dt > 0 else float("nan")
        self.history.append((step, tokens, dt))
        mfu = None
        if self.flops_per_token and self.peak:
            mfu = tps * self.flops_per_token / (self.peak * jax.device_count())
        return {"tokens_per_sec": tps, "mfu": mfu}

    def steady_tokens_per_sec(self, skip: int = 2) -> float | None:
        """Tokens/s over the steps after the first ``skip`` (compilation, warm-up)."""
        rows = self.history[skip:] or self.history[-1:]
        seconds = sum(r[2] for r in rows)
        return sum(r[1] for r in rows) / seconds if seconds > 0 else None
