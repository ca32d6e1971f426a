"""Token files where they live: ``s3://``, ``gs://`` and ``http(s)://`` URLs, read in place.

Everything that reads token files (training, ``data inspect``, ``data overlap``, held-out
evaluation) accepts these URLs wherever it accepts a local path. The access pattern is OLMo-core's
(``olmo_core.io``: ``get_file_size`` + ``get_bytes_range``): a file's token count comes from its
size (one metadata request: S3 ``HeadObject``, the GCS object resource, HTTP ``HEAD``), and a batch
reads exactly the byte ranges of its instances (ranged ``GET``\\s, issued concurrently); a whole
remote file is never read at once except by an explicit copy. Filesystems are fsspec's: s3fs
(endpoint and credentials from the standard AWS environment: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, profiles), gcsfs (Google
application-default credentials, ``GOOGLE_APPLICATION_CREDENTIALS``) and fsspec's HTTP.

Every request goes through :func:`olmax.transport.retried`, the one place that decides what a
failure means (:mod:`olmax.store`'s run directories use it too): retried with back-off on what
may pass (a dropped or refused connection, a timeout, an HTTP 5xx or 408, 425, 429, a short
answer), exit 75 naming the URL and the cause once the tries are spent. olmax's loop is the only
one: gcsfs's own six-fold retry with sleeps of up to 16 s is switched off, so a store that cannot
be reached is one error within seconds, not minutes. What retrying cannot fix is one error at
once, naming the file and the real cause: a missing file (HTTP 404/410, ``NoSuchKey``), a denied
request (401/403), another 4xx, a server that ignores ``Range`` (it answers a ranged read with the
whole file). A file that stays shorter than its listed size is one error naming it ("truncated").

Verified copies and the read-through cache (``data.cache_dir``) are in
:mod:`olmax.data.remote_cache` (its names are also this module's).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

from olmax.data.remote_cache import (ReadThroughCache, Stopped, cache_path, download, store_md5,
                                     store_version, url_protocol, verified_copy)
from olmax.errors import OlmaxError
from olmax.store import new_filesystem
from olmax.transport import NotFound, Retry, SCHEMES, cause, final_error, past_end, retried, url_scheme

log = logging.getLogger(__name__)

SIZE_WORKERS = 16


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL olmax reads (s3, gs, gcs, http, https); text that looks like a
    URL but is not one is a ConfigError (:func:`olmax.transport.url_scheme`)."""
    return url_scheme(path) is not None


def is_pattern(path: str) -> bool:
    """A glob (``*``, ``?``, ``[``) to expand: local paths and s3/gs URLs (HTTP cannot list, and
    its ``?`` starts a query)."""
    return any(c in path for c in "*?[") and not str(path).lower().startswith(("http://", "https://"))


def join(root: str | None, path: str) -> str:
    """``path`` under ``root`` (a folder or a URL prefix); absolute paths and URLs stay."""
    if root is None or is_remote(path) or (not is_remote(root) and os.path.isabs(path)):
        return path
    if is_remote(root):
        return root.rstrip("/") + "/" + path.lstrip("/")
    return os.path.join(root, path)


class _ShortRead(Exception):
    pass


def _range_ignored(url: str, start: int, nbytes: int, got: int) -> OlmaxError:
    return OlmaxError(f"{url}: the server ignores byte ranges (asked for {nbytes} bytes at {start}, "
                      f"it sent {got}); olmax reads token files in ranges: serve them from a server "
                      f"that answers Range requests (HTTP 206)")


def _with_retries(url: str, what: str, attempt: Callable, *, quiet: bool = False,
                  noun: str = "token file"):
    """``attempt()`` retried by :func:`olmax.transport.retried`, which decides what a failure
    means (the module notes); a short answer counts as a truncated file once retries are spent."""
    return retried(url, what, attempt, quiet=quiet, noun=noun,
                   truncated=lambda e: isinstance(e, _ShortRead))


