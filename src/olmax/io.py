"""Files olmax writes and the folder it caches in (the bottom layer, with :mod:`olmax.config`).

Every output is written atomically: into a temporary file (or folder) beside the target, flushed to
disk, then renamed into place, so a reader never sees half of it and an interrupted writer leaves
the previous version (or nothing) behind; a failed write (a full disk) is one error naming the
file. Three rules guard what is already there:

- an output file a user names (``--out``, ``--json``, ``--hlo``, ...) is refused when something
  exists there unless the command was given ``--force`` (:func:`refuse_existing`); never, even with
  ``--force``, when it is one of the command's own inputs (the recipe it reads, the metrics it
  compares) or not a regular file (a folder, a FIFO, a device);
- a file written *below* a destination folder under a name that comes from data (a mix file's line,
  a URL's path) must stay below it: :func:`contained` refuses absolute names and ``..`` segments;
- text a user gives is read as UTF-8, and text that is not is one error naming the file
  (:func:`read_text`); a path whose *name* is not UTF-8 (bytes a file system allows) is refused
  in one line naming it where a library needs UTF-8 names (:func:`require_utf8_name`).

The cache (OLMES data, embedded corpus, epoch indices) lives in ``data.cache_dir`` when a run sets
it, else ``$OLMAX_CACHE``, else ``~/.cache/olmax``. A cache file that is expensive to make and
shared by many processes (the epoch order) is made once: :func:`build_once` lets one process build
it under a lock file (:mod:`olmax.lockfile`) while the others wait and then read it.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence

from olmax.errors import ConfigError, OlmaxError, RestartableError
from olmax.lockfile import LockFile, LockHeld, describe_holder
from olmax.transport import url_scheme

log = logging.getLogger(__name__)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def dir_mode() -> int:
    """The mode a new folder gets under the process's umask (``mkdtemp`` makes 0700 ones)."""
    return 0o777 & ~_umask()


def publish_file(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Give the temporary file normal permissions and rename it into place."""
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


# What an OSError means about its input rather than the storage: a path that is not there, not
# permitted, of the wrong kind or not a valid name. The rest (a full disk or quota, a read-only
# file system, EIO, ESTALE, a timeout, a dropped connection) is the storage's trouble, which may
# pass: a restart can help (exit 75).
_INPUT_ERRNOS = {errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL}
# The storage failures a library may report only in words (TensorStore under Orbax: "No space
# left on device [os_error_code='28']"), found by :func:`storage_errno`.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.ESTALE,
                  errno.ENOTCONN, errno.ETIMEDOUT, errno.ECONNRESET)
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def storage_errno(e: BaseException | None) -> int | None:
    """The errno of a storage failure (``STORAGE_ERRNOS``) behind ``e``: an OSError in its chain
    of causes, or one a library wrapped into its message (TensorStore's ``os_error_code``, or the
    error's words); None when there is none."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e.errno
        text = str(e)
        m = _OS_ERROR_CODE.search(text)
        if m and int(m.group(1)) in STORAGE_ERRNOS:
            return int(m.group(1))
        for code in STORAGE_ERRNOS:
            if os.strerror(code) in text:
                return code
        e = e.__cause__ or e.__context__
    return None


def input_error(e: OSError) -> bool:
    """Whether ``e`` says the path given was wrong (a restart cannot help), not the storage."""
    return (isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError,
                           NotADirectoryError, FileExistsError))
            or e.errno in _INPUT_ERRNOS)


