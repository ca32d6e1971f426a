"""``olmax data fetch``: copy remote token files to a local folder, parallel, resumable, verified.

For those who prefer local disks to reading in place: the files of a mix (its ``label,path`` lines
joined to ``--root``) or the given paths are copied to ``--to``, keeping their paths below the
root, so ``data.mix=MIX data.root=DIR`` then reads the copies. Every destination must lie below
``--to`` (:func:`olmax.io.contained`: a mix line or URL path with ``..`` segments is refused by
name before anything is written). Each file is one :func:`olmax.data.remote.download` (ranged
reads into ``<file>.part``, resumed from its length after any crash or ``kill -9``, checked against
the store's size and MD5 before it is renamed into place); ``workers`` files are copied at a time.
A file already there counts as present only when it is a verified copy
(:func:`olmax.data.remote.verified_copy`, never by its size alone); one that is not is copied
again and replaced. Ctrl-C stops every copy after the chunk in flight (their parts stay, for the
next run to resume) and ends the command at once.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from tqdm import tqdm

from olmax.errors import ConfigError, OlmaxError
from olmax.data.mixfile import DEFAULT_MIX_TOKENIZER, read_mix_file
from olmax.data.remote import Stopped, download, is_remote, join, remote_files, verified_copy
from olmax.data.token_files import parse_dtype
from olmax.io import contained

POLL_S = 0.2       # how often the main thread wakes while it waits for the copies
STOP_WAIT_S = 5.0   # after Ctrl-C: how long the copies in flight may take to finish their chunk


@dataclass(frozen=True)
class FetchItem:
    url: str
    dest: Path
    size: int = 0


def local_name(url: str, root: str | None) -> str:
    """Where ``url`` goes below the destination: its path below ``root``, else ``host/path``."""
    if root:
        base = root.rstrip("/") + "/"
        if url.startswith(base):
            return url[len(base):]
    parts = urlsplit(url)
    return f"{parts.netloc}/{parts.path.lstrip('/')}"


def plan(sources: list[str], *, root: str | None, to: str | os.PathLike,
         mix_tokenizer: str = DEFAULT_MIX_TOKENIZER) -> list[FetchItem]:
    """The files to copy: one mix file (``*.txt``) or paths (relative to ``root``, or URLs). A
    destination that would leave ``to`` is an OlmaxError naming the mix line or path."""
    if root is not None and not is_remote(root):
        raise ConfigError(f"--root must be an s3://, gs:// or http(s):// URL, got {root!r}")
    if len(sources) == 1 and sources[0].endswith(".txt") and not is_remote(sources[0]):
        named = [(e.path, f"{sources[0]}:{e.line}")
                 for e in read_mix_file(sources[0], root=root, tokenizer=mix_tokenizer)]
    else:
        named = [(join(root, p), p) for p in sources]
    local = [u for u, _ in named if not is_remote(u)]
    if local:
        raise ConfigError(f"not a remote file: {local[0]} (give --root URL for relative paths)")
    items = {u: FetchItem(u, contained(to, local_name(u, root), what=where)) for u, where in named}
    return list(items.values())


def fetch(items: list[FetchItem], *, workers: int = 4, dtype: str = "uint32",
          progress: bool = True) -> dict:
    """Copy every item (``workers`` at a time); returns the summary. The first failure (after the
    other copies finish) is an OlmaxError naming the file and how many failed."""
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    itemsize = parse_dtype(dtype).itemsize
    files = remote_files()
    sizes = files.sizes([i.url for i in items])
    for item, size in zip(items, sizes):
        if size % itemsize:
            raise OlmaxError(f"{item.url}: size {size} bytes is not a multiple of {itemsize} "
                             f"({dtype} tokens); the file is truncated or not a token file")
    items = [FetchItem(i.url, i.dest, s) for i, s in zip(items, sizes)]
    total = int(np.sum(sizes, dtype=np.int64)) if sizes else 0
    present = [i for i in items if verified_copy(files, i.url, i.dest)]
    todo = [i for i in items if i not in present]
    replaced = sum(i.dest.exists() for i in todo)
    bar = tqdm(total=total, initial=sum(i.size for i in present), unit="B", unit_scale=True,
               unit_divisor=1024, desc="fetch", file=sys.stderr, disable=not progress,
               mininterval=0.5)
    t0 = time.perf_counter()
    fetched, failures = 0, []
    for item, outcome in _copy_all(files, todo, workers, bar.update):
        if isinstance(outcome, OlmaxError):
            failures.append(str(outcome))
        elif outcome < 0:
            failures.append(f"{item.url}: another process is copying it to {item.dest}")
        else:
            fetched += outcome
            if outcome < item.size:  # resumed: the part's earlier bytes count as done
                bar.update(item.size - outcome)
    bar.close()
    seconds = time.perf_counter() - t0
    summary = {"files": len(items), "already_present": len(present),
               "copied": len(todo) - len(failures), "replaced": replaced, "failed": len(failures),
               "bytes": total, "tokens": total // itemsize, "dtype": dtype,
               "bytes_transferred": fetched, "seconds": seconds}
    if failures:
        more = f" ({len(failures) - 1} more failed; run again to resume)" if len(failures) > 1 else ""
        raise OlmaxError(failures[0] + more)
    return summary


def _get(q: queue.Queue):
    """``q.get()``, waking every ``POLL_S``: the kernel may hand a Ctrl-C to any of the
    process's threads, and Python runs its handler only when the main thread runs again, which
    a wait without a timeout would put off until the next file is done."""
    while True:
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            continue


def _copy_all(files, items: list[FetchItem], workers: int, progress):
    """Yield ``(item, bytes transferred or -1 or OlmaxError)`` as ``workers`` daemon threads copy
    the items. On KeyboardInterrupt the copies stop after their chunk in flight (waiting at most
    ``STOP_WAIT_S``) and the interrupt goes on: nothing waits for the files not yet started."""
    todo: queue.Queue = queue.Queue()
    for item in items:
        todo.put(item)
    done: queue.Queue = queue.Queue()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((item, download(files, item.url, item.dest, progress=progress, stop=stop)))
            except Stopped:
                return
            except OlmaxError as e:
                done.put((item, e))
            except BaseException as e:  # handed to the main thread, raised there
                done.put((item, e))

    threads = [threading.Thread(target=work, daemon=True, name=f"olmax-fetch-{n}")
               for n in range(max(1, min(workers, len(items))))]
    for t in threads:
        t.start()
    try:
        for _ in items:
            item, outcome = _get(done)
            if isinstance(outcome, BaseException) and not isinstance(outcome, OlmaxError):
                raise outcome
            yield item, outcome
    except BaseException:
        stop.set()
        deadline = time.monotonic() + STOP_WAIT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        raise


__all__ = ["FetchItem", "plan", "fetch", "local_name"]
