"""``olmax data fetch``: copy remote token files to a local folder, parallel, resumable, verified.

For those who prefer local disks to reading in place: the files of a mix (its ``label,path`` lines
joined to ``--root``) or the given paths are copied to ``--to``, keeping their paths below the
root, so ``data.mix=MIX data.root=DIR`` then reads the copies. Each file is one
:func:`olmax.data.remote.download` (ranged reads into ``<file>.part``, resumed from its length
after any crash or ``kill -9``, checked against the store's size and MD5 before it is renamed into
place); ``workers`` files are copied at a time. Files already complete are skipped.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from tqdm import tqdm

from olmax.config import ConfigError, OlmaxError
from olmax.data.mixfile import DEFAULT_MIX_TOKENIZER, read_mix_file
from olmax.data.remote import download, is_remote, join, remote_files
from olmax.data.token_files import parse_dtype


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
    """The files to copy: one mix file (``*.txt``) or paths (relative to ``root``, or URLs)."""
    if root is not None and not is_remote(root):
        raise ConfigError(f"--root must be an s3://, gs:// or http(s):// URL, got {root!r}")
    if len(sources) == 1 and sources[0].endswith(".txt") and not is_remote(sources[0]):
        urls = [e.path for e in read_mix_file(sources[0], root=root, tokenizer=mix_tokenizer)]
    else:
        urls = [join(root, p) for p in sources]
    local = [u for u in urls if not is_remote(u)]
    if local:
        raise ConfigError(f"not a remote file: {local[0]} (give --root URL for relative paths)")
    out = Path(to)
    items = {u: FetchItem(u, out / local_name(u, root)) for u in urls}
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
    present = [i for i in items if i.dest.is_file() and i.dest.stat().st_size == i.size]
    bar = tqdm(total=total, initial=sum(i.size for i in present), unit="B", unit_scale=True,
               unit_divisor=1024, desc="fetch", file=sys.stderr, disable=not progress,
               mininterval=0.5)
    t0 = time.perf_counter()
    fetched, failures = 0, []
    with ThreadPoolExecutor(max(1, min(workers, len(items)))) as pool:
        jobs = {pool.submit(download, files, i.url, i.dest, progress=bar.update): i
                for i in items if i not in present}
        for job in as_completed(jobs):
            item = jobs[job]
            try:
                n = job.result()
            except OlmaxError as e:
                failures.append(str(e))
                continue
            if n < 0:
                failures.append(f"{item.url}: another process is copying it to {item.dest}")
            else:
                fetched += n
                if n < item.size:  # resumed: the part's earlier bytes count as done
                    bar.update(item.size - n)
    bar.close()
    seconds = time.perf_counter() - t0
    summary = {"files": len(items), "already_present": len(present),
               "copied": len(items) - len(present) - len(failures), "failed": len(failures),
               "bytes": total, "tokens": total // itemsize, "dtype": dtype,
               "bytes_transferred": fetched, "seconds": seconds}
    if failures:
        more = f" ({len(failures) - 1} more failed; run again to resume)" if len(failures) > 1 else ""
        raise OlmaxError(failures[0] + more)
    return summary


__all__ = ["FetchItem", "plan", "fetch", "local_name"]
