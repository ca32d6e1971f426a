"""One writer per run directory: an exclusive lock file that also works on shared storage.

``olmax train`` holds ``RUN_DIR/.olmax-lock`` from start to end. A second trainer on the same
directory (on this host or any other that mounts it) stops before it reads or writes anything
else there, with one line naming the holder's pid and host.

Why a lock *file* and not ``flock``/``fcntl``: advisory locks are per host on many shared file
systems (Lustre mounted without ``-o flock``, GCS-fuse, NFS without a working lock manager) and
silently succeed on both hosts. Creating a file with ``O_CREAT | O_EXCL`` is atomic on local file
systems, NFSv3+ and Lustre; on stores where it may not be (object-store mounts that upload at
close), the writer reads the file back and holds the lock only if the token in it is its own.

The file holds JSON: ``pid``, ``host``, a random ``token``, ``started``, the command line, and the
process identity used for same-host checks (``boot_id``, the pid namespace, the process start
time). While the run lives, a background thread touches the file every ``HEARTBEAT_S`` seconds
(its mtime is the heartbeat) after checking the token is still its own.

A lock is *stale*, and is taken over, when

- its holder ran on this host, in the same pid namespace, and that process is gone (or the pid now
  belongs to a process started at another time); this is decided at once, so a run killed with
  ``kill -9`` restarts immediately on the same host; or
- its heartbeat is older than ``stale_after`` seconds (default 120, ``OLMAX_RUN_LOCK_STALE_S``),
  judged by the file system's own clock (the mtime of a probe file written beside the lock), so
  clock skew between hosts does not matter. This covers a holder on another host that died.

Taking over renames the stale file aside and checks that what was moved is the stale lock that was
judged (two processes taking over at once cannot both win). A holder whose heartbeat finds its
token gone stops at the next step with an error (:meth:`RunDirLock.on_step_end`).

In a multi-process job (one run over several hosts) process 0 holds the lock for the job; the
outcome is shared with every process, so all of them stop when the directory is taken.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from olmax.config import OlmaxError
from olmax.train.callbacks.base import Callback

LOCK_NAME = ".olmax-lock"
HEARTBEAT_S = 15.0
STALE_S = 120.0
STALE_ENV = "OLMAX_RUN_LOCK_STALE_S"
HEARTBEAT_ENV = "OLMAX_RUN_LOCK_HEARTBEAT_S"


class RunDirInUse(OlmaxError):
    """Another process holds the run directory."""


class RunDirLockLost(OlmaxError):
    """The lock was taken over while this process held it (its heartbeat stalled too long)."""


def _read_text(path: str) -> str | None:
    """The file's text (bytes that are not UTF-8 replaced: a lock file olmax did not write is
    judged like any other unreadable one), or None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def _proc_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), to tell a reused pid apart."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    try:
        return text[text.rindex(")") + 2:].split()[19]
    except (ValueError, IndexError):
        return None


def _pid_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def identity() -> dict[str, Any]:
    """Who this process is, as a lock file records it."""
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "boot_id": boot.strip() if boot else None, "pid_ns": _pid_ns(),
            "proc_start": _proc_start(os.getpid())}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's process
        return True
    except OSError:
        return True
    return True


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise OlmaxError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise OlmaxError(f"{name} must be positive (got {raw})")
    return value


def describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"


