"""The watchdog: a run whose steps stopped completing dumps every thread's stack and exits 75.

A collective that never completes (a peer stopped or wedged, a driver stall, an NCCL or ICI hang)
keeps every process of a job alive and idle; JAX's coordination service notices only processes
that died. With ``train.watchdog_s`` set, a thread of each process checks that a step completed in
the last ``watchdog_s`` seconds. When none did, it writes the Python stack of every thread to
``RUN_DIR/hangs/<host>-<pid>.txt``, prints one line and ends the process with exit status 75, so
that the scheduler restarts the job (the peers of a hung process are stuck in the same collective
and exit the same way, by their own watchdogs). The run resumes from its last checkpoint.

Counted from the end of each step: the time of everything done between two steps (an in-loop
evaluation, a checkpoint save that must complete) is part of the next step's allowance, so the
limit must exceed the longest step plus evaluation plus save. The first step, which compiles the
program, gets :data:`FIRST_STEP_S` more; the end of the run (the last save) gets the limit again.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from olmax import store
from olmax.config import RunConfig
from olmax.errors import EXIT_RESTART
from olmax.train.callbacks.base import Callback, RunView

FIRST_STEP_S = 3600.0     # the first step compiles the training step (minutes for a 7B model)
EXIT_CODE = EXIT_RESTART


class Watchdog(Callback):
    order = 1     # right after the step (and the run lock's check), before evaluations and saves

    def __init__(self, limit_s: float, first_step_s: float = FIRST_STEP_S) -> None:
        self.limit_s = float(limit_s)
        self.first_step_s = float(first_step_s)
        self.hang_dir: Any = None       # a Path, or a bucket path
        self._last = time.monotonic()
        self._allowance = self.limit_s + self.first_step_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "Watchdog | None":
        return cls(cfg.train.watchdog_s) if cfg.train.watchdog_s else None

    def on_train_start(self, run: RunView) -> None:
        self.hang_dir = store.join(run.run_dir, "hangs")
        self._last, self._allowance = time.monotonic(), self.limit_s + self.first_step_s
        self._thread = threading.Thread(target=self._watch, name="olmax-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last, self._allowance = time.monotonic(), self.limit_s

    def on_step_end(self, run: RunView, step: int, metrics: Mapping[str, Any]) -> None:
        self.beat()

    def on_train_end(self, run: RunView) -> None:
        self.beat()     # the final save and evaluation get the limit again

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, max(0.05, self.limit_s / 10))):
            idle = time.monotonic() - self._last
            if idle > self._allowance:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        where = "(no run directory)"
        try:
            assert self.hang_dir is not None
            name = f"{socket.gethostname()}-{os.getpid()}.txt"
            remote = store.is_bucket(self.hang_dir)
            if remote:          # the stacks go to node-local scratch, then to the bucket
                path = Path(tempfile.gettempdir()) / f"olmax-hang-{name}"
            else:
                self.hang_dir.mkdir(parents=True, exist_ok=True)
                path = self.hang_dir / name
            with open(path, "w") as f:
                f.write(f"olmax train watchdog: no step completed in {idle:.0f} s "
                        f"(train.watchdog_s={self.limit_s:g}) at "
                        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; command: "
                        f"{' '.join(sys.argv)}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = str(path)
            if remote:
                where = store.join(self.hang_dir, name)
                store.write(where, path.read_bytes())
        except Exception as e:  # the exit must happen whatever the storage does
            where = f"(could not write the stacks: {e})"
        print(f"olmax train: error: watchdog: no step completed in {idle:.0f} s "
              f"(train.watchdog_s={self.limit_s:g}); every thread's stack is in {where}; exiting "
              f"with {EXIT_CODE} to be restarted", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)
