"""An exclusive lock file that also works on shared storage (the standard library only).

One holder at a time: ``olmax train`` holds its run directory's ``.olmax-lock``, and a process
building a shared cache file (the epoch order) holds ``<file>.lock`` while the others wait for the
file. A second taker, on this host or any other that mounts the storage, learns who holds it.

Why a lock *file* and not ``flock``/``fcntl``: advisory locks are per host on many shared file
systems (Lustre mounted without ``-o flock``, GCS-fuse, NFS without a working lock manager) and
silently succeed on both hosts. Creating a file with ``O_CREAT | O_EXCL`` is atomic on local file
systems, NFSv3+ and Lustre; on stores where it may not be (object-store mounts that upload at
close), the writer reads the file back and holds the lock only if the token in it is its own.

The file holds JSON: ``pid``, ``host``, a random ``token``, ``started``, the command line, the
process identity used for same-host checks (``boot_id``, the pid namespace, the process start
time) and, for a process a scheduler started, its ``attempt`` (``JOB.N``: the job and its restart
count). While the holder lives, a background thread touches the file every ``heartbeat`` seconds
(its mtime is the heartbeat) after checking the token is still its own.

:meth:`LockFile.acquire` is a loop over one attempt (:meth:`LockFile._attempt`): create the file
with ``O_EXCL``, or read who holds it and judge:

====================================================  ======================  ==============================
the holder (its record, its file)                     the taker's judgement   the taker's action
====================================================  ======================  ==============================
none: the file was created, its token reads back      ours                    hold it, start the heartbeat
our own record, put back by a racing taker            ours                    hold it
unreadable, the file present                          being written           read again (10 times, 0.2 s)
an earlier attempt of this job (``JOB.M``, M < N)     stale, at once          take over
this host and pid namespace, and the process gone,    stale, at once          take over (a run killed with
its pid reused, or a pid no process can have                                  ``kill -9`` restarts at once)
another host, no heartbeat (or unreadable) for        stale                   take over
``stale_after`` s by the file system's clock
(default 120 s, ``OLMAX_RUN_LOCK_STALE_S``)
a later attempt of this job                           it replaced this one    refuse at once (LockHeld)
alive: its process, or a fresh heartbeat              held                    wait up to ``wait_s``, then
                                                                              refuse (LockHeld)
====================================================  ======================  ==============================

An attempt to take over that loses (the lock changed meanwhile, the guard stayed busy) is followed
by another attempt; after :data:`MAX_TAKEOVERS` takeovers the lock is "contended" (LockHeld).
A scheduler starts attempt N of a job only to replace attempt M < N, wherever M ran; the same
attempt (a pod the scheduler replaced within it) is judged like any other holder.

Taking over happens under a guard, ``<lock>.takeover`` (:class:`TakeoverGuard`, created with
``O_EXCL``; one taker at a time): the taker reads the lock again, judges it again, renames it aside
and checks that what was moved is the stale lock it judged. Without the guard, takers that judged
the same stale lock could each move aside a lock a racing creator had just written, and put it
back only after the slot had changed hands, so that every racer saw another's record and none held
the lock. A guard whose holder died is broken like a lock (at once on this host; by its age
elsewhere). A holder whose heartbeat (or :meth:`LockFile.verify`) finds its token gone has lost the
lock (:attr:`LockFile.lost`).
``acquire(wait_s=...)`` waits for a live holder to release the lock or go stale, up to that long.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from olmax.errors import OlmaxError

HEARTBEAT_S = 15.0
STALE_S = 120.0
GUARD_STALE_S = 30.0     # a takeover lasts milliseconds; a guard this old was left by a dead taker
GUARD_WAIT_S = 90.0
UNREADABLE_READS = 10    # a lock file being written is read again this often, 0.2 s apart
MAX_TAKEOVERS = 20       # stale locks taken over (or tried) before "contended"
STALE_ENV = "OLMAX_RUN_LOCK_STALE_S"
HEARTBEAT_ENV = "OLMAX_RUN_LOCK_HEARTBEAT_S"
_ATTEMPT = re.compile(r"([A-Za-z0-9_-]{1,128})\.(\d{1,9})")


class LockHeld(OlmaxError):
    """Another process holds the lock (``holder``: its record, ``{}`` when unreadable)."""

    def __init__(self, message: str, holder: dict | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


def parse_attempt(text: str) -> tuple[str, int]:
    """``JOB.N`` -> (JOB, N): a job id (letters, digits, ``_``, ``-``) and its restart count."""
    m = _ATTEMPT.fullmatch(text)
    if not m:
        raise OlmaxError(f"attempt {text!r}: expected JOB.N, a job id (letters, digits, _ and -) "
                         "and a restart count, e.g. 4242.0")
    return m.group(1), int(m.group(2))


def _read_text(path: str) -> str | None:
    """The file's text (bytes that are not UTF-8 replaced: a lock file olmax did not write is
    judged like any other unreadable one), or None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def _proc_stat(pid: int, field: int) -> str | None:
    """Field ``field`` (after the command name; 0: the state) of ``/proc/<pid>/stat`` (Linux)."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    try:
        return text[text.rindex(")") + 2:].split()[field]
    except (ValueError, IndexError):
        return None


def _proc_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot, to tell a reused pid apart."""
    return _proc_stat(pid, 19)


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


