"""The embedded corpus: real text every machine has, for the Quickstart and tests.

Documents are the running interpreter's standard-library sources (every ``*.py`` under the stdlib
directory, ``site-packages`` excluded, sorted by relative path, decoded as UTF-8 with replacement) and
then the ``pydoc_data.topics`` entries (sorted by topic). Empty documents are skipped.

The held-out split is by document and deterministic. A document is a held-out *candidate* when the
first 4 bytes of ``sha256(name)`` (big-endian) are divisible by 20 (about 5 %); the name is
``stdlib/<relative path>`` or ``pydoc/<topic>``. The standard library is full of copies (identical
``__init__.py`` files, one codec module per code page), so a split by name alone leaks: a candidate
stays held out only if it is not a copy of a training document, i.e. its text differs from every
training document and fewer than ``NEAR_DUP_FRACTION`` of its distinct 8-word shingles occur in
the training split. Candidates that fail go to training. The held-out set is therefore genuinely
unseen, which ``olmax data overlap --train embedded --eval embedded`` confirms. The held-out names
are cached (``embedded/heldout-<key>.json``, keyed by a hash of the documents and the rule): the
shingling takes ~2 s, at the start of every run on the embedded corpus otherwise.

:func:`embedded_token_files` tokenizes a split with dolma2 into OLMo-format token files (each
document + one EOS, raw uint32 LE, files of at most ``FILE_TOKENS`` tokens split between documents),
cached under ``$OLMAX_CACHE`` (default ``~/.cache/olmax``) in a folder keyed by a hash of the
documents and the tokenizer, built in a temporary folder and renamed into place. Its manifest names
each file's SHA-256; a cached split whose files do not match is logged and rebuilt, never read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sysconfig
import tempfile
import zlib
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

import numpy as np

from olmax.errors import ConfigError, OlmaxError
from olmax.data.token_files import DocumentWriter
from olmax.data.tokenizer import get_tokenizer
from olmax.io import (CHECKSUM_TRAILER, build_once, cache_root, dir_mode, sha256_file,
                      write_bytes_atomic)

try:
    from pydoc_data.topics import topics as PYDOC_TOPICS
except ImportError:  # pragma: no cover - part of every CPython, but some distributions strip it
    PYDOC_TOPICS = {}

log = logging.getLogger(__name__)

FILE_TOKENS = 1 << 21
HELDOUT_MODULUS = 20
SHINGLE_WORDS = 8
NEAR_DUP_FRACTION = 0.1
SPLITS = ("train", "heldout")
_FORMAT_VERSION = 3


def _is_heldout_candidate(name: str) -> bool:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % HELDOUT_MODULUS == 0


def _shingles(text: str) -> set[int]:
    """Stable 64-bit hashes of the text's 8-word shingles (the whole text if it is shorter)."""
    words = text.split()
    n = SHINGLE_WORDS
    grams = [" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))]
    out = set()
    for g in grams:
        b = g.encode("utf-8", "replace")
        out.add((zlib.crc32(b) << 32) | zlib.adler32(b))
    return out


def _compute_heldout_names(docs: tuple[tuple[str, str], ...]) -> frozenset[str]:
    """Candidates that are neither exact nor near copies of a training document."""
    candidates = [(n, t) for n, t in docs if _is_heldout_candidate(n)]
    cand_shingles = {n: _shingles(t) for n, t in candidates}
    wanted = set().union(*cand_shingles.values()) if cand_shingles else set()
    train_texts = set()
    seen: set[int] = set()
    for n, t in docs:
        if _is_heldout_candidate(n):
            continue
        train_texts.add(hashlib.sha256(t.encode("utf-8", "replace")).digest())
        seen.update(h for h in _shingles(t) if h in wanted)
    keep = set()
    for n, t in candidates:
        if hashlib.sha256(t.encode("utf-8", "replace")).digest() in train_texts:
            continue
        sh = cand_shingles[n]
        if len(sh & seen) < NEAR_DUP_FRACTION * len(sh):
            keep.add(n)
    return frozenset(keep)


@lru_cache(maxsize=2)
def _corpus_key(docs: tuple[tuple[str, str], ...]) -> str:
    """A hash of the documents (names and texts) and of the split's rule (once per corpus: every
    split's listing asks for it)."""
    h = hashlib.sha256(json.dumps({"modulus": HELDOUT_MODULUS, "shingle_words": SHINGLE_WORDS,
                                   "near_dup_fraction": NEAR_DUP_FRACTION}).encode())
    for name, text in docs:
        h.update(name.encode() + b"\0" + hashlib.sha256(text.encode("utf-8", "replace")).digest())
    return h.hexdigest()[:16]


_HELDOUT: dict[str, frozenset[str]] = {}


def _heldout_names(cache_dir: str | os.PathLike | None = None) -> frozenset[str]:
    """The held-out names: computed once per corpus (~2 s of shingling), kept in the cache as
    ``embedded/heldout-<corpus key>.json`` (checksummed; built by one process at a time) and once
    per process in memory. A cache that cannot be written or read is no error: the names are
    computed here instead."""
    docs = _all_documents()
    key = _corpus_key(docs)
    if key in _HELDOUT:
        return _HELDOUT[key]
    path = cache_root(cache_dir) / "embedded" / f"heldout-{key}.json"
    names = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        def write(f: BinaryIO) -> None:
            f.write(json.dumps(sorted(_compute_heldout_names(docs))).encode())

        build_once(path, write, what="the embedded held-out split", checksum=True)
        names = frozenset(json.loads(path.read_bytes()[:-CHECKSUM_TRAILER]))
        if not names <= {n for n, _ in docs if _is_heldout_candidate(n)}:
            raise ValueError("names that are not held-out candidates")
    except (OSError, OlmaxError, ValueError, TypeError) as e:
        log.debug(f"olmax: held-out split not cached at {path} ({e}); computing it")
        names = None
    if names is None:
        names = _compute_heldout_names(docs)
    _HELDOUT[key] = names
    return names


@lru_cache(maxsize=1)
def _all_documents() -> tuple[tuple[str, str], ...]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[tuple[str, str]] = []
    files = sorted(
        (p for p in stdlib.rglob("*.py") if "site-packages" not in p.relative_to(stdlib).parts),
        key=lambda p: p.relative_to(stdlib).as_posix(),
    )
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        if text:
            docs.append((f"stdlib/{path.relative_to(stdlib).as_posix()}", text))
    for key in sorted(PYDOC_TOPICS):
        if PYDOC_TOPICS[key]:
            docs.append((f"pydoc/{key}", PYDOC_TOPICS[key]))
    return tuple(docs)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"embedded split must be one of {SPLITS}, got {split!r}")


