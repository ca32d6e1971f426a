"""Run-directory logging: ``metrics.jsonl`` (one JSON object per line), TensorBoard, optional W&B.

Only process 0 writes. ``metrics.jsonl`` lines are written whole and flushed, so a killed run leaves
at most one torn last line (which a resume drops). TensorBoard events go to ``RUN_DIR/tb``: a resumed
run starts its event file with a purge marker at its first step (``purge_step``), so TensorBoard hides
what the interrupted run had logged from that step on and each step shows once, as in
``metrics.jsonl``. W&B (if ``logging.wandb`` and the package is installed) runs offline unless
``WANDB_MODE`` says otherwise.

In a bucket (``s3://``, ``gs://``: :mod:`olmax.store`) an object cannot be appended to, so the
metrics are **rolled segments**, ``RUN_DIR/metrics/000000.jsonl``, ``000001.jsonl``, ... (read in
order they are ``metrics.jsonl``): the current segment is uploaded whole every
``logging.flush_s`` seconds (30 by default), before every checkpoint save and at the end, and a
new one is started every :data:`SEGMENT_LINES` lines and by every start of the run. A kill loses
at most the lines since the last upload, and never a line of a step a checkpoint holds (the
upload comes before the save), so a resumed run neither repeats nor misses a step. TensorBoard
events are written to node-local scratch and uploaded to ``RUN_DIR/tb/`` at the same times.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from olmax import store
from olmax.config import LoggingConfig
from olmax.io import write_bytes_atomic, write_error

SEGMENTS = "metrics"         # RUN_DIR/metrics/NNNNNN.jsonl in a bucket
SEGMENT_LINES = 1000

log = logging.getLogger(__name__)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # "nan" / "inf": JSON has no literal for them
    return v


def metrics_location(run_dir: str | os.PathLike) -> Any:
    """Where a run's metrics are: ``RUN_DIR/metrics.jsonl``, or in a bucket the segments'
    prefix ``RUN_DIR/metrics``."""
    return store.join(run_dir, SEGMENTS if store.is_bucket(str(run_dir)) else "metrics.jsonl")


class _Segments:
    """The metrics of a run in a bucket: lines buffered, the current segment uploaded whole."""

    def __init__(self, prefix: str, flush_s: float) -> None:
        names = store.segment_names(prefix)
        self.prefix, self.flush_s = prefix, flush_s
        self.index = int(names[-1][:-6]) + 1 if names else 0
        self.lines: list[str] = []
        self.dirty = False
        self.last = time.monotonic()

    @property
    def url(self) -> str:
        return f"{self.prefix}/{self.index:06d}.jsonl"

    def add(self, line: str) -> bool:
        """Buffer a line; True when it is time to upload."""
        self.lines.append(line)
        self.dirty = True
        return len(self.lines) >= SEGMENT_LINES or time.monotonic() - self.last >= self.flush_s

    def flush(self) -> None:
        if self.dirty:
            store.write(self.url, "".join(self.lines).encode())
            self.dirty = False
        self.last = time.monotonic()
        if len(self.lines) >= SEGMENT_LINES:
            self.index += 1
            self.lines = []


class MetricsLogger:
    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, *, enabled: bool = True,
                 run_config: Mapping[str, Any] | None = None, filename: str = "metrics.jsonl",
                 purge_step: int | None = None) -> None:
        self.enabled = enabled
        self.remote = store.is_bucket(str(run_dir))
        self.path = store.join(run_dir, SEGMENTS if self.remote else filename)
        self._file = None
        self._segments: _Segments | None = None
        self._tb = None
        self._tb_local: Path | None = None     # node-local scratch of a bucket run's events
        self._tb_remote = store.join(run_dir, "tb")
        self._wandb = None
        if not enabled:
            return
        if self.remote:
            self._segments = _Segments(self.path, cfg.flush_s)
        else:
            self._file = open(self.path, "a", encoding="utf-8")
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            tb_dir = self._tb_remote
            had = store.listdir(tb_dir) if self.remote else tb_dir.is_dir()
            if self.remote:
                self._tb_local = Path(tempfile.mkdtemp(prefix="olmax-tb-"))
                tb_dir = self._tb_local
            # Events of an earlier attempt at steps >= purge_step are orphans of an interruption.
            purge = purge_step if purge_step is not None and had else None
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
        due = False
        if self._segments is not None:
            due = self._segments.add(json.dumps(record) + "\n")
        else:
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
        if due:
            self.flush()

    def flush(self) -> None:
        """Upload what a bucket run has logged (the current segment, the TensorBoard events)."""
        if self._segments is None:
            return
        self._segments.flush()
        if self._tb is not None and self._tb_local is not None:
            self._tb.flush()
            for f in sorted(self._tb_local.iterdir()):
                store.write(store.join(self._tb_remote, f.name), f.read_bytes())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._segments is not None:
            try:
                self.flush()
            finally:
                self._segments = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._tb_local is not None:
            shutil.rmtree(self._tb_local, ignore_errors=True)
            self._tb_local = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def rewind_jsonl(path: str | os.PathLike, step: int) -> int:
    """Drop the lines of a metrics file whose ``"step"`` is greater than ``step`` (atomically).

    A resumed run calls this with the restored step before logging again, so the file reads exactly
    like an uninterrupted run's: each step once, in order. A torn last line (the writer was killed
    mid-write) is dropped too. Returns the number of lines dropped.
    """
    if store.is_bucket(str(path)):
        return _rewind_segments(str(path), step)
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


def _rewind_segments(prefix: str, step: int) -> int:
    """:func:`rewind_jsonl` for a bucket run's segments: each segment with lines of later steps
    is rewritten without them (deleted when none is left), newest first."""
    dropped = 0
    for name in reversed(store.segment_names(prefix)):
        url = f"{prefix}/{name}"
        lines = (store.read(url) or b"").decode("utf-8", errors="replace").splitlines()
        keep = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
                continue
            keep.append(line)
        if len(keep) == len(lines):
            break       # this segment and the earlier ones end at or before ``step``
        dropped += len(lines) - len(keep)
        if keep:
            store.write(url, "".join(line + "\n" for line in keep).encode())
        else:
            store.delete(url)
    return dropped
