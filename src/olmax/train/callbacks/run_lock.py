"""One trainer per run directory: ``RUN_DIR/.olmax-lock`` (:mod:`olmax.lockfile`; in a bucket
:mod:`olmax.bucket_lock`) as a callback.

Process 0 takes the lock before anything else is read or written there, holds it for the whole
run, and checks at every step, before the step's line or checkpoint is written, that the lock is
still its own: a run whose directory was taken over (by a later attempt of its job, or after its
heartbeat stalled) stops without writing. In a multi-process job the outcome of taking the lock is
shared with every process, so all of them stop when the directory is taken.

An asynchronous checkpoint save that was in flight when the attempt was superseded (paused, say)
goes on when the process resumes, before its next step's check; its commit is fenced by the same
check (:mod:`olmax.checkpoint.fence`), so it is dropped, and it was written in a temporary directory
of its own, which the newer attempt's save of the same step never shares.

A trainer started by a scheduler is told its attempt (``olmax train --attempt JOB.N``): it takes
over the lock of an earlier attempt of the same job at once, and waits out a fresh lock of anyone
else (the lock's stale time plus two heartbeats) before it gives up, since a holder that died on
another host looks alive until its heartbeat is that old.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from olmax.errors import OlmaxError, RestartableError
from olmax.bucket_lock import BucketLock
from olmax.lockfile import LockFile, LockHeld
from olmax.store import is_bucket, join, run_location
from olmax.train.callbacks.base import Callback

log = logging.getLogger(__name__)

LOCK_NAME = ".olmax-lock"


class RunDirInUse(OlmaxError):
    """Another trainer holds the run directory (exit 2; 75 when a later attempt of this process's
    own job holds it: the scheduler has moved on and decides what happens next)."""


class RunDirLockLost(RestartableError):
    """The lock was taken over while this process held it."""


class RunLock(Callback):
    """Process 0's lock of the run directory (see the module docstring)."""

    order = 0   # before every other callback: a run that lost its directory stops at once

    def __init__(self, run_dir: str | os.PathLike, *, attempt: str | None = None,
                 stale_after: float | None = None, heartbeat: float | None = None) -> None:
        self.run_dir = run_location(run_dir)
        kind = BucketLock if is_bucket(self.run_dir) else LockFile
        self.lock = kind(join(self.run_dir, LOCK_NAME), subject=f"run directory {self.run_dir}",
                         user="olmax train", hint="use another --run-dir or stop that run",
                         stale_after=stale_after, heartbeat=heartbeat, attempt=attempt)

    @property
    def path(self) -> Path:
        return self.lock.path

    @property
    def took_over(self) -> str | None:
        return self.lock.took_over

    def acquire(self) -> "RunLock":
        wait = (self.lock.stale_after + 2 * self.lock.heartbeat) if self.lock.attempt else 0.0
        try:
            self.lock.acquire(wait_s=wait, on_wait=log.info)
        except LockHeld as e:
            error = RunDirInUse(str(e))
            if self.lock._newer_attempt(e.holder):
                error.exit_code = RestartableError.exit_code
            raise error from None
        if self.lock.took_over:
            log.info(f"olmax train: {self.lock.took_over}")
        return self

    def check(self) -> None:
        """Raise :class:`RunDirLockLost` when the lock file no longer holds this process's token."""
        if not self.lock.verify():
            raise RunDirLockLost(f"stopping: {self.lock.lost}")

    def on_step_end(self, run: Any, step: int, metrics: Any) -> None:
        self.check()

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        self.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class NoLock(Callback):
    """What processes other than 0 hold: nothing, with the same hooks."""

    def check(self) -> None:
        pass

    def release(self) -> None:
        pass


def lock_run_dir(run_dir: str | os.PathLike, *, is_main: bool = True,
                 attempt: str | None = None) -> RunLock | NoLock:
    """Process 0 takes the run directory's lock; in a multi-process job every process learns the
    outcome and raises the same kind of error (with the same exit status) when it failed."""
    error: OlmaxError | None = None
    lock: RunLock | NoLock = NoLock()
    if is_main:
        try:
            lock = RunLock(run_dir, attempt=attempt).acquire()
        except OlmaxError as e:
            error = e
    if jax.process_count() > 1:
        code = int(multihost_utils.broadcast_one_to_all(
            np.int32(0 if error is None else error.exit_code)))
        if code and error is None:
            error = RunDirInUse(f"run directory {run_dir}: process 0 could not lock it (see its "
                                "message)")
            error.exit_code = code
    if error is not None:
        raise error
    return lock


__all__ = ["RunLock", "NoLock", "RunDirInUse", "RunDirLockLost", "lock_run_dir", "LOCK_NAME"]
