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

Every request is retried (``ATTEMPTS`` tries, exponential back-off from ``BACKOFF_S`` up to
``MAX_BACKOFF_S``) on what may pass: a dropped or refused connection, a timeout, an HTTP 5xx (or
408, 425, 429), a short answer. olmax's loop is the only one: gcsfs's own six-fold retry with
sleeps of up to 16 s is switched off, so a store that cannot be reached is one error within
seconds, not minutes. What retrying cannot fix is one error at once, naming the file and the real
cause: a missing file (HTTP 404/410, ``NoSuchKey``), a denied request (401/403), another 4xx, a
server that ignores ``Range`` (it answers a ranged read with the whole file). A file that stays
shorter than its listed size is one error naming it ("truncated").

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
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import stat
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import urlsplit

import fsspec

from olmax.errors import OlmaxError, RestartableError
from olmax.io import contained, env_int, hash_into, publish_file, write_error, write_json_atomic

log = logging.getLogger(__name__)

SCHEMES = ("s3", "gs", "gcs", "http", "https")
ATTEMPTS = 6
BACKOFF_S = 0.25
MAX_BACKOFF_S = 8.0
COPY_CHUNK_ENV = "OLMAX_COPY_CHUNK_BYTES"   # bytes per request of a copy (default 8 MiB)
SIZE_WORKERS = 16
VERIFIED_SUFFIX = ".olmax-verified"
RETRY_STATUS = (408, 425, 429, 500, 502, 503, 504)


def is_remote(path: str | os.PathLike) -> bool:
    s = str(path)
    i = s.find("://")
    return i > 0 and s[:i].lower() in SCHEMES


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


def _protocol(url: str) -> str:
    scheme = url.split("://", 1)[0].lower()
    return "gs" if scheme == "gcs" else scheme


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class _ShortRead(Exception):
    pass


def _past_end(e: BaseException) -> bool:
    """A ranged request the store refused as past the end of the object (HTTP 416; S3's
    ``InvalidRange``): the object is shorter than its listed size."""
    return getattr(e, "status", None) == 416 or "InvalidRange" in str(e) or " 416" in str(e)


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (or during), outermost first."""
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _status(e: BaseException) -> int | None:
    """The HTTP status a client library's exception carries (aiohttp, gcsfs, botocore)."""
    for x in _chain(e):
        code = None
        if hasattr(x, "request_info"):            # aiohttp's ClientResponseError
            code = getattr(x, "status", None)
        elif type(x).__name__ == "HttpError":     # gcsfs
            code = getattr(x, "code", None)
        elif isinstance(getattr(x, "response", None), dict):   # botocore's ClientError
            code = x.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int) and 100 <= code <= 599:
            return code
    return None


def _cause(e: BaseException) -> str:
    """The real cause of a failed request, in a few words: ``HTTP 500 Internal Server Error``,
    ``connection refused (127.0.0.1:9)``, else the innermost exception's first line."""
    code = _status(e)
    if code is not None:
        reason = next((str(getattr(x, "message", "")) for x in _chain(e)
                       if getattr(x, "status", None) == code and getattr(x, "message", None)), "")
        return f"HTTP {code} {reason}".strip()
    chain = _chain(e)
    if any(isinstance(x, ConnectionRefusedError) or getattr(x, "errno", None) == errno.ECONNREFUSED
           for x in chain):
        at = next((f" ({x.host}:{x.port})" for x in chain
                   if isinstance(getattr(x, "host", None), str) and getattr(x, "port", None)), "")
        return f"connection refused{at}"
    return _short(chain[-1])


def _connection_trouble(e: BaseException) -> bool:
    """Whether ``e`` was raised from a failed connection or a timeout (what a retry may cure)."""
    return any(isinstance(x, (ConnectionError, TimeoutError)) or
               (type(x).__module__.startswith("aiohttp") and
                any(w in type(x).__name__ for w in ("Connect", "Disconnected", "Timeout", "Payload")))
               for x in _chain(e)[1:])


