"""Packed, document-masked instances, exactly as OLMo-core's ``NumpyPackedFSLDataset``
(``data/numpy_dataset.py``) and its packer (``pack_documents_into_instances``, ``InstancePacker`` in
``data/utils.py``) define them. OLMo 3's long-context stage trains on these.

* Files are taken in order (after the optional source permutation,
  :func:`olmax.data.sources.permute_sources`) and cut into groups of ``source_group_size``
  consecutive files; each group is packed on its own as if its files were one array.
* Documents: every EOS ends one (with a BOS token: an EOS followed by BOS, or the file's last
  token if it is EOS). Tokens after a file's last boundary belong to no document. A document
  longer than ``seq_len`` is truncated to its first ``seq_len`` tokens (``truncate``, the default)
  or cut into ``seq_len`` pieces (``fragment``).
* Packing: Optimized Best-Fit Decreasing. Documents are sorted by length, longest first, with
  ``np.argsort`` of the negated int64 lengths (numpy's default, unstable sort: equal lengths keep
  the order that call gives); each goes into the open instance with the least room that fits it,
  the earliest opened of those, or into a new instance. An instance holds its documents in the
  order they went in, then ``pad_token_id`` up to ``seq_len``; ``label_mask`` is False on padding.
* Global instance ids run through the groups in order; the epoch order and batches are the
  fixed-length loader's (:mod:`olmax.data.instances`).
* ``doc_lens`` of an instance is OLMo-core's ``get_document_lengths`` of its padded tokens (the
  padding is one segment of its own), zero-padded to ``max_docs`` columns: one more than the most
  documents any instance of the data holds, so every batch and host has the same shape.

Two things differ from OLMo-core on purpose or by necessity. Boundaries always come from scanning
the tokens for EOS: OLMo-core reads a remote (URL) source's ``.csv.gz`` metadata instead, which
gives the same documents when every document ends in EOS (the Dolma toolkit's output) and reads
far fewer bytes. And the order of equal-length documents is whatever this machine's numpy
``argsort`` gives, as it is for OLMo-core: a numpy build or CPU with a different sort kernel could
order ties differently, so every process of a run reads the one packing its cache holds.

Each group's packing is built once per cache (:func:`olmax.io.build_once`) into
``<cache>/packed/<key>.npy``, keyed by the group's files (resolved absolute path, size and
modification time; a URL, size and stated MD5; :func:`olmax.data.token_files.file_identity`), the
tokenizer's EOS/BOS, the token dtype, ``seq_len`` and the long-document strategy, and ending in a
checksum of its bytes: a file that fails it is logged and rebuilt, never read. It holds, as int64: the number of
instances I and documents D, the instances' first-document offsets (``I + 1``), and each document's
start (in the group's concatenated tokens) and length, in instance order. A process reads it by
memory map, a few entries per instance. Processes that share a cache build different groups at
the same time (each starts at its own place in the list) and wait for the others' groups.
"""

from __future__ import annotations

import hashlib
import json
import os
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from olmax.data.token_files import TokenReader, file_identity, file_num_tokens, prefetch_sizes
from olmax.errors import ConfigError, OlmaxError
from olmax.io import build_once, cache_root

LongDocStrategy = Literal["truncate", "fragment"]
PACK_VERSION = 2
SCAN_TOKENS = 1 << 24          # tokens read at a time when looking for document boundaries


@dataclass(frozen=True)
class Packing:
    """How instances are packed (OLMo-core ``NumpyPackedFSLDatasetConfig``'s options);
    ``doc_lens``: deliver each row's document lengths (``generate_doc_lengths``)."""

    source_group_size: int = 1
    long_doc_strategy: LongDocStrategy = "truncate"
    doc_lens: bool = False


def document_ends(tokens: np.ndarray, eos: int, bos: int | None, last: bool) -> np.ndarray:
    """End positions (exclusive) of the documents that end in ``tokens``; with a BOS token, the
    array holds one token of look-ahead unless ``last`` (it ends the file)."""
    if bos is None:
        return np.flatnonzero(tokens == eos) + 1
    ends = np.flatnonzero((tokens[:-1] == eos) & (tokens[1:] == bos)) + 1
    if last and len(tokens) and tokens[-1] == eos:
        ends = np.append(ends, len(tokens))
    return ends