def require_utf8_name(path: str | os.PathLike, what: str, needs: str) -> None:
    """Refuse ``path`` when its name is not UTF-8 text (bytes the file system allows, which
    Python holds as lone surrogates): one :class:`ConfigError` naming it (``what``, e.g.
    ``checkpoint directory``) and why (``needs``: the library that takes UTF-8 names only),
    before any work."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{what} {text!r}: the name is not UTF-8 text, which {needs} needs; "
                          f"rename it") from None


def bucket_text(path: str | os.PathLike, what: str = "") -> bool:
    """Whether ``path`` is a URL (``s3://``, ``gs://``, ``https://``), which a local output cannot
    be; text that looks like one but is not (``s3:/b/x``) is a ConfigError naming ``what``
    (:func:`olmax.transport.url_scheme`), not a local path."""
    return url_scheme(path, what) is not None


def write_error(path: str | os.PathLike, e: OSError) -> OlmaxError:
    """The one line for a write that failed (a full disk, a read-only file system): it names
    ``path``, the file being written, not a temporary beside it. A failure of the storage (not of
    the path given) is a :class:`RestartableError`."""
    cls = OlmaxError if input_error(e) else RestartableError
    return cls(f"cannot write {path}: {e.strerror or e}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that appears at ``path`` only when the block completes (temp + fsync + rename).
    An OSError on the way (no space left, no permission) is an OlmaxError naming ``path``."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        publish_file(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        raise


def _same_file(a: Path, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def as_inputs(paths: Sequence[str], what: str) -> list[tuple[str, str]]:
    """``(path, what)`` for each of ``paths`` that is a local file (entries written
    ``LABEL=PATH,PATH`` are split), for :func:`refuse_existing`'s ``inputs``."""
    names = [name for p in paths for name in str(p).split("=", 1)[-1].split(",")]
    return [(name, what) for name in names if os.path.isfile(name)]


def refuse_existing(path: str | os.PathLike, overwrite: bool = False, *, flag: str = "",
                    inputs: Sequence[tuple[str | os.PathLike, str]] = ()) -> Path:
    """``path`` as a Path, checked as an output a user named (the rules of the module notes): an
    OlmaxError, naming the command-line ``flag`` that gave it, when something exists there and not
    ``overwrite``; always when it is one of ``inputs`` (``(path, what it is)`` pairs: "the recipe")
    or exists and is not a regular file."""
    if bucket_text(path, flag):
        raise OlmaxError(f"{flag + ' ' if flag else ''}{path}: a bucket path; this writes a local "
                         f"file (write it locally, then copy it)")
    p = Path(path)
    named = f"{flag + ' ' if flag else ''}{p}"
    for source, what in inputs:
        if _same_file(p, source):
            raise OlmaxError(f"{named} is {what} this command reads; write to another file")
    if not os.path.lexists(p):
        return p
    if p.is_dir():
        raise OlmaxError(f"{named} is a directory; give a file name")
    if p.exists() and not p.is_file():
        raise OlmaxError(f"{named} exists and is not a regular file (a FIFO, socket or device); "
                         f"give another file name")
    if not overwrite:
        raise OlmaxError(f"{named} already exists (remove it or pass --force)")
    return p


def refuse_outputs(outputs: Sequence[tuple[str, str | os.PathLike | None]], overwrite: bool = False,
                   *, inputs: Sequence[tuple[str | os.PathLike, str]] = ()) -> None:
    """Each named output of a command (``(flag, path)``; None: not asked for) checked by
    :func:`refuse_existing`, and no two of them the same file (one would overwrite the other)."""
    named = [(flag, path) for flag, path in outputs if path]
    for i, (flag, path) in enumerate(named):
        for other, earlier in named[:i]:
            if _same_file(Path(path), earlier):
                raise OlmaxError(f"{other} and {flag} both name {path}: give each output a file "
                                 f"of its own")
    for flag, path in named:
        refuse_existing(path, overwrite, flag=flag, inputs=inputs)


def contained(root: str | os.PathLike, name: str, *, what: str = "") -> Path:
    """``root / name``, where ``name`` comes from data (a mix line, a URL path) and must stay below
    ``root``: an absolute name, a ``..`` segment or an empty name is an OlmaxError naming ``what``
    (the source of the name) and ``root``."""
    parts = [part for part in name.split("/") if part not in ("", ".")]
    up = ".." in parts or ".." in name.replace("\\", "/").split("/")
    where = f"{what}: " if what else ""
    if name.startswith("/") or up:
        reason = "an absolute path" if name.startswith("/") else "'..' segments"
        raise OlmaxError(f"{where}{name!r} would be written outside {root} ({reason}); nothing "
                         f"was written")
    if not parts:
        raise OlmaxError(f"{where}{name!r} names no file below {root}")
    return Path(root).joinpath(*parts)


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of ``path`` (a file a user gave); text in another encoding is an OlmaxError
    naming the file. Other OSErrors (a missing file) are the caller's to word."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OlmaxError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def env_int(name: str, default: int, *, minimum: int = 1, unit: str = "") -> int:
    """The integer environment variable ``name`` (``default`` when unset); a value that is not a
    whole number of at least ``minimum`` is an OlmaxError naming the variable."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise OlmaxError(f"{name}={raw!r}: expected a whole number{' of ' + unit if unit else ''} "
                         f">= {minimum}")
    return value


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, overwrite: bool = True) -> Path:
    """Atomically replace ``path`` with ``data`` (``overwrite=False``: refuse an existing file)."""
    p = refuse_existing(path, overwrite)
    with atomic_output(p) as f:
        f.write(data)
    return p


def write_text_atomic(path: str | os.PathLike, text: str, *, overwrite: bool = True) -> Path:
    return write_bytes_atomic(path, text.encode(), overwrite=overwrite)


def write_json_atomic(path: str | os.PathLike, obj: Any, *, overwrite: bool = True) -> Path:
    """``obj`` as indented JSON with a final newline, written atomically."""
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n", overwrite=overwrite)


def check_output_dir(path: str | os.PathLike) -> Path:
    """Refuse an existing non-empty directory (or a file) at ``path``, or a bucket path (an output
    folder is written locally, then renamed into place); return it as a Path."""
    if bucket_text(path, "output directory"):
        raise OlmaxError(f"output directory {path}: a bucket path; this writes a local directory "
                         f"(write it locally, then copy it: gcloud storage cp -r / aws s3 cp "
                         f"--recursive)")
    out = Path(path)
    if out.exists():
        if not out.is_dir():
            raise OlmaxError(f"output path exists and is not a directory: {out}")
        if any(out.iterdir()):
            raise OlmaxError(f"output directory exists and is not empty: {out}")
    return out


def _remove_settled(tmp: Path, settle_s: float = 0.2, patience_s: float = 30.0) -> None:
    """Remove ``tmp`` and a writer's own temporaries beside it (``<tmp>.*``: orbax's), again until
    none has come back for ``settle_s``. A writer that failed in one thread may still be finishing
    files in others (orbax abandons its other writes when one raises): a single ``rmtree`` racing
    them can leave a directory behind that they filled while it was being emptied."""
    def leftovers() -> list[Path]:
        return [p for p in [tmp, *tmp.parent.glob(f"{glob.escape(tmp.name)}.*")] if p.exists()]

    deadline = time.monotonic() + patience_s
    while True:
        for leftover in leftovers():
            shutil.rmtree(leftover, ignore_errors=True)
        time.sleep(settle_s)
        if not leftovers() or time.monotonic() > deadline:
            return


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temp directory beside ``path``; on success rename it to ``path``.

    On any error the temp directory (and any parent directories this call created) is removed,
    so nothing half-written is left behind. An existing empty directory at ``path`` is replaced;
    a non-empty one is refused before anything is written. The directory gets the mode the umask
    gives a new one (not the temporary's 0700).
    """
    out = check_output_dir(path).absolute()
    created = []
    parent = out.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        check_output_dir(out)  # still free (nobody wrote it meanwhile)
        if out.exists():
            out.rmdir()
        os.chmod(tmp, dir_mode())   # mkdtemp's 0700 is for the temporary only
        os.rename(tmp, out)
    except BaseException:
        _remove_settled(tmp)
        for d in created:  # innermost first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def hash_into(hasher: Any, path: str | os.PathLike) -> Any:
    """``hasher`` (a ``hashlib`` object) fed the bytes of ``path``, read 4 MiB at a time."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            hasher.update(chunk)
    return hasher


def sha256_file(path: str | os.PathLike) -> str:
    return hash_into(hashlib.sha256(), path).hexdigest()


def local_dir(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a local folder a command writes: a URL (or text that looks like one but is
    not: ``s3:/b/x``) is a ConfigError naming ``what``, never a folder named ``s3:``."""
    if bucket_text(path, what):
        raise ConfigError(f"{what} {path}: a URL; this is a local folder")
    return Path(path)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$OLMAX_CACHE``, else ``~/.cache/olmax``: a local folder."""
    if cache_dir is not None:
        return local_dir(cache_dir, "data.cache_dir")
    env = os.environ.get("OLMAX_CACHE")
    return local_dir(env, "OLMAX_CACHE") if env else Path.home() / ".cache" / "olmax"


_BUILDING: dict[str, threading.Lock] = {}
_BUILDING_GUARD = threading.Lock()


# A cache file :func:`build_once` checksums ends in this trailer: a magic and the SHA-256 of all
# the bytes before it. A file without it (torn, zero-filled, from another program) is no cache.
CHECKSUM_MAGIC = b"OLMAXSUM"
CHECKSUM_TRAILER = len(CHECKSUM_MAGIC) + 32
_VERIFIED: dict[str, tuple[int, int, int, int]] = {}


class _HashingWriter:
    """A write-only file that feeds what it writes to a SHA-256."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.hash = f, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def checksum_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a cache file whose trailer (see ``CHECKSUM_MAGIC``) matches its bytes,
    or None when it is. Hashed once per process while the file stays the same (inode, size,
    modification time)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if _VERIFIED.get(str(path.absolute())) == stamp:
                return None
            if st.st_size < CHECKSUM_TRAILER:
                return f"{st.st_size} bytes, too short to hold its checksum"
            f.seek(st.st_size - CHECKSUM_TRAILER)
            trailer = f.read(CHECKSUM_TRAILER)
            if trailer[:len(CHECKSUM_MAGIC)] != CHECKSUM_MAGIC:
                return "no checksum at its end (torn or zero-filled)"
            f.seek(0)
            h, left = hashlib.sha256(), st.st_size - CHECKSUM_TRAILER
            while left:
                chunk = f.read(min(left, 1 << 22))
                if not chunk:
                    return "shorter than it was"
                h.update(chunk)
                left -= len(chunk)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if h.digest() != trailer[len(CHECKSUM_MAGIC):]:
        return "its bytes do not match its checksum"
    _VERIFIED[str(path.absolute())] = stamp
    return None