def _pid_max() -> int:
    """The largest pid this kernel hands out (Linux ``pid_max``; 2^22, its ceiling, elsewhere)."""
    text = _read_text("/proc/sys/kernel/pid_max")
    try:
        return int(text) if text else 1 << 22
    except ValueError:
        return 1 << 22


def _impossible_pid(pid: Any) -> bool:
    """A pid no process can have: not a positive int, or beyond the kernel's range (0 and -1 would
    ask ``kill`` about a process group, a huge one overflows it)."""
    return isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _pid_max()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:     # PermissionError: another user's process
        return True
    return _proc_stat(pid, 0) != "Z"      # a zombie has ended; only its parent has not looked


def env_seconds(name: str, default: float) -> float:
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


def describe_holder(holder: dict) -> str:
    """``pid P on host H`` (and the attempt, when the holder has one)."""
    text = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    return text + (f" (attempt {holder['attempt']})" if holder.get("attempt") else "")


class LockFile:
    """The lock at ``path`` (see the module docstring). ``subject`` names what it guards in
    messages (``run directory R``), ``user`` what holds it (``olmax train``) and ``hint`` what to
    do when it is held."""

    def __init__(self, path: str | os.PathLike, *, subject: str, user: str = "olmax",
                 hint: str = "", stale_after: float | None = None, heartbeat: float | None = None,
                 attempt: str | None = None) -> None:
        self.path = Path(path)
        self.subject, self.user, self.hint = subject, user, hint
        self.stale_after = stale_after or env_seconds(STALE_ENV, STALE_S)
        self.heartbeat = heartbeat or env_seconds(HEARTBEAT_ENV, HEARTBEAT_S)
        self.attempt = attempt
        self._job = parse_attempt(attempt) if attempt is not None else None
        self.token: str | None = None
        self.lost: str | None = None
        self.took_over: str | None = None     # why a stale lock was taken over, if one was
        self._written: set[str] = set()       # tokens of the lock files this object created
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- acquire -------------------------------------------------------------------------------

    def acquire(self, wait_s: float = 0.0,
                on_wait: Callable[[str], None] | None = None) -> "LockFile":
        """Take the lock; a live holder is waited for up to ``wait_s`` seconds (``on_wait`` is
        told once why), else :class:`LockHeld`. A loop over :meth:`_attempt` (the module
        docstring's table says what each attempt does)."""
        state = _Acquiring(deadline=time.monotonic() + wait_s)
        while not self._attempt(state, wait_s, on_wait):
            pass
        self._start_heartbeat()
        return self

    def _attempt(self, state: "_Acquiring", wait_s: float,
                 on_wait: Callable[[str], None] | None) -> bool:
        """One attempt to take the lock: True when it is ours; False to try again (after a read,
        a wait or a takeover); :class:`LockHeld` when it is refused."""
        holder = self._try_create()
        if holder is not None and holder.get("token") in self._written:
            # Our file, moved aside by a racing taker who found it was not the stale lock it
            # judged, and put back (:meth:`_move_aside`) while we were reading it.
            self.token, holder = holder["token"], None
        if holder is None:
            return True
        if not holder and state.unreadable < UNREADABLE_READS and self.path.exists():
            state.unreadable += 1
            time.sleep(0.2)     # being written by its creator right now: read it again
            return False
        why = self._stale_reason(holder)
        if why is not None:
            if self._take_over(holder):
                who = describe_holder(holder) if holder else "an unknown holder"
                self.took_over = f"took over a stale lock of {who} ({why})"
            state.takeovers += 1
            if state.takeovers >= MAX_TAKEOVERS:
                raise LockHeld(f"{self.subject} is contended: could not take its lock ({self.path}) "
                               "after several tries")
            return False
        if self._newer_attempt(holder) or time.monotonic() >= state.deadline:
            raise LockHeld(self._held_message(holder), holder)
        if on_wait is not None and not state.told:
            on_wait(f"{self.subject}: waiting up to {wait_s:.0f} s for "
                    f"{describe_holder(holder) if holder else 'an unknown holder'} to release "
                    f"its lock {self.path} or to stop its heartbeat")
            state.told = True
        time.sleep(min(self.heartbeat, 5.0, max(0.05, state.deadline - time.monotonic())))
        return False

    def _newer_attempt(self, holder: dict) -> bool:
        """Whether ``holder`` is a later attempt of this process's own job (the same attempt, a
        pod the scheduler replaced within it, is judged like any other holder)."""
        theirs = self._holder_attempt(holder)
        return (self._job is not None and theirs is not None and theirs[0] == self._job[0]
                and theirs[1] > self._job[1])

    @staticmethod
    def _holder_attempt(holder: dict) -> tuple[str, int] | None:
        raw = holder.get("attempt")
        if not isinstance(raw, str):
            return None
        try:
            return parse_attempt(raw)
        except OlmaxError:
            return None

    def _held_message(self, holder: dict) -> str:
        if not holder:
            age = self._heartbeat_age()
            return (f"{self.subject} holds a lock file olmax cannot read, {self.path} "
                    f"(not the JSON {self.user} writes; changed {age or 0:.0f} s ago); it is taken "
                    f"over {self.stale_after:.0f} s after its last change, or remove it if no "
                    f"{self.user} uses it")
        if self._newer_attempt(holder):
            return (f"{self.subject} is held by attempt {holder['attempt']} of this job, "
                    f"{describe_holder(holder)}; this is attempt {self.attempt}, which it replaced")
        since = f" since {holder['started']}" if holder.get("started") else ""
        text = f"{self.subject} is in use by {self.user} {describe_holder(holder)}{since}"
        text += f"; {self.hint}" if self.hint else ""
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
                  "command": sys.argv, **({"attempt": self.attempt} if self.attempt else {})}
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return self.holder()
        except OSError as e:
            raise OlmaxError(f"{self.subject} is not writable: {e.strerror or e}") from None
        self._written.add(token)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError:       # e.g. an object-store mount refusing the upload: someone else won
            return self.holder()
        got = self.holder()
        if got.get("token") != token:
            return got
        self.token = token
        return None

    def holder(self) -> dict:
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
        probe = self.path.with_name(f"{self.path.name}.probe-{secrets.token_hex(6)}")
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
        theirs = self._holder_attempt(holder)
        if self._job is not None and theirs is not None and theirs[0] == self._job[0] \
                and theirs[1] < self._job[1]:
            return f"attempt {self.attempt} replaces attempt {holder['attempt']}"
        me = identity()
        pid = holder.get("pid")
        same_process_space = (holder.get("host") == me["host"]
                              and holder.get("boot_id") == me["boot_id"] is not None
                              and holder.get("pid_ns") == me["pid_ns"] is not None)
        if same_process_space:       # decided at once: is that process still there?
            if _impossible_pid(pid):
                return f"it names pid {pid!r}, which no process can have"
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
        """Remove the stale lock judged from ``holder``, under the takeover guard; True when it was
        removed (False: the lock changed meanwhile, or the guard could not be had; the caller
        looks again)."""
        guard = TakeoverGuard(self)
        if not guard.take():
            return False
        try:
            now = self.holder()
            if now.get("token") != holder.get("token") or self._stale_reason(now) is None:
                return False       # taken over by another taker, released, or alive after all
            return self._move_aside(holder.get("token"))
        finally:
            guard.drop()

    def _move_aside(self, token: str | None) -> bool:
        """Rename the lock aside and delete it; True when what was moved holds ``token`` (if not,
        a new holder's lock was moved: it is put back)."""
        aside = self.path.with_name(f"{self.path.name}.stale-{secrets.token_hex(6)}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False           # released meanwhile
        except OSError as e:
            raise OlmaxError(f"cannot take over the stale lock {self.path}: {e.strerror or e}") from None
        moved = _read_text(str(aside))
        try:
            moved_token = json.loads(moved).get("token") if moved else None
        except (ValueError, AttributeError):
            moved_token = None
        if moved_token != token:
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
        return moved_token == token

    # -- holding -------------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"olmax-lock-{self.path.name}",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            self.refresh()

    def verify(self) -> bool:
        """Whether the lock file still holds this process's token (:attr:`lost` says why not).
        A lock file that is missing or empty is read again, as :meth:`acquire` does: a taker moves
        the lock aside before writing its own (or puts ours back, having judged wrongly), and
        for that moment there is no record to read."""
        if self.token is None or self.lost:
            return not self.lost
        holder = self.holder()
        for _ in range(UNREADABLE_READS):
            if holder:
                break
            time.sleep(0.2)
            holder = self.holder()
        if holder.get("token") != self.token:
            self.lost = (f"{self.subject} was taken over by "
                         f"{describe_holder(holder) if holder else 'another process'} (its lock file "
                         f"{self.path} no longer holds this process's token)")
            return False
        return True

    def refresh(self) -> None:
        """One heartbeat: check the token is still ours, touch the file."""
        if self.token is None or not self.verify():
            return
        try:
            os.utime(self.path)
        except OSError:
            pass      # a transient storage error; the next beat tries again

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def release(self) -> None:
        self._stop_heartbeat()
        if self.token is None:
            return
        if self.holder().get("token") == self.token:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self.token = None

    def __enter__(self) -> "LockFile":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class TakeoverGuard:
    """``<lock>.takeover``, created with ``O_EXCL``: one taker of a stale lock at a time (the
    module docstring says why). A guard left by a taker that died is broken like a lock: at once
    on its own host, after :data:`GUARD_STALE_S` elsewhere."""

    def __init__(self, lock: LockFile) -> None:
        self.lock = lock
        self.path = lock.path.with_name(f"{lock.path.name}.takeover")
        self.token: str | None = None

    def take(self) -> bool:
        """Create the guard, waiting while another taker holds it; False after
        :data:`GUARD_WAIT_S` seconds of a live one."""
        deadline = time.monotonic() + GUARD_WAIT_S
        stale_after = min(GUARD_STALE_S, self.lock.stale_after)
        while True:
            token = secrets.token_hex(16)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                fd = None
            except OSError as e:
                raise OlmaxError(f"{self.lock.subject} is not writable: {e.strerror or e}") from None
            if fd is not None:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps({**identity(), "token": token}) + "\n")
                self.token = token
                return True
            theirs = LockFile(self.path, subject=self.lock.subject, stale_after=stale_after,
                              heartbeat=self.lock.heartbeat)
            held = theirs.holder()
            if theirs._stale_reason(held) is not None:
                theirs._move_aside(held.get("token"))     # a dead taker's guard (or gone already)
                continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def drop(self) -> None:
        """Remove the guard, unless another taker broke it meanwhile."""
        theirs = LockFile(self.path, subject=self.lock.subject)
        if self.token is not None and theirs.holder().get("token") == self.token:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self.token = None


@dataclass
class _Acquiring:
    """What one :meth:`LockFile.acquire` has seen over its attempts."""

    deadline: float         # time.monotonic() after which a live holder is not waited for
    unreadable: int = 0     # reads of a lock file its creator was still writing
    takeovers: int = 0      # stale locks taken over, or tried
    told: bool = False      # on_wait was told why we wait


__all__ = ["LockFile", "LockHeld", "TakeoverGuard", "identity", "describe_holder", "parse_attempt", "env_seconds"]
