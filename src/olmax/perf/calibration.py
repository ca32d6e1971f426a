"""How far ``olmax plan``'s step-time estimate has been checked against measurements, per
accelerator generation: ``estimate.calibration`` of every plan.

The table (``calibration.json`` beside this module, package data) is written by
``benchmarks/calibrate.py``: for each calibration case (a peer's published run, its program
compiled ahead of time and put through the plan's own estimation method) the measured and the
estimated step time and their ratio. Nothing here corrects an estimate: the cases say how far off
the method was where it could be checked, as they are; no factor is fitted to them. A generation
without a case is ``"uncalibrated"``.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from olmax.hardware import Accelerator, accelerator_of

UNCALIBRATED = "uncalibrated"


@functools.cache
def table() -> dict:
    """The shipped table (empty when the package carries none)."""
    try:
        text = resources.files("olmax.perf").joinpath("calibration.json").read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return {}
    return json.loads(text)


def for_accelerator(acc: Accelerator | None, data: dict | None = None) -> dict | str:
    """``estimate.calibration`` for a target of generation ``acc``: its cases (measured, estimated,
    ratio measured / estimated, source) and their ratio range, or ``"uncalibrated"``."""
    data = table() if data is None else data
    if acc is None:
        return UNCALIBRATED
    cases = [c for c in data.get("cases", []) if _family(c.get("accelerator")) == _family(acc.name)]
    rated = [c for c in cases if c.get("ratio") is not None]
    if not rated:
        return UNCALIBRATED
    ratios = [c["ratio"] for c in rated]
    return {"accelerator": acc.name, "family": _family(acc.name),
            "method": data.get("method"),
            "ratio": "measured step time / estimated step time (> 1: the estimate is optimistic)",
            "ratio_range": [min(ratios), max(ratios)],
            "cases": [{k: c.get(k) for k in ("case", "measured_step_s", "estimated_step_s", "ratio",
                                              "convention", "source")} for c in rated],
            "generated": data.get("generated")}


def _family(name: str | None) -> str | None:
    """A GPU is checked by the cases of every GPU its kernels are priced like (the same measured
    rates table, :attr:`olmax.hardware.Accelerator.rates`); a TPU by its own generation's."""
    from olmax.hardware import BY_NAME

    acc = BY_NAME.get(name or "")
    return None if acc is None else (acc.rates or acc.name)


def for_device(device: Any) -> dict | str:
    return for_accelerator(accelerator_of(device))


def summary(cal: dict | str) -> str:
    """One line for ``olmax plan``'s summary."""
    if not isinstance(cal, dict):
        return f"{cal} (no calibration case with an estimate on this accelerator)"
    lo, hi = cal["ratio_range"]
    names = ", ".join(c["case"] for c in cal["cases"])
    return (f"measured / estimated step time {lo:.2f}-{hi:.2f} over {len(cal['cases'])} case(s) "
            f"on {cal['accelerator']} ({names}); not applied to the estimate")