def build_once(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, what: str,
               poll_s: float = 2.0, checksum: bool = False) -> Path:
    """``path``, written by ``write`` (into :func:`atomic_output`) unless it exists: by one thread
    of one process at a time, whichever takes ``<path>.lock`` first; every other caller, in this
    process or any other that sees the same storage, waits for the file and builds nothing. A
    builder that dies leaves a lock that goes stale (:mod:`olmax.lockfile`), and a waiter takes
    over the build.

    With ``checksum``, the file ends in a trailer holding the SHA-256 of its bytes (the reader
    skips the last ``CHECKSUM_TRAILER`` bytes), and an existing file is used only when the trailer
    matches; one that does not is logged as such and rebuilt, never read."""
    path = Path(path)
    with _BUILDING_GUARD:
        local = _BUILDING.setdefault(str(path.resolve()), threading.Lock())

    def usable() -> bool:
        if not path.is_file():
            return False
        if not checksum:
            return True
        problem = checksum_problem(path)
        if problem is None:
            return True
        log.warning(f"olmax: {what} {path} is damaged ({problem}); rebuilding it")
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise write_error(path, e) from None
        return False

    def build(f: BinaryIO) -> None:
        if not checksum:
            write(f)
            return
        out = _HashingWriter(f)
        write(out)
        f.write(CHECKSUM_MAGIC + out.hash.digest())

    with local:
        if path.is_file() and (not checksum or checksum_problem(path) is None):
            return path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(path, e) from None
        lock = LockFile(path.with_name(f"{path.name}.lock"), subject=f"{what} {path}")
        told = False
        while True:
            if path.is_file() and (not checksum or checksum_problem(path) is None):
                break
            try:
                lock.acquire()
            except LockHeld as e:
                if not told:
                    log.info(f"olmax: waiting for {describe_holder(e.holder)} to build {what} {path}")
                    told = True
                time.sleep(poll_s)
                continue
            try:
                if not usable():
                    with atomic_output(path) as f:
                        build(f)
            finally:
                lock.release()
    return path
