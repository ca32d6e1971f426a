"""Verified copies of remote files and the read-through cache (:mod:`olmax.data.remote` reads
the stores; this module keeps local copies of what it reads).

Verified copies: :func:`download` (``olmax data fetch``, the cache below) writes ``<file>.part``,
checks the finished copy against the store's size and, where the store states one, its MD5 (an S3
ETag of a single-part upload, GCS ``md5Hash``, an HTTP ``Content-MD5``), records that check in a
small file beside the copy (``.<name>.olmax-verified``: the store's size and MD5 and the copy's
size, inode and mtime) and only then renames it into place. A file counts as a verified copy
(:func:`verified_copy`) only while that record still describes it, or, lacking one, when its MD5
equals the one the store states; its size alone never suffices.

Read-through cache: with a cache directory (``data.cache_dir``), each remote file a process reads
is also copied whole, in the background, to ``<cache>/remote/<scheme>/<host>/<path>`` (one copy
at a time per process; an ``flock`` keeps two processes from copying the same file). Reads use an
entry only once it is a verified copy; until then, and for an entry that is not (or no longer)
one, which is removed, reads go to the store. A truncated or altered copy is therefore never read.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import logging
import os
import queue
import stat
import threading
from pathlib import Path
from typing import Callable, Protocol
from urllib.parse import urlsplit

from olmax.errors import OlmaxError
from olmax.io import contained, env_int, hash_into, publish_file, write_error, write_json_atomic
from olmax.transport import short_error

log = logging.getLogger(__name__)

COPY_CHUNK_ENV = "OLMAX_COPY_CHUNK_BYTES"   # bytes per request of a copy (default 8 MiB)
VERIFIED_SUFFIX = ".olmax-verified"


class Store(Protocol):
    """What a copy needs of the store (:class:`olmax.data.remote.RemoteFiles`)."""

    def info(self, url: str) -> dict: ...

    def read_direct(self, url: str, start: int, nbytes: int) -> bytes: ...


def url_protocol(url: str) -> str:
    scheme = url.split("://", 1)[0].lower()
    return "gs" if scheme == "gcs" else scheme


def store_md5(info: dict, proto: str) -> str | None:
    """The object's MD5 where the store states one: GCS ``md5Hash``, an S3 ETag that is a plain
    MD5 (single-part uploads; multipart ETags hold a '-'), an HTTP ``Content-MD5`` header."""
    try:
        if proto == "gs" and info.get("md5Hash"):
            return base64.b64decode(info["md5Hash"]).hex()
        if proto in ("http", "https") and info.get("Content-MD5"):
            return base64.b64decode(info["Content-MD5"]).hex()
    except ValueError:
        return None
    etag = str(info.get("ETag") or "").strip('"').lower()
    if proto == "s3" and len(etag) == 32 and all(c in "0123456789abcdef" for c in etag):
        return etag
    return None


# The metadata fields that change when an object's bytes do, per store: an S3 version id, ETag
# and modification time; a GCS generation (a new one per write of the object); an HTTP ETag,
# Last-Modified and Digest (as fsspec's HTTP filesystem reports the headers).
_VERSION_FIELDS = {"s3": ("VersionId", "ETag", "LastModified"),
                   "gs": ("generation", "md5Hash", "updated"),
                   "http": ("ETag", "Last-Modified", "Digest"),
                   "https": ("ETag", "Last-Modified", "Digest")}


def store_version(info: dict, proto: str) -> str | None:
    """What the store says of the object's version (see ``_VERSION_FIELDS``), as one string, or
    None where it says nothing that would change with the bytes (then only an MD5 can tell a
    changed object of the same size from the copy)."""
    parts = [f"{k}={info[k]}" for k in _VERSION_FIELDS.get(proto, ())
             if info.get(k) not in (None, "", "null")]
    return ";".join(parts) or None


# ----------------------------------------------------------------------------------------------
# Verified, resumable copies


class Stopped(Exception):
    """A copy stopped on request (its ``stop`` event) between two chunks; its part stays."""


def _record_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{VERIFIED_SUFFIX}")


def _record(url: str, info: dict, st: os.stat_result) -> dict:
    return {"url": url, "size": info["size"], "md5": info["md5"], "version": info.get("version"),
            "file": [st.st_size, st.st_ino, st.st_mtime_ns]}


def checkable(info: dict) -> bool:
    """Whether a copy of the object can be told from a changed object of the same size: the store
    states its MD5 or a version (:func:`store_version`)."""
    return info.get("md5") is not None or info.get("version") is not None


def verified_copy(files: Store, url: str, path: str | os.PathLike) -> bool:
    """Whether ``path`` holds the store's ``url``: a regular file of the store's size, described by
    its verification record (see the module notes), or, lacking a valid record, whose MD5 is the
    one the store states (the record is then written). Never by its size alone: an object whose
    store states neither an MD5 nor a version has no verified copy."""
    path = Path(path)
    info = files.info(url)
    if not checkable(info):
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != info["size"]:
        return False
    try:
        if json.loads(_record_path(path).read_text()) == _record(url, info, st):
            return True
    except (OSError, ValueError):
        pass
    if info["md5"] is None or hash_into(hashlib.md5(), path).hexdigest() != info["md5"]:
        return False
    try:
        write_json_atomic(_record_path(path), _record(url, info, st))
    except OlmaxError:
        pass      # a read-only copy: verified now, hashed again next time
    return True


def _discard(path: Path) -> None:
    for p in (path, _record_path(path)):
        p.unlink(missing_ok=True)


def download(files: Store, url: str, dest: str | os.PathLike, *,
             progress: Callable[[int], None] | None = None, chunk: int | None = None,
             stop: threading.Event | None = None) -> int:
    """Copy ``url`` to ``dest``, verified, resumable; returns the bytes transferred by this call
    (0 when ``dest`` already is a verified copy).

    Bytes go to ``<dest>.part`` in order; a later call (after any crash or ``kill -9``) resumes
    from the part's length, re-hashing what is there. The finished copy must have the store's size
    and, where the store states one, its MD5; otherwise the part is deleted and the call fails
    naming the file. Only then is its verification record written and the part renamed to
    ``dest`` (replacing a file there that is not a verified copy). An ``flock`` on
    ``<dest>.lock`` keeps two copiers (processes or threads) off the same file: the loser returns
    -1 at once. ``stop``: when set, the copy ends after the chunk in flight (:class:`Stopped`).
    A failed write (a full disk) is an OlmaxError naming ``dest``.
    """
    dest = Path(dest)
    chunk = chunk or env_int(COPY_CHUNK_ENV, 8 << 20, unit="bytes")
    info = files.info(url)
    size, md5 = info["size"], info["md5"]
    if verified_copy(files, url, dest):
        return 0
    part = dest.with_name(dest.name + ".part")
    lock_path = dest.with_name(dest.name + ".lock")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "a")
    except OSError as e:
        raise write_error(dest, e) from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return -1
        try:
            fetched = _copy_into(files, url, part, size, md5, chunk, progress, stop)
            st = os.stat(part)
            write_json_atomic(_record_path(dest), _record(url, info, st))
            publish_file(str(part), dest)
        except OSError as e:
            raise write_error(dest, e) from None
        lock_path.unlink(missing_ok=True)   # later copiers see the finished file first
    return fetched


def _copy_into(files: Store, url: str, part: Path, size: int, md5: str | None, chunk: int,
               progress: Callable[[int], None] | None, stop: threading.Event | None) -> int:
    """Append the rest of ``url`` to ``part`` and verify it whole; returns the bytes fetched."""
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    hasher = None if not md5 else hash_into(hashlib.md5(), part) if have else hashlib.md5()
    fetched = 0
    with open(part, "ab") as f:
        while have < size:
            if stop is not None and stop.is_set():
                raise Stopped(url)
            n = min(chunk, size - have)
            data = files.read_direct(url, have, n)
            f.write(data)
            if hasher is not None:
                hasher.update(data)
            have += n
            fetched += n
            if progress is not None:
                progress(n)
        f.flush()
        os.fsync(f.fileno())
    got = part.stat().st_size
    if got != size or (hasher is not None and hasher.hexdigest() != md5):
        part.unlink()
        what = (f"{got} bytes, the store lists {size}" if got != size
                else f"MD5 {hasher.hexdigest()}, the store lists {md5}")
        raise OlmaxError(f"{url}: the downloaded copy fails verification ({what}); "
                         f"it was removed, run again to download it anew")
    return fetched


def cache_path(root: str | os.PathLike, url: str) -> Path:
    """Where the cache keeps ``url``: ``<root>/remote/<scheme>/<host>/<path>`` (a path that
    would leave that folder is an OlmaxError)."""
    parts = urlsplit(url)
    rel = parts.path.lstrip("/")
    if parts.query:
        rel += "?" + parts.query
    return contained(Path(root) / "remote" / url_protocol(url) / (parts.netloc or "_"), rel,
                     what=f"{url} (cached)")


class ReadThroughCache:
    """Verified whole-file copies of the remote files a process reads (see the module notes)."""

    def __init__(self, root: str | os.PathLike, files: Store) -> None:
        self.root = Path(root)
        self.files = files
        self._ready: dict[str, Path] = {}
        self._queued: set[str] = set()
        self._queue: queue.Queue | None = None
        self._owner = -1
        self._lock = threading.Lock()

    def entry(self, url: str) -> Path | None:
        """The local copy of ``url`` when it is a verified copy (:func:`verified_copy`), else None;
        a copy that is not is removed (the background copy makes a new one)."""
        path = self._ready.get(url)
        if path is None:
            candidate = cache_path(self.root, url)
            if not candidate.exists():
                return None
            if not verified_copy(self.files, url, candidate):
                log.warning("%s: cached copy %s does not match the store (size, MD5) or was never "
                            "verified; removed, reading the store", url, candidate)
                _discard(candidate)
                return None
            self._ready[url] = path = candidate
        return path

    def want(self, url: str) -> None:
        """Queue a background copy of ``url`` (once per process); never for an object whose store
        states neither an MD5 nor a version (a changed object could not be told from the copy)."""
        with self._lock:
            if url in self._queued or url in self._ready:
                return
            self._queued.add(url)
            if not checkable(self.files.info(url)):
                log.warning("%s: not cached: the store states neither an MD5 nor a version "
                            "(ETag, Last-Modified) of it, so a changed file could not be told "
                            "from the copy; reading the store", url)
                return
            if self._queue is None or self._owner != os.getpid():
                self._queue, self._owner = queue.Queue(), os.getpid()
                threading.Thread(target=self._run, args=(self._queue,), daemon=True,
                                 name="olmax-remote-cache").start()
            self._queue.put(url)

    def _run(self, q: queue.Queue) -> None:
        while True:
            url = q.get()
            try:
                if download(self.files, url, cache_path(self.root, url)) >= 0:
                    self.entry(url)
            except Exception as e:  # the cache is an optimisation: reads keep going to the store
                log.warning("%s: caching failed: %s", url, short_error(e))
                with self._lock:
                    self._queued.discard(url)


__all__ = ["COPY_CHUNK_ENV", "ReadThroughCache", "Stopped", "Store", "cache_path", "download",
           "checkable", "store_md5", "store_version", "url_protocol", "short_error",
           "verified_copy"]
