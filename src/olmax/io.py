"""Files olmax writes and the folder it caches in (the bottom layer, with :mod:`olmax.config`).

Every output is written atomically: into a temporary file (or folder) beside the target, flushed to
disk, then renamed into place, so a reader never sees half of it and an interrupted writer leaves
the previous version (or nothing) behind. Outputs a user names on the command line are refused when
they already exist unless the caller passes ``overwrite=True`` (``--force``).

The cache (OLMES data, embedded corpus, epoch indices) lives in ``data.cache_dir`` when a run sets
it, else ``$OLMAX_CACHE``, else ``~/.cache/olmax``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from olmax.config import OlmaxError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_file(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Give the temporary file normal permissions and rename it into place."""
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that appears at ``path`` only when the block completes (temp + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        publish_file(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def refuse_existing(path: str | os.PathLike, overwrite: bool = False, *, flag: str = "") -> Path:
    """``path`` as a Path; an existing file there is an OlmaxError (naming the command-line
    ``flag`` that gave it, if any) unless ``overwrite``."""
    p = Path(path)
    if p.exists() and not overwrite:
        raise OlmaxError(f"{flag + ' ' if flag else ''}{p} already exists (remove it or pass --force)")
    return p


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
    """Refuse an existing non-empty directory (or a file) at ``path``; return it as a Path."""
    out = Path(path)
    if out.exists():
        if not out.is_dir():
            raise OlmaxError(f"output path exists and is not a directory: {out}")
        if any(out.iterdir()):
            raise OlmaxError(f"output directory exists and is not empty: {out}")
    return out


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temp directory beside ``path``; on success rename it to ``path``.

    On any error the temp directory (and any parent directories this call created) is removed,
    so nothing half-written is left behind. An existing empty directory at ``path`` is replaced;
    a non-empty one is refused before anything is written.
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
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for aside in tmp.parent.glob(f"{tmp.name}.*"):   # a writer's own temporaries (orbax)
            shutil.rmtree(aside, ignore_errors=True)
        for d in created:  # innermost first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$OLMAX_CACHE``, else ``~/.cache/olmax``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("OLMAX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "olmax"
