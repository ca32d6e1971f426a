"""What a token file's ``manifest.json`` says about it.

``olmax tokenize`` (and the embedded corpus) write ``manifest.json`` beside their token files:
the token dtype and, per file, its name, documents, tokens and sha256. Wherever a local token file
is sized (training data, held-out sets, ``data inspect``), the size on disk is checked against the
manifest in its folder when there is one, so a file cut short (a copy interrupted, a disk full) or
read with the wrong dtype is refused by name instead of trained on. Files without a manifest, and
remote files (URLs), are taken as they are: their size is all there is to know.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from olmax.errors import OlmaxError

MANIFEST = "manifest.json"


class ManifestEntry(NamedTuple):
    manifest: Path
    dtype: np.dtype
    tokens: int


@functools.lru_cache(maxsize=256)
def _read(manifest: str, mtime_ns: int, size: int) -> tuple[str | None, dict[str, int]]:
    try:
        data = json.loads(Path(manifest).read_text())
        files = {str(f["path"]): int(f["tokens"]) for f in data.get("files", [])}
        return data.get("dtype"), files
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None, {}      # not one of ours (or unreadable): no claims about the files


def manifest_entry(path: str | os.PathLike) -> ManifestEntry | None:
    """The manifest's record of the local token file ``path``, or None when no manifest in its
    folder lists it."""
    p = Path(path)
    manifest = p.parent / MANIFEST
    try:
        st = manifest.stat()
    except OSError:
        return None
    dtype, files = _read(str(manifest), st.st_mtime_ns, st.st_size)
    tokens = files.get(p.name)
    if tokens is None or dtype is None:
        return None
    try:
        return ManifestEntry(manifest, np.dtype(dtype), tokens)
    except TypeError:
        return None


def check_against_manifest(path: str, size: int, dtype: np.dtype) -> None:
    """Raise an OlmaxError naming ``path`` when its manifest disagrees with its ``size`` in bytes
    or with the ``dtype`` it is about to be read as."""
    entry = manifest_entry(path)
    if entry is None:
        return
    if entry.dtype.itemsize != np.dtype(dtype).itemsize:
        raise OlmaxError(f"{path}: its {entry.manifest} says the tokens are {entry.dtype.name}, but "
                         f"they are being read as {np.dtype(dtype).name}")
    want = entry.tokens * entry.dtype.itemsize
    if size != want:
        raise OlmaxError(f"{path}: {size} bytes on disk, but {entry.manifest} lists {entry.tokens} "
                         f"{entry.dtype.name} tokens ({want} bytes): the file is "
                         f"{'truncated' if size < want else 'longer than written'}; copy it again "
                         f"or re-tokenize")


def directory_hint(path: str) -> str:
    """A hint for a folder given where a token file belongs."""
    manifest = Path(path) / MANIFEST
    try:
        n = len(json.loads(manifest.read_text()).get("files", []))
    except (OSError, ValueError, AttributeError):
        return ""
    return f" (its {MANIFEST} lists {n} token file(s): name those instead)"


__all__ = ["manifest_entry", "check_against_manifest", "directory_hint", "ManifestEntry"]