def _final_error(url: str, e: BaseException) -> OlmaxError | None:
    """The error for what retrying cannot fix (a missing file, a denied request, another 4xx),
    else None (a connection error, a 5xx: retried)."""
    if isinstance(e, OlmaxError):
        return e
    code = _status(e)
    if isinstance(e, (FileNotFoundError, PermissionError)) or code is not None:
        # fsspec's HTTP stat reports every failure as FileNotFoundError: its cause tells
        if code in (404, 410) or (isinstance(e, FileNotFoundError) and code is None
                                   and not _connection_trouble(e)):
            return OlmaxError(f"token file not found: {url}")
        if code in (401, 403) or (isinstance(e, PermissionError) and code is None):
            return OlmaxError(f"{url}: access denied ({_cause(e)})")
        if code is not None and code < 500 and code not in RETRY_STATUS and code != 416:
            return OlmaxError(f"{url}: the store refused the request ({_cause(e)})")
    return None


def _range_ignored(url: str, start: int, nbytes: int, got: int) -> OlmaxError:
    return OlmaxError(f"{url}: the server ignores byte ranges (asked for {nbytes} bytes at {start}, "
                      f"it sent {got}); olmax reads token files in ranges: serve them from a server "
                      f"that answers Range requests (HTTP 206)")


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
        proto = _protocol(url)
        key = (os.getpid(), proto)
        with self._lock:
            fs = self._fs.get(key)
            if fs is None:
                try:
                    fs = _filesystem(proto)
                except ImportError as e:   # the protocol's implementation (s3fs, gcsfs, aiohttp)
                    raise OlmaxError(f"{url}: reading {proto}:// needs {e.name} "
                                     f"(pip install 'olmax' brings it)") from None
                self._fs[key] = fs
        return fs

    def _retry(self, url: str, what: str, fn, *, quiet: bool = False):
        """``fn()``, retried as the module notes say; ``quiet``: attempts are logged at debug
        level only (a metadata request: its final error says how many were made)."""
        delay = BACKOFF_S
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return fn()
            except Exception as e:  # transport errors of three client libraries
                final = _final_error(url, e)
                if final is not None:
                    raise final from None
                if attempt == ATTEMPTS:
                    if isinstance(e, _ShortRead) or _past_end(e):
                        raise OlmaxError(f"{url}: truncated: {_short(e)} (the file is shorter than "
                                         f"its listed size; after {ATTEMPTS} attempts)") from None
                    raise RestartableError(f"{url}: {what} failed after {ATTEMPTS} attempts: "
                                     f"{_cause(e)}") from None
                (log.debug if quiet else log.warning)(
                    "%s: %s failed (attempt %d of %d, retrying in %.2f s): %s",
                    url, what, attempt, ATTEMPTS, delay, _cause(e))
                time.sleep(delay)
                delay = min(2 * delay, MAX_BACKOFF_S)

    # -- metadata ---------------------------------------------------------------------------
    def info(self, url: str) -> dict:
        """``{"size": bytes, "md5": hex or None}`` (remembered for the process's life)."""
        got = self._info.get(url)
        if got is None:
            raw = self._retry(url, "size request", lambda: self.filesystem(url).info(url),
                              quiet=True)
            if raw.get("type") == "directory":
                raise OlmaxError(f"{url}: is a directory, not a token file")
            size = raw.get("size")
            if size is None:
                raise OlmaxError(f"{url}: the server states no size (no Content-Length)")
            got = {"size": int(size), "md5": _md5_of(raw, _protocol(url))}
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
        try:
            self.info(url)
        except OlmaxError as e:
            if str(e).startswith("token file not found"):
                return False
            raise
        return True

    def glob(self, pattern: str) -> list[str]:
        """The objects matching an s3/gs glob, as URLs, sorted."""
        fs = self.filesystem(pattern)
        found = self._retry(pattern, "listing", lambda: fs.glob(pattern), quiet=True)
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
            by_proto.setdefault(_protocol(ranges[i][0]), []).append(i)
        for idx in by_proto.values():
            fs = self.filesystem(ranges[idx[0]][0])
            pending = idx
            delay = BACKOFF_S
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    got = fs.cat_ranges([ranges[i][0] for i in pending],
                                        [ranges[i][1] for i in pending],
                                        [ranges[i][1] + ranges[i][2] for i in pending],
                                        on_error="return")
                except Exception as e:  # the whole call failed (e.g. the event loop's session)
                    got = [e] * len(pending)
                failed = []
                for i, data in zip(pending, got):
                    url, start, n = ranges[i]
                    final = _final_error(url, data) if isinstance(data, BaseException) else None
                    if final is not None:
                        raise final
                    if not isinstance(data, BaseException) and len(data) > n:
                        raise _range_ignored(url, start, n, len(data))
                    if isinstance(data, BaseException) or len(data) != n:
                        failed.append((i, data))
                    else:
                        out[i] = bytes(data)
                if not failed:
                    break
                i, data = failed[0]
                url, start, n = ranges[i]
                why = (_cause(data) if isinstance(data, BaseException)
                       else f"asked for bytes {start}..{start + n}, got {len(data)}")
                if attempt == ATTEMPTS:
                    if isinstance(data, BaseException) and not _past_end(data):
                        raise RestartableError(f"{url}: read failed after {ATTEMPTS} attempts: {why}")
                    raise OlmaxError(f"{url}: truncated: {why} (the file is shorter than its "
                                     f"listed size; after {ATTEMPTS} attempts)")
                log.warning("%s: %d of %d ranged reads failed (attempt %d of %d, retrying in "
                            "%.2f s): %s", url, len(failed), len(pending), attempt, ATTEMPTS,
                            delay, why)
                time.sleep(delay)
                delay = min(2 * delay, MAX_BACKOFF_S)
                pending = [i for i, _ in failed]
        if self.cache is not None:
            for i in todo:
                self.cache.want(ranges[i][0])

    def read_direct(self, url: str, start: int, nbytes: int) -> bytes:
        """One ranged read from the store itself (no cache), retried."""
        def get() -> bytes:
            data = self.filesystem(url).cat_file(url, start=start, end=start + nbytes)
            if len(data) > nbytes:
                raise _range_ignored(url, start, nbytes, len(data))
            if len(data) != nbytes:
                raise _ShortRead(f"asked for bytes {start}..{start + nbytes}, got {len(data)}")
            return bytes(data)
        return self._retry(url, "read", get)