def embedded_named_documents(split: str = "train", cache_dir: str | os.PathLike | None = None
                             ) -> list[tuple[str, str]]:
    """``(name, text)`` of the split's documents, in corpus order (``cache_dir``: where the
    held-out split is cached, see :func:`_heldout_names`)."""
    _check_split(split)
    want_heldout = split == "heldout"
    held = _heldout_names(cache_dir)
    return [(n, t) for n, t in _all_documents() if (n in held) == want_heldout]


def embedded_documents(split: str = "train", cache_dir: str | os.PathLike | None = None) -> list[str]:
    """The texts of the split's documents, in corpus order."""
    return [t for _, t in embedded_named_documents(split, cache_dir)]


def _split_key(split: str, tokenizer_identity: dict, cache_dir: str | os.PathLike | None = None) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"v": _FORMAT_VERSION, "split": split, "file_tokens": FILE_TOKENS,
                         "tokenizer": tokenizer_identity}, sort_keys=True).encode())
    for name, text in embedded_named_documents(split, cache_dir):
        h.update(name.encode() + b"\0" + hashlib.sha256(text.encode("utf-8", "replace")).digest())
    return h.hexdigest()[:16]


def _damage(final: Path) -> str | None:
    """Why the cached split in ``final`` cannot be used (its manifest unreadable, a file missing or
    not the bytes the manifest's SHA-256 names), or None."""
    try:
        files = json.loads((final / "manifest.json").read_text())["files"]
        for f in files:
            if sha256_file(final / f["path"]) != f["sha256"]:
                return f"{f['path']} does not match its checksum"
    except FileNotFoundError as e:
        return f"{Path(e.filename).name} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({type(e).__name__})"
    return None


def embedded_token_files(split: str = "train", cache_dir: str | os.PathLike | None = None) -> list[str]:
    """The split tokenized with dolma2 (doc + EOS, raw uint32), cached; returns the file paths in order."""
    tok = get_tokenizer("dolma2")
    key = _split_key(split, tok.identity, cache_dir)
    root = cache_root(cache_dir) / "embedded"
    final = root / f"{split}-{key}"
    manifest = final / "manifest.json"
    if final.exists():
        problem = _damage(final)
        if problem is None:
            return [str(final / f["path"]) for f in json.loads(manifest.read_text())["files"]]
        log.warning(f"olmax: the embedded corpus cache {final} is damaged ({problem}); rebuilding it")
        aside = root / f".{final.name}.damaged-{os.getpid()}"
        try:
            os.rename(final, aside)
        except FileNotFoundError:
            pass                    # another process moved it first
        shutil.rmtree(aside, ignore_errors=True)

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{split}-{key}.", dir=root))
    try:
        texts = embedded_documents(split, cache_dir)
        writer = DocumentWriter(tmp, lambda k: f"part-{k:05d}.npy", max_tokens=FILE_TOKENS,
                                dtype=np.dtype(np.uint32), eos_token_id=tok.eos_token_id,
                                vocab_size=tok.vocab_size)
        for i in range(0, len(texts), 64):
            for ids in tok.encode_batch(texts[i:i + 64]):
                writer.add(ids, "embedded corpus")
        writer.flush()
        files = writer.files
        write_bytes_atomic(tmp / "manifest.json", json.dumps(
            {"split": split, "tokenizer": tok.identity, "files": files}, indent=1).encode())
        try:
            os.chmod(tmp, dir_mode())    # mkdtemp's 0700 is for the temporary only
            os.rename(tmp, final)
        except OSError:
            if not manifest.is_file():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return [str(final / f["path"]) for f in json.loads(manifest.read_text())["files"]]