class _RangedReads:
    """One attempt at the ``pending`` ranges of one protocol, all requests concurrent: the ranges
    read are stored in ``out``, the failed ones stay pending (a :class:`~olmax.transport.Retry`
    names the first)."""

    def __init__(self, fs, ranges, pending: list[int], out: list) -> None:
        self.fs, self.ranges, self.pending, self.out = fs, ranges, pending, out

    def __call__(self) -> None:
        ranges, pending = self.ranges, self.pending
        try:
            got = self.fs.cat_ranges([ranges[i][0] for i in pending], [ranges[i][1] for i in pending],
                                     [ranges[i][1] + ranges[i][2] for i in pending], on_error="return")
        except Exception as e:  # the whole call failed (e.g. the event loop's session)
            got = [e] * len(pending)
        failed = []
        for i, data in zip(pending, got):
            url, start, n = ranges[i]
            final = final_error(url, data, "token file") if isinstance(data, BaseException) else None
            if final is not None:
                raise final
            if not isinstance(data, BaseException) and len(data) > n:
                raise _range_ignored(url, start, n, len(data))
            if isinstance(data, BaseException) or len(data) != n:
                failed.append((i, data))
            else:
                self.out[i] = bytes(data)
        if not failed:
            return
        self.pending = [i for i, _ in failed]
        i, data = failed[0]
        url, start, n = ranges[i]
        what = f"{len(failed)} of {len(pending)} ranged reads failed"
        if isinstance(data, BaseException):
            raise Retry(url, what, cause(data), truncated=past_end(data))
        raise Retry(url, what, f"asked for bytes {start}..{start + n}, got {len(data)}", truncated=True)


_INFO: dict[str, dict] = {}   # url -> {"size", "md5"}: one metadata request per file and process


