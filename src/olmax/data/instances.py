"""Fixed-length instances and their per-epoch order, exactly as OLMo-core's ``NumpyFSLDataset`` and
``NumpyFSLDataLoader`` (``data/numpy_dataset.py``, ``data/data_loader.py``) define them.

* Files are taken in the given (mix) order. File i of ``n_i`` tokens holds ``n_i // seq_len``
  instances; its remainder is dropped, so instances never cross files. Global instance k lives in the
  file i with ``offsets[i] <= k < offsets[i + 1]``, at tokens ``[(k - offsets[i]) * seq_len, ... +
  seq_len)`` (``_get_file_size_and_length``). With ``max_target_sequence_length`` M > seq_len (a
  sequence-length warm-up) a file holds ``(n_i // M) * (M // seq_len)`` instances instead.
* Epoch e's order: ``np.random.Generator(np.random.PCG64(seed + e)).shuffle(np.arange(N, uint32))``
  (``_build_global_indices`` with ``chunk_size=1``). The trainer starts at epoch 1.
* ``total_size = B * (N // B)`` drops the tail; global batch b of the epoch is row b of
  ``indices[:total_size].reshape(-1, B)``.

Only index arrays are held: the file offsets (``F + 1`` int64) and one epoch's permutation (``N``
uint32, 4 bytes per instance). A permutation of at least ``DISK_CACHE_MIN`` instances is built once
(peak 4 bytes per instance), written to ``<cache>/indices/*.npy`` atomically, named by everything
that determines it (N, seed, epoch, format version) and ending in a checksum of its bytes, and then
read a row at a time, so a training process holds only the rows it reads. A file whose checksum
does not match (torn or zero-filled by a crash) is logged and rebuilt, never read. Once means once
per cache: one thread of one process builds it (:func:`olmax.io.build_once`), every other process
that sees the same cache (a launched job keeps it on the run directory's storage) waits for the
file and reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmax.errors import ConfigError, OlmaxError
from olmax.data.token_files import file_num_tokens, prefetch_sizes
from olmax.io import CHECKSUM_TRAILER, build_once, cache_root

DISK_CACHE_MIN = 1 << 24


@dataclass(frozen=True)
class InstanceIndex:
    """Files -> global instance ids (OLMo-core ``NumpyFSLDataset.offsets``)."""

    paths: tuple[str, ...]
    file_tokens: tuple[int, ...]
    seq_len: int
    offsets: np.ndarray  # int64 [F + 1]
    max_target_seq_len: int | None = None

    @classmethod
    def build(cls, paths: tuple[str, ...] | list[str], seq_len: int, dtype: np.dtype,
              token_limits: tuple[int, ...] | None = None,
              max_target_seq_len: int | None = None) -> "InstanceIndex":
        """``token_limits`` (a source mixture's allocation) uses only the first tokens of each entry;
        a path may then appear more than once."""
        if seq_len <= 0:
            raise ConfigError(f"seq_len must be positive, got {seq_len}")
        if not paths:
            raise ConfigError("no data files given")
        prefetch_sizes(paths)
        tokens = tuple(file_num_tokens(p, dtype) for p in paths)
        if token_limits is not None:
            if len(token_limits) != len(tokens):
                raise ConfigError("token_limits must give one count per path")
            for p, n, limit in zip(paths, tokens, token_limits):
                if not 0 <= limit <= n:
                    raise OlmaxError(f"{p}: allocation of {limit} tokens exceeds the file's {n}")
            tokens = tuple(int(t) for t in token_limits)
        if max_target_seq_len is None or max_target_seq_len == seq_len:
            per_file = np.array([n // seq_len for n in tokens], dtype=np.int64)
        elif max_target_seq_len > seq_len and max_target_seq_len % seq_len == 0:
            per_file = np.array([(n // max_target_seq_len) * (max_target_seq_len // seq_len)
                                 for n in tokens], dtype=np.int64)
        else:
            raise ConfigError(f"data.max_target_seq_len ({max_target_seq_len}) must be a multiple of "
                              f"seq_len ({seq_len})")
        offsets = np.concatenate(([0], np.cumsum(per_file))).astype(np.int64)
        return cls(tuple(str(p) for p in paths), tokens, seq_len, offsets, max_target_seq_len)

    @property
    def num_instances(self) -> int:
        return int(self.offsets[-1])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global ids -> (file index, token start within the file)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_instances):
            raise IndexError(f"instance id out of range [0, {self.num_instances})")
        files = np.searchsorted(self.offsets, ids, side="right") - 1
        starts = (ids - self.offsets[files]) * self.seq_len
        return files, starts


def shuffled_indices(num_instances: int, seed: int, epoch: int) -> np.ndarray:
    """OLMo-core's epoch order: PCG64(seed + epoch) shuffle of ``arange(N, uint32)``."""
    if num_instances >= np.iinfo(np.uint32).max:
        raise ConfigError(f"{num_instances} instances exceed OLMo-core's uint32 index")
    indices = np.arange(num_instances, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(indices)
    return indices


def _index_cache_path(cache_dir: str | os.PathLike | None, seed: int, epoch: int, n: int) -> Path:
    name = f"global_indices_seed{seed}_epoch{epoch}_size{n}_v2.npy"
    return cache_root(cache_dir) / "indices" / name


class IndexFile:
    """A cached epoch order on disk, read by ``pread`` of just the requested slice.

    (A memory map would do too, but the kernel maps in large parts of a page-cached file on random
    faults, inflating the process's RSS; a 512-id row is one 2 KiB read.)
    """

    def __init__(self, path: Path, num_instances: int) -> None:
        with open(path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read_header(f)
            except ValueError:
                raise OlmaxError(f"{path}: corrupt index cache (delete it to rebuild)") from None
            self.offset = f.tell()
        if shape != (num_instances,) or dtype != np.dtype("<u4") or fortran:
            raise OlmaxError(f"{path}: corrupt index cache (delete it to rebuild)")
        if path.stat().st_size != self.offset + 4 * num_instances + CHECKSUM_TRAILER:
            raise OlmaxError(f"{path}: truncated index cache (delete it to rebuild)")
        self.path = path
        self.size = num_instances

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, item: slice) -> np.ndarray:
        start, stop, step = item.indices(self.size)
        if step != 1:
            raise IndexError("IndexFile supports contiguous slices only")
        n = max(0, stop - start)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            buf = os.pread(fd, 4 * n, self.offset + 4 * start)
        finally:
            os.close(fd)
        return np.frombuffer(buf, dtype="<u4")


def epoch_indices(num_instances: int, seed: int, epoch: int,
                  cache_dir: str | os.PathLike | None = None,
                  disk_cache_min: int = DISK_CACHE_MIN) -> np.ndarray | IndexFile:
    """The epoch's order; large ones are built once into the cache (``.npy``) and read by slices."""
    if num_instances < disk_cache_min:
        return shuffled_indices(num_instances, seed, epoch)
    path = _index_cache_path(cache_dir, seed, epoch, num_instances)
    build_once(path, lambda f: np.save(f, shuffled_indices(num_instances, seed, epoch)),
               what=f"the order of epoch {epoch}", checksum=True)
    return IndexFile(path, num_instances)


class BatchPlan:
    """Global batch b -> instance ids: a pure function of (N, B, seed, first epoch, b).

    ``epoch = first_epoch + b // batches_per_epoch``; within it, row ``b % batches_per_epoch``.
    The most recently used epoch's permutation is kept (one array per process).
    """

    def __init__(self, num_instances: int, global_batch_size: int, seed: int, first_epoch: int = 1,
                 cache_dir: str | os.PathLike | None = None) -> None:
        if global_batch_size <= 0:
            raise ConfigError(f"global batch size must be positive, got {global_batch_size}")
        if first_epoch < 1:
            raise ConfigError(f"data.epoch must be >= 1 (OLMo-core starts at epoch 1), got {first_epoch}")
        if num_instances < global_batch_size:
            raise OlmaxError(
                f"the data holds {num_instances} instances, fewer than one global batch of "
                f"{global_batch_size}"
            )
        self.num_instances = num_instances
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.first_epoch = first_epoch
        self.cache_dir = cache_dir
        self.batches_per_epoch = num_instances // global_batch_size
        self._cached: tuple[int, np.ndarray] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_cached"] = None
        return state

    def epoch_of(self, b: int) -> int:
        return self.first_epoch + b // self.batches_per_epoch

    def indices(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = None  # release the previous epoch first
            self._cached = (epoch, epoch_indices(self.num_instances, self.seed, epoch, self.cache_dir))
        return self._cached[1]

    def instance_ids(self, b: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Ids of rows ``[lo, hi)`` of global batch b (int64)."""
        if b < 0:
            raise IndexError(f"batch index must be >= 0, got {b}")
        hi = self.global_batch_size if hi is None else hi
        row = b % self.batches_per_epoch
        base = row * self.global_batch_size
        return np.asarray(self.indices(self.epoch_of(b))[base + lo: base + hi], dtype=np.int64)