def _filesystem(proto: str):
    """A fresh fsspec filesystem for ``proto``. For GCS: gcsfs's plain ``GCSFileSystem`` (its
    default class first looks the bucket's layout up through another API, slowly when that API
    cannot be reached), with gcsfs's own retry loop off (it sleeps up to 31 s per request and
    logs a traceback when it gives up; olmax's loop retries instead)."""
    if proto != "gs":
        return fsspec.filesystem(proto, skip_instance_cache=True)
    from gcsfs.core import GCSFileSystem   # the package's name is the layout-looking subclass

    fs = GCSFileSystem(skip_instance_cache=True)
    once = getattr(GCSFileSystem._request, "__wrapped__", None)
    if once is not None:
        fs._request = types.MethodType(once, fs)
    return fs


def _md5_of(info: dict, proto: str) -> str | None:
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


def _pread(path: Path, start: int, n: int, url: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, n, start)
    finally:
        os.close(fd)
    if len(data) != n:
        raise OlmaxError(f"{path} (cached copy of {url}): short read at byte {start}")
    return data


# ----------------------------------------------------------------------------------------------
# Verified, resumable copies


class Stopped(Exception):
    """A copy stopped on request (its ``stop`` event) between two chunks; its part stays."""


def _record_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{VERIFIED_SUFFIX}")


def _record(url: str, info: dict, st: os.stat_result) -> dict:
    return {"url": url, "size": info["size"], "md5": info["md5"],
            "file": [st.st_size, st.st_ino, st.st_mtime_ns]}


def verified_copy(files: "RemoteFiles", url: str, path: str | os.PathLike) -> bool:
    """Whether ``path`` holds the store's ``url``: a regular file of the store's size, described by
    its verification record (see the module notes), or, lacking a valid record, whose MD5 is the
    one the store states (the record is then written). Never by its size alone."""
    path = Path(path)
    info = files.info(url)
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


def download(files: RemoteFiles, url: str, dest: str | os.PathLike, *,
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


def _copy_into(files: RemoteFiles, url: str, part: Path, size: int, md5: str | None, chunk: int,
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
    return contained(Path(root) / "remote" / _protocol(url) / (parts.netloc or "_"), rel,
                     what=f"{url} (cached)")


class ReadThroughCache:
    """Verified whole-file copies of the remote files a process reads (see the module notes)."""

    def __init__(self, root: str | os.PathLike, files: RemoteFiles) -> None:
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
        """Queue a background copy of ``url`` (once per process)."""
        with self._lock:
            if url in self._queued or url in self._ready:
                return
            self._queued.add(url)
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
                log.warning("%s: caching failed: %s", url, _short(e))
                with self._lock:
                    self._queued.discard(url)


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
