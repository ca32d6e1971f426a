"""Learning-rate schedules, exactly as OLMo-core's ``optim/scheduler.py``.

Conventions (OLMo-core): ``current`` is the trainer's ``global_step``, which is incremented *before*
the optimizer step, so the first update uses ``current = 1``; the schedule advances on every step,
skipped or not. Values are computed on the host in Python floats (float64), as OLMo-core does, and
handed to the compiled train step as a scalar.

- ``constant``: ``peak``.
- ``cos_with_warmup``: linear warmup from ``warmup_min_lr`` to ``peak`` over ``warmup`` steps, then a
  cosine from ``peak`` to ``alpha_f * peak`` at ``t_max``; ``alpha_f * peak`` afterwards.
- ``half_cos_with_warmup``: warmup to the cosine's midpoint ``eta_min + (peak - eta_min) / 2``, then
  the *second half* of a cosine from there to ``eta_min`` at ``t_max`` (the OLMo 3 stage-1 part-2
  extension to 7T tokens).
- ``linear_with_warmup``: warmup, then linear from ``peak`` to ``alpha_f * peak`` at ``t_max``
  (OLMo 3 stage 2: ``warmup=0, alpha_f=0``).

OLMo-core's ``_linear_warmup(lr, c, W, min) = min + (lr - min) * min(c, W) / W``; warmup applies while
``current < warmup`` for the cosine/linear schedules.
"""

from __future__ import annotations

import math
from typing import Callable

from olmax.config import SchedulerConfig
from olmax.errors import ConfigError

def _linear_warmup(peak: float, current: int, warmup: int, warmup_min_lr: float) -> float:
    return warmup_min_lr + (peak - warmup_min_lr) * min(current, warmup) / warmup


def constant(peak: float, current: int, t_max: int) -> float:
    del current, t_max
    return peak


def _warmup_then(decay: Callable[[float, float, int, int], float], peak: float, current: int,
                 t_max: int, warmup: int, alpha_f: float, warmup_min_lr: float,
                 warmup_peak: float | None = None) -> float:
    """OLMo-core's shared frame: warmup while ``current < warmup``, ``eta_min`` from ``t_max`` on,
    else ``decay(peak, eta_min, current - warmup, t_max - warmup)``."""
    eta_min = peak * alpha_f
    if current < warmup:
        top = peak if warmup_peak is None else warmup_peak
        return _linear_warmup(top, current, warmup, warmup_min_lr)
    if current >= t_max:
        return eta_min
    return decay(peak, eta_min, current - warmup, t_max - warmup)


def _cosine(peak: float, eta_min: float, c: float, t: float) -> float:
    return eta_min + (peak - eta_min) * (1 + math.cos(math.pi * c / t)) / 2


def cos_with_warmup(peak: float, current: int, t_max: int, *, warmup: int, alpha_f: float = 0.1,
                    warmup_min_lr: float = 0.0) -> float:
    return _warmup_then(_cosine, peak, current, t_max, warmup, alpha_f, warmup_min_lr)


def half_cos_with_warmup(peak: float, current: int, t_max: int, *, warmup: int,
                         alpha_f: float = 0.1, warmup_min_lr: float = 0.0) -> float:
    eta_min = peak * alpha_f
    return _warmup_then(lambda p, e, c, t: _cosine(p, e, c + t, 2 * t), peak, current, t_max,
                        warmup, alpha_f, warmup_min_lr, warmup_peak=eta_min + (peak - eta_min) / 2)


def linear_with_warmup(peak: float, current: int, t_max: int, *, warmup: int,
                       alpha_f: float = 0.1, warmup_min_lr: float = 0.0) -> float:
    return _warmup_then(lambda p, e, c, t: p - (p - e) * (c / t), peak, current, t_max, warmup,
                        alpha_f, warmup_min_lr)


def build_schedule(cfg: SchedulerConfig, peak_lr: float, max_steps: int) -> Callable[[int], float]:
    """``step -> lr`` (step counted from 1) for a scheduler config; ``t_max`` defaults to max_steps."""
    t_max = cfg.t_max if cfg.t_max is not None else max_steps
    if cfg.name == "constant":
        return lambda step: constant(peak_lr, step, t_max)
    if cfg.warmup_steps < 0 or t_max <= 0:
        raise ConfigError(f"scheduler: warmup_steps ({cfg.warmup_steps}) must be >= 0 and t_max "
                          f"({t_max}) positive")
    if cfg.warmup_steps > 0 and not 0 <= cfg.warmup_min_lr < peak_lr:
        raise ConfigError(f"scheduler.warmup_min_lr ({cfg.warmup_min_lr}) must be in [0, optim.lr)")
    fn = {"cos_with_warmup": cos_with_warmup, "half_cos_with_warmup": half_cos_with_warmup,
          "linear_with_warmup": linear_with_warmup}[cfg.name]
    kw = dict(warmup=cfg.warmup_steps, alpha_f=cfg.alpha_f, warmup_min_lr=cfg.warmup_min_lr)
    return lambda step: fn(peak_lr, step, t_max, **kw)
