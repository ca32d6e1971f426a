"""The run lock in a bucket: :class:`~olmax.lockfile.LockFile`'s judgement on the store's own
atomic operations.

A run directory in a bucket (``s3://``, ``gs://``: :mod:`olmax.store`) has no ``O_EXCL`` and no
rename, but it has conditional writes, which are atomic at the store:

- **taking** the lock is *create if absent* (S3 ``PutObject`` with ``If-None-Match: *``, GCS
  ``ifGenerationMatch=0``): of two trainers on one bucket path exactly one creates the object;
- **taking over** a stale lock is *replace if unchanged* with the version the taker judged (S3
  ``If-Match: ETAG``, GCS ``ifGenerationMatch=GENERATION``): of two takers exactly one wins, and a
  holder that beat meanwhile keeps its lock, so no takeover guard is needed;
- the **heartbeat** is a conditional replace too (the record's ``beat`` count changes, so the
  version does): a heartbeat that fails its condition means the lock was taken over
  (:attr:`lost`).

Who holds it is judged as for a lock file (the table in :mod:`olmax.lockfile`): an earlier attempt
of this job is taken over at once, a later one refuses; a holder on this host and pid namespace
whose process is gone is taken over at once (a run killed with ``kill -9`` restarts at once);
elsewhere a lock is stale when its object has not changed for ``stale_after`` seconds by the
store's clock (the modification time of a probe object written beside it).
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from typing import Any

from olmax import store
from olmax.errors import OlmaxError
from olmax.lockfile import LockFile, identity


class _ObjectPath:
    """The lock object's URL with the two things :class:`LockFile` asks of its path."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = url.rsplit("/", 1)[-1]

    def exists(self) -> bool:
        return store.stat(self.url) is not None

    def __str__(self) -> str:
        return self.url

    __fspath__ = __str__


class BucketLock(LockFile):
    """The lock object at ``url`` (see the module docstring); the interface of LockFile."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__("/unused", **kwargs)
        self.url = url
        self.path = _ObjectPath(url)  # type: ignore[assignment]
        self._version: str | None = None        # the version of our lock object
        self._versions: dict[str, str] = {}     # token -> the version it was last read at
        self._beats = 0
        # one heartbeat at a time: the background thread's and a caller's would both replace
        # from the same version, and the loser would take its failed condition for a takeover
        self._beating = threading.Lock()

    def _record(self, token: str) -> dict:
        return {**identity(), "token": token,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "command": sys.argv, **({"attempt": self.attempt} if self.attempt else {})}

    def _try_create(self) -> dict | None:
        token = secrets.token_hex(16)
        record = self._record(token)
        self._written.add(token)
        version = store.create(self.url, (json.dumps(record) + "\n").encode())
        if version is None:
            return self.holder()
        self.token, self._version, self._mine = token, version, record
        return None

    def holder(self) -> dict:
        """The lock object's record (``{}`` when missing or unreadable); the version it was read
        at is remembered for a takeover."""
        for _ in range(5):
            before = store.stat(self.url)
            if before is None:
                return {}
            data = store.read(self.url)
            after = store.stat(self.url)
            if after is not None and after["version"] == before["version"]:
                break
        else:
            return {}
        try:
            record = json.loads((data or b"").decode("utf-8", errors="replace"))
        except ValueError:
            return {}
        if not isinstance(record, dict):
            return {}
        token = record.get("token")
        if isinstance(token, str):
            self._versions[token] = after["version"]
            if token in self._written and self.token in (None, token):
                self._version, self._mine = after["version"], record
        return record

    def _heartbeat_age(self) -> float | None:
        got = store.stat(self.url)
        if got is None or got.get("mtime") is None:
            return None
        return max(0.0, store.store_now(self.url) - got["mtime"])

    def _take_over(self, holder: dict) -> bool:
        """Replace the stale lock judged from ``holder`` with ours, if it is still that one."""
        token = holder.get("token") if holder else None
        version = self._versions.get(token) if isinstance(token, str) else None
        if version is None:
            got = store.stat(self.url)
            if got is None:
                return False       # released meanwhile: the next attempt creates it
            version = got["version"]
        token = secrets.token_hex(16)
        record = self._record(token)
        self._written.add(token)
        new = store.replace(self.url, (json.dumps(record) + "\n").encode(), version)
        if new is None:
            return False           # it changed: a live holder's beat, or another taker won
        self.token, self._version, self._mine = token, new, record
        return True

    def refresh(self) -> None:
        """One heartbeat: a conditional replace of our record (a failed condition: lost)."""
        with self._beating:
            self._refresh()

    def _refresh(self) -> None:
        if self.token is None or self.lost:
            return
        self._beats += 1
        record = {**getattr(self, "_mine", {}), "token": self.token, "beat": self._beats}
        try:
            new = store.replace(self.url, (json.dumps(record) + "\n").encode(), self._version or "")
        except OlmaxError:
            return     # the store could not be reached: the next beat tries again
        if new is not None:
            self._version = new
            return
        self.verify()      # the condition failed: ours still (an earlier beat's retry), or lost

    def release(self) -> None:
        self._stop_heartbeat()
        if self.token is None:
            return
        try:
            if self.holder().get("token") == self.token:
                store.delete(self.url)
        except OlmaxError:
            pass
        self.token = None


__all__ = ["BucketLock"]