class RemoteFiles:
    """Sizes, checksums and ranged reads of remote files, retried, optionally cached locally.

    One fsspec filesystem per protocol and process (rebuilt after a fork, so grain worker
    processes get their own connections). Picklable: the filesystems and the cache's copy thread
    are not pickled.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None) -> None:
        self.cache = ReadThroughCache(cache_dir, self) if cache_dir is not None else None
        self._fs: dict[tuple[int, str], object] = {}
        self._info = _INFO
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"cache_dir": None if self.cache is None else str(self.cache.root)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["cache_dir"])

    # -- plumbing ---------------------------------------------------------------------------
    def filesystem(self, url: str):
        proto = url_protocol(url)
        key = (os.getpid(), proto)
        with self._lock:
            fs = self._fs.get(key)
            if fs is None:
                try:
                    fs = new_filesystem(proto)
                except ImportError as e:   # the protocol's implementation (s3fs, gcsfs, aiohttp)
                    raise OlmaxError(f"{url}: reading {proto}:// needs {e.name} "
                                     f"(pip install 'olmax' brings it)") from None
                self._fs[key] = fs
        return fs

    # -- metadata ---------------------------------------------------------------------------
    def info(self, url: str, noun: str = "token file") -> dict:
        """``{"size": bytes, "md5": hex or None, "version": str or None}`` (remembered for the
        process's life; :func:`~olmax.data.remote_cache.store_version`). ``noun``: what the file
        is, in the error for a missing one (:class:`~olmax.transport.NotFound`)."""
        got = self._info.get(url)
        if got is None:
            raw = _with_retries(url, "size request", lambda: self.filesystem(url).info(url),
                                quiet=True, noun=noun)
            if raw.get("type") == "directory":
                raise OlmaxError(f"{url}: is a directory, not a {noun}")
            size = raw.get("size")
            if size is None:
                raise OlmaxError(f"{url}: the server states no size (no Content-Length)")
            proto = url_protocol(url)
            got = {"size": int(size), "md5": store_md5(raw, proto),
                   "version": store_version(raw, proto)}
            self._info[url] = got
        return got

    def size(self, url: str) -> int:
        return self.info(url)["size"]

    def sizes(self, urls: Sequence[str]) -> list[int]:
        """Sizes of many files, ``SIZE_WORKERS`` requests at a time."""
        todo = [u for u in dict.fromkeys(urls) if u not in self._info]
        if len(todo) > 1:
            with ThreadPoolExecutor(min(SIZE_WORKERS, len(todo))) as pool:
                list(pool.map(self.info, todo))
        return [self.size(u) for u in urls]

    def exists(self, url: str) -> bool:
        """Whether the store has ``url``: False for a missing file only; any other failure
        (a store that cannot be reached, a denied request) is raised."""
        try:
            self.info(url)
        except NotFound:
            return False
        return True

    def glob(self, pattern: str) -> list[str]:
        """The objects matching an s3/gs glob, as URLs, sorted."""
        fs = self.filesystem(pattern)
        found = _with_retries(pattern, "listing", lambda: fs.glob(pattern), quiet=True)
        prefix = pattern.split("://", 1)[0] + "://"
        return sorted(f if "://" in f else prefix + f for f in found)

    # -- reading ----------------------------------------------------------------------------
    def read(self, url: str, start: int, nbytes: int) -> bytes:
        """Bytes ``[start, start + nbytes)`` of ``url`` (from the cache when it holds the file)."""
        return self.read_ranges([(url, start, nbytes)])[0]

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Many ``(url, start, nbytes)`` ranges at once: cached files are read locally, the rest
        with concurrent ranged requests; failed or short ranges are retried."""
        out: list[bytes | None] = [None] * len(ranges)
        remote = []
        for i, (url, start, n) in enumerate(ranges):
            local = self.cache.entry(url) if self.cache is not None else None
            if local is not None:
                out[i] = _pread(local, start, n, url)
            elif n == 0:
                out[i] = b""
            else:
                remote.append(i)
        if remote:
            self._fetch(ranges, remote, out)
        return out  # type: ignore[return-value]

    def _fetch(self, ranges, todo: list[int], out: list) -> None:
        by_proto: dict[str, list[int]] = {}
        for i in todo:
            by_proto.setdefault(url_protocol(ranges[i][0]), []).append(i)
        for idx in by_proto.values():
            _with_retries(ranges[idx[0]][0], "read", _RangedReads(self.filesystem(ranges[idx[0]][0]),
                                                                  ranges, idx, out))
        if self.cache is not None:
            for i in todo:
                self.cache.want(ranges[i][0])

    def read_direct(self, url: str, start: int, nbytes: int, noun: str = "token file") -> bytes:
        """One ranged read from the store itself (no cache), retried."""
        def get() -> bytes:
            data = self.filesystem(url).cat_file(url, start=start, end=start + nbytes)
            if len(data) > nbytes:
                raise _range_ignored(url, start, nbytes, len(data))
            if len(data) != nbytes:
                raise _ShortRead(f"asked for bytes {start}..{start + nbytes}, got {len(data)}")
            return bytes(data)
        return _with_retries(url, "read", get, noun=noun)


def _pread(path: Path, start: int, n: int, url: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, n, start)
    finally:
        os.close(fd)
    if len(data) != n:
        raise OlmaxError(f"{path} (cached copy of {url}): short read at byte {start}")
    return data


_DEFAULT: dict[str | None, RemoteFiles] = {}


def remote_files(cache_dir: str | os.PathLike | None = None) -> RemoteFiles:
    """The process's shared :class:`RemoteFiles` for a cache directory (None: no cache)."""
    key = None if cache_dir is None else str(cache_dir)
    files = _DEFAULT.get(key)
    if files is None:
        files = _DEFAULT[key] = RemoteFiles(cache_dir)
    return files


__all__ = ["is_remote", "is_pattern", "join", "RemoteFiles", "remote_files", "download", "cache_path",
           "ReadThroughCache", "SCHEMES", "Stopped", "verified_copy"]