class RunDirLock(Callback):
    """The lock of one run directory (see the module docstring). ``acquire`` creates the directory
    if needed; ``release`` removes the lock file (and the directory, if this lock created it and
    nothing else was written there)."""

    def __init__(self, run_dir: str | os.PathLike, *, stale_after: float | None = None,
                 heartbeat: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.stale_after = stale_after or _env_seconds(STALE_ENV, STALE_S)
        self.heartbeat = heartbeat or _env_seconds(HEARTBEAT_ENV, HEARTBEAT_S)
        self.token: str | None = None
        self.lost: str | None = None
        self.took_over: str | None = None     # why a stale lock was taken over, if one was
        self._created_dir = False
        self._written: set[str] = set()       # tokens of the lock files this object created
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- acquire -------------------------------------------------------------------------------

    def _make_dir(self) -> None:
        d = self.run_dir
        if d.exists() and not d.is_dir():
            raise OlmaxError(f"run directory {d} exists and is not a directory")
        created = not d.exists()
        try:
            d.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise OlmaxError(f"run directory {d}: a parent path is a file, not a directory") from None
        except NotADirectoryError:
            raise OlmaxError(f"run directory {d}: a parent path is a file, not a directory") from None
        except OSError as e:
            raise OlmaxError(f"cannot create run directory {d}: {e.strerror or e}") from None
        self._created_dir = created

    def acquire(self) -> "RunDirLock":
        self._make_dir()
        for attempt in range(20):
            holder = self._try_create()
            if holder is not None and holder.get("token") in self._written:
                # Our file, moved aside by a racing taker who found it was not the stale lock it
                # judged, and put back (:meth:`_take_over`) while we were reading it.
                self.token, holder = holder["token"], None
            if holder is None:
                self._start_heartbeat()
                return self
            if not holder and attempt < 10 and self.path.exists():
                time.sleep(0.2)     # being written by its creator right now: read it again
                continue
            why = self._stale_reason(holder)
            if why is None:
                self._cleanup_dir()
                raise RunDirInUse(self._in_use_message(holder))
            if self._take_over(holder):
                who = describe(holder) if holder else "an unknown holder"
                self.took_over = f"took over a stale lock of {who} ({why})"
        self._cleanup_dir()
        raise RunDirInUse(f"run directory {self.run_dir} is contended: could not take its lock "
                          f"({self.path}) after several tries")

    def _in_use_message(self, holder: dict) -> str:
        if not holder:
            age = self._heartbeat_age()
            return (f"run directory {self.run_dir} holds a lock file olmax cannot read, {self.path} "
                    f"(not the JSON olmax train writes; changed {age or 0:.0f} s ago); it is taken "
                    f"over {self.stale_after:.0f} s after its last change, or remove it if no "
                    f"olmax train uses {self.run_dir}")
        since = f" since {holder['started']}" if holder.get("started") else ""
        text = (f"run directory {self.run_dir} is in use by olmax train {describe(holder)}{since}; "
                f"use another --run-dir or stop that run")
        if holder.get("host") != socket.gethostname():
            age = self._heartbeat_age()
            beat = f"last heartbeat {age:.0f} s ago; " if age is not None else ""
            text += (f" ({beat}its lock {self.path} is taken over after {self.stale_after:.0f} s "
                     f"without a heartbeat)")
        return text

    def _try_create(self) -> dict | None:
        """Create the lock file; None when it is ours, else the holder's record."""
        token = secrets.token_hex(16)
        record = {**identity(), "token": token,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "command": sys.argv}
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return self._holder()
        except OSError as e:
            self._cleanup_dir()
            raise OlmaxError(f"run directory {self.run_dir} is not writable: "
                             f"{e.strerror or e}") from None
        self._written.add(token)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError:       # e.g. an object-store mount refusing the upload: someone else won
            return self._holder()
        got = self._holder()
        if got.get("token") != token:
            return got
        self.token = token
        return None

    def _holder(self) -> dict:
        """The lock file's record; ``{}`` when it is missing, empty or unreadable."""
        text = _read_text(str(self.path))
        if not text:
            return {}
        try:
            data = json.loads(text)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    # -- staleness -----------------------------------------------------------------------------

    def _fs_now(self) -> float:
        """The file system's current time: the mtime of a probe file written beside the lock."""
        probe = self.run_dir / f"{LOCK_NAME}.probe-{secrets.token_hex(6)}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            return os.stat(probe).st_mtime
        except OSError:
            return time.time()
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass

    def _heartbeat_age(self) -> float | None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return None
        return max(0.0, self._fs_now() - mtime)

    def _stale_reason(self, holder: dict) -> str | None:
        """Why the lock held by ``holder`` is stale, or None when its holder may be alive."""
        if not self.path.exists():
            return "its file is gone"
        me = identity()
        pid = holder.get("pid")
        same_process_space = (holder.get("host") == me["host"] and isinstance(pid, int)
                              and holder.get("boot_id") == me["boot_id"] is not None
                              and holder.get("pid_ns") == me["pid_ns"] is not None)
        if same_process_space:       # decided at once: is that process still there?
            if not _pid_alive(pid):
                return f"process {pid} is gone"
            start = holder.get("proc_start")
            if start is not None and _proc_start(pid) not in (None, start):
                return f"pid {pid} now belongs to another process"
            return None
        age = self._heartbeat_age()
        if age is None:
            return "its file is gone"
        if age > self.stale_after:
            what = "an unreadable lock file" if not holder else "no heartbeat"
            return f"{what} for {age:.0f} s"
        return None

    def _take_over(self, holder: dict) -> bool:
        """Move the stale lock aside; True when what was moved is the lock judged stale (if not, a
        new holder's lock was moved by mistake: it is put back)."""
        aside = self.run_dir / f"{LOCK_NAME}.stale-{secrets.token_hex(6)}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False           # somebody else moved it first
        except OSError as e:
            raise OlmaxError(f"cannot take over the stale lock {self.path}: {e.strerror or e}") from None
        moved = _read_text(str(aside))
        try:
            moved_token = json.loads(moved).get("token") if moved else None
        except (ValueError, AttributeError):
            moved_token = None
        if moved_token != holder.get("token"):
            try:           # a live holder's lock: give it back unless the slot was taken again
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "w") as f:
                    f.write(moved or "")
            except OSError:
                pass
            try:
                os.unlink(aside)
            except OSError:
                pass
            return False
        try:
            os.unlink(aside)
        except OSError:
            pass
        return True

    # -- holding -------------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="olmax-run-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            self.refresh()

    def refresh(self) -> None:
        """One heartbeat: check the token is still ours, touch the file."""
        if self.token is None or self.lost:
            return
        holder = self._holder()
        if holder.get("token") != self.token:
            self.lost = (f"the run directory {self.run_dir} was taken over by "
                         f"{describe(holder) if holder else 'another process'} (its lock file "
                         f"{self.path} no longer holds this process's token)")
            return
        try:
            os.utime(self.path)
        except OSError:
            pass      # a transient storage error; the next beat tries again

    def check(self) -> None:
        if self.lost:
            raise RunDirLockLost(f"stopping: {self.lost}")

    order = 0   # before every other callback: a run that lost its directory stops at once

    def on_step_end(self, run: Any, step: int, metrics: Any) -> None:
        """Trainer callback hook: stop the run when the lock was lost."""
        self.check()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.token is None:
            return
        if self._holder().get("token") == self.token:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self.token = None
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        """Remove the run directory when this lock created it and nothing else is in it."""
        if self._created_dir:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass
            self._created_dir = False

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class _Follower(Callback):
    """What processes other than 0 hold: nothing, with the same hooks."""

    lost = None

    def check(self) -> None:
        pass

    def release(self) -> None:
        pass


def lock_run_dir(run_dir: str | os.PathLike, *, is_main: bool = True) -> RunDirLock | _Follower:
    """Process 0 takes the run directory's lock; in a multi-process job every process learns the
    outcome and raises the same kind of error when the directory is taken."""
    error: OlmaxError | None = None
    lock: RunDirLock | _Follower = _Follower()
    if is_main:
        try:
            lock = RunDirLock(run_dir).acquire()
        except OlmaxError as e:
            error = e
    if jax.process_count() > 1:
        failed = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if failed and error is None:
            error = RunDirInUse(f"run directory {run_dir}: process 0 could not lock it (see its "
                                "message)")
    if error is not None:
        raise error
    if isinstance(lock, RunDirLock) and lock.took_over:
        print(f"olmax train: {lock.took_over}", file=sys.stderr, flush=True)
    return lock


__all__ = ["RunDirLock", "RunDirInUse", "RunDirLockLost", "lock_run_dir", "LOCK_NAME"]