def scan_documents(reader: TokenReader, path: str, n_tokens: int, eos: int,
                   bos: int | None) -> np.ndarray:
    """Document end offsets (exclusive, int64) in one token file, read ``SCAN_TOKENS`` at a time."""
    parts = []
    look = 0 if bos is None else 1
    for start in range(0, n_tokens, SCAN_TOKENS):
        stop = min(n_tokens, start + SCAN_TOKENS)
        chunk = reader.read(path, start, min(n_tokens, stop + look))
        ends = document_ends(chunk, eos, bos, last=stop == n_tokens) + start
        parts.append(ends[ends <= stop].astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def cap_documents(starts: np.ndarray, ends: np.ndarray, seq_len: int,
                  strategy: LongDocStrategy) -> tuple[np.ndarray, np.ndarray]:
    """Documents longer than ``seq_len`` truncated or fragmented; (starts, lengths) int64."""
    lengths = ends - starts
    if strategy == "truncate":
        return starts, np.minimum(lengths, seq_len)
    pieces = -(-lengths // seq_len)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = np.arange(int(pieces.sum()), dtype=np.int64) - first
    doc = np.repeat(np.arange(len(starts)), pieces)
    new_starts = starts[doc] + k * seq_len
    return new_starts, np.minimum(ends[doc] - new_starts, seq_len)


def best_fit_decreasing(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """OLMo-core's ``InstancePacker``: the instance of each document, for lengths already in
    packing order (longest first). An instance with ``r`` tokens of room left waits in queue ``r``;
    a document of length L goes to the first instance of the smallest non-empty queue ``r >= L``
    (the segment tree's left-most leaf of weight >= L), else to a new instance."""
    rooms: list[int] = []                    # sorted room sizes whose queue is non-empty
    queues: dict[int, deque] = {}
    out = np.empty(len(lengths), dtype=np.int64)
    n = 0
    for i, length in enumerate(lengths.tolist()):
        j = bisect_left(rooms, length)
        if j == len(rooms):
            b, room = n, seq_len
            n += 1
        else:
            room = rooms[j]
            q = queues[room]
            b = q.popleft()
            if not q:
                del rooms[j]
        out[i] = b
        left = room - length
        if left > 0:
            q = queues.get(left)
            if q is None:
                q = queues[left] = deque()
            if not q:
                insort(rooms, left)
            q.append(b)
    return out


def pack_group(reader: TokenReader, paths: Sequence[str], file_tokens: Sequence[int], *,
               seq_len: int, eos: int, bos: int | None,
               strategy: LongDocStrategy) -> np.ndarray:
    """One group's packing as the flat int64 array stored in the cache (see the module doc)."""
    starts, ends = [], []
    offset = 0
    for path, n in zip(paths, file_tokens):
        e = scan_documents(reader, path, n, eos, bos)
        starts.append(np.concatenate(([0], e[:-1])) + offset if len(e) else e)
        ends.append(e + offset)
        offset += n
    doc_starts, doc_lens = cap_documents(np.concatenate(starts), np.concatenate(ends), seq_len,
                                         strategy)
    del starts, ends
    order = np.argsort(-doc_lens)
    doc_starts, doc_lens = doc_starts[order], doc_lens[order]
    del order
    bins = best_fit_decreasing(doc_lens, seq_len)
    num = int(bins.max()) + 1 if len(bins) else 0
    in_instance_order = np.argsort(bins, kind="stable")
    counts = np.bincount(bins, minlength=num)
    return np.concatenate(([num, len(doc_lens)], [0], np.cumsum(counts),
                           doc_starts[in_instance_order], doc_lens[in_instance_order])).astype(np.int64)


@dataclass(frozen=True)
class PackedGroup:
    """One group's packing, read from its cache file."""

    num_instances: int
    offsets: np.ndarray      # int64 [I + 1]: first document of each instance
    starts: np.ndarray       # int64 [D]: document start in the group's concatenated tokens
    lengths: np.ndarray      # int64 [D]

    @classmethod
    def load(cls, path: Path) -> "PackedGroup":
        try:
            flat = np.load(path, mmap_mode="r")
            num, docs = int(flat[0]), int(flat[1])
            if flat.dtype != np.int64 or flat.shape != (2 + num + 1 + 2 * docs,):
                raise ValueError
        except (ValueError, OSError, IndexError):
            raise OlmaxError(f"{path}: corrupt packing cache (delete it to rebuild)") from None
        return cls(num, flat[2:3 + num], flat[3 + num:3 + num + docs], flat[3 + num + docs:])

    @property
    def max_docs(self) -> int:
        return int(np.diff(self.offsets).max()) if self.num_instances else 0


class PackedIndex:
    """Files -> packed instances (OLMo-core ``NumpyPackedFSLDataset``): global instance k is
    instance ``k - group_offsets[g]`` of group g."""

    def __init__(self, paths: Sequence[str], seq_len: int, dtype: np.dtype, *, eos_token_id: int,
                 pad_token_id: int, bos_token_id: int | None = None, source_group_size: int = 1,
                 long_doc_strategy: LongDocStrategy = "truncate",
                 cache_dir: str | os.PathLike | None = None, start_group: float = 0.0) -> None:
        """``start_group`` (a fraction in [0, 1)): where in the group list this process starts
        building, so processes sharing a cache build different groups at once."""
        if seq_len <= 0:
            raise ConfigError(f"seq_len must be positive, got {seq_len}")
        if source_group_size < 1:
            raise ConfigError(f"data.source_group_size must be at least 1 (got {source_group_size})")
        if long_doc_strategy not in ("truncate", "fragment"):
            raise ConfigError(f"data.long_doc_strategy must be truncate or fragment "
                              f"(got {long_doc_strategy!r})")
        if not paths:
            raise ConfigError("no data files given")
        self.paths = tuple(str(p) for p in paths)
        self.dtype = np.dtype(dtype)
        prefetch_sizes(self.paths)
        self.file_tokens = tuple(file_num_tokens(p, self.dtype) for p in self.paths)
        self.seq_len = seq_len
        self.eos, self.bos, self.pad = eos_token_id, bos_token_id, pad_token_id
        self.source_group_size = source_group_size
        self.long_doc_strategy = long_doc_strategy
        self.cache_dir = cache_dir
        g = source_group_size
        self.groups = [tuple(range(i, min(i + g, len(self.paths)))) for i in range(0, len(self.paths), g)]
        self.group_paths = [self._cache_path(files) for files in self.groups]
        self._build(start_group)
        self._loaded: dict[int, PackedGroup] = {}
        counts, docs = [], 0
        for i in range(len(self.groups)):
            grp = self.group(i)
            counts.append(grp.num_instances)
            docs = max(docs, grp.max_docs)
        self.group_offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self.max_docs = docs + 1       # the padding segment
        self.file_offsets = [np.concatenate(([0], np.cumsum([self.file_tokens[f] for f in files])))
                             for files in self.groups]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_loaded"] = {}
        return state

    def _cache_path(self, files: tuple[int, ...]) -> Path:
        key = json.dumps({"v": PACK_VERSION, "files": [file_identity(self.paths[f]) for f in files],
                          "dtype": self.dtype.name, "seq_len": self.seq_len, "eos": self.eos,
                          "bos": self.bos, "long_doc_strategy": self.long_doc_strategy})
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return cache_root(self.cache_dir) / "packed" / f"packed_{self.seq_len}_{digest}.npy"

    def _build(self, start_group: float) -> None:
        n = len(self.groups)
        first = int(start_group * n) % n
        reader = TokenReader(self.dtype, cache_dir=self.cache_dir)
        try:
            for i in list(range(first, n)) + list(range(first)):
                files = self.groups[i]
                build_once(self.group_paths[i], lambda f, files=files: np.save(f, pack_group(
                    reader, [self.paths[k] for k in files], [self.file_tokens[k] for k in files],
                    seq_len=self.seq_len, eos=self.eos, bos=self.bos,
                    strategy=self.long_doc_strategy)),
                    what=f"the packing of source group {i} of {n}", checksum=True)
        finally:
            reader.close()

    def group(self, i: int) -> PackedGroup:
        grp = self._loaded.get(i)
        if grp is None:
            grp = self._loaded[i] = PackedGroup.load(self.group_paths[i])
        return grp

    @property
    def num_instances(self) -> int:
        return int(self.group_offsets[-1])

    @property
    def num_documents(self) -> int:
        """Documents packed, over every group."""
        return sum(int(self.group(i).lengths.size) for i in range(len(self.groups)))

    @property
    def padding_tokens(self) -> int:
        """Padding in all instances (OLMo-core logs it per group)."""
        return self.num_instances * self.seq_len - sum(int(np.sum(self.group(i).lengths))
                                                      for i in range(len(self.groups)))

    def documents(self, k: int) -> list[tuple[str, int, int]]:
        """Instance k's documents in order, as ``(path, start, stop)`` token spans."""
        if not 0 <= k < self.num_instances:
            raise IndexError(f"instance id {k} out of range [0, {self.num_instances})")
        g = int(np.searchsorted(self.group_offsets, k, side="right")) - 1
        grp, local = self.group(g), k - int(self.group_offsets[g])
        lo, hi = int(grp.offsets[local]), int(grp.offsets[local + 1])
        offsets, files = self.file_offsets[g], self.groups[g]
        spans = []
        for start, length in zip(grp.starts[lo:hi].tolist(), grp.lengths[lo:hi].tolist()):
            f = int(np.searchsorted(offsets, start, side="right")) - 1
            s = start - int(offsets[f])
            spans.append((self.paths[files[f]], s, s + length))
        return spans


def document_lengths(tokens: np.ndarray, eos: int, bos: int | None) -> np.ndarray:
    """OLMo-core's ``get_document_lengths`` of one instance's tokens (int32)."""
    n = len(tokens)
    if bos is None:
        ends = np.flatnonzero(tokens == eos)
        if tokens[-1] != eos:
            ends = np.append(ends, n - 1)
    else:
        ends = np.append(np.flatnonzero((tokens[:-1] == eos) & (tokens[1:] == bos)), n - 1)
    return np.diff(np.concatenate(([-1], ends))).astype(np.int32)


__all__ = ["Packing", "PackedIndex", "best_fit_decreasing", "document_lengths", "pack_group"]
