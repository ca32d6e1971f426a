"""Run-directory logging: ``metrics.jsonl`` (one JSON object per line), TensorBoard, optional W&B.

Only process 0 writes. ``metrics.jsonl`` lines are written whole and flushed, so a killed run leaves
at most one torn last line (which a resume drops). TensorBoard events go to ``RUN_DIR/tb``: a resumed
run starts its event file with a purge marker at its first step (``purge_step``), so TensorBoard hides
what the interrupted run had logged from that step on and each step shows once, as in
``metrics.jsonl``. W&B (if ``logging.wandb`` and the package is installed) runs offline unless
``WANDB_MODE`` says otherwise.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping

from olmax.config import LoggingConfig
from olmax.io import write_bytes_atomic, write_error

log = logging.getLogger(__name__)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # "nan" / "inf": JSON has no literal for them
    return v


class MetricsLogger:
    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, *, enabled: bool = True,
                 run_config: Mapping[str, Any] | None = None, filename: str = "metrics.jsonl",
                 purge_step: int | None = None) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / filename
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self._file = open(self.path, "a", encoding="utf-8")
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            tb_dir = Path(run_dir) / "tb"
            # Events of an earlier attempt at steps >= purge_step are orphans of an interruption.
            purge = purge_step if purge_step is not None and tb_dir.is_dir() else None
            self._tb = SummaryWriter(logdir=str(tb_dir), purge_step=purge)
        if cfg.wandb:
            try:
                import wandb  # type: ignore[import-not-found]
            except ImportError:
                log.warning("logging.wandb=true but wandb is not installed; skipping W&B")
            else:
                os.environ.setdefault("WANDB_MODE", "offline")
                self._wandb = wandb.init(project=cfg.wandb_project or "olmax", dir=str(run_dir),
                                         config=dict(run_config or {}), resume="allow")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:   # a full disk: name the file
            raise write_error(self.path, e) from None
        numeric = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k if "/" in k else f"train/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def rewind_jsonl(path: str | os.PathLike, step: int) -> int:
    """Drop the lines of a metrics file whose ``"step"`` is greater than ``step`` (atomically).

    A resumed run calls this with the restored step before logging again, so the file reads exactly
    like an uninterrupted run's: each step once, in order. A torn last line (the writer was killed
    mid-write) is dropped too. Returns the number of lines dropped.
    """
    p = Path(path)
    if not p.is_file():
        return 0
    keep, dropped = [], 0
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
            dropped += 1
            continue
        keep.append(line)
    if dropped:
        write_bytes_atomic(p, "".join(line + "\n" for line in keep).encode())
    return dropped
