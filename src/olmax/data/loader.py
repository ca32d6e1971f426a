"""The training data loader: OLMo-core's instance order, stateless, each host reading its own rows.

Global batch b (0-based; the trainer's step s consumes b = s - 1) is a pure function of
(files, seq_len, global batch size, seed, first epoch, b): epoch ``first_epoch + b //
batches_per_epoch``, row ``b % batches_per_epoch`` of OLMo-core's shuffled, tail-dropped index
(:mod:`olmax.data.instances`). Resuming needs only b, so a resume, a different device count or a
different number of hosts gives the same global batches. Process p of P reads the contiguous rows
``[p * B / P, (p + 1) * B / P)`` of the global batch and nothing else. (OLMo-core gives data-parallel
rank r the strided rows ``r::world``; the global batch, which is what the loss sees, is the same.)

With the repetition filter on, ``instance_mask`` is OLMo-core's ``_validate_instance`` per row; the
trainer masks every label of an invalid instance, keeping its tokens in the denominator as OLMo-core
does. :meth:`TrainData.iterate` runs the reads in grain (threads, prefetch, optional worker processes).
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import threading
import time
from typing import Any, Iterator

import grain
import numpy as np
from absl import flags

from olmax.config import DataConfig
from olmax.errors import ConfigError, OlmaxError
from olmax.io import local_dir, require_utf8_name
from olmax.data.filters import RepetitionFilter, instance_mask
from olmax.data.fingerprint import check_fingerprint, make_fingerprint
from olmax.data.instances import BatchPlan, InstanceIndex
from olmax.data.mixture import allocate
from olmax.data.packed import Packing, PackedIndex, document_lengths
from olmax.data.sources import resolve_paths
from olmax.data.token_files import TokenReader, check_ids, parse_dtype
from olmax.data.tokenizer import get_tokenizer

_ITER_END = 1 << 62


def batch_hash(tokens: np.ndarray) -> str:
    """sha256 of a batch's token ids as uint32 little-endian, row-major: what the trainer logs as
    ``batch_hash`` and ``olmax data inspect`` prints, so runs can be compared batch by batch."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<u4").tobytes()).hexdigest()


class TrainData:
    """Fixed-length training instances over token files, in OLMo-core's order.

    Picklable for grain worker processes: its BatchPlan and TokenReader drop their cached epoch
    order and file descriptors when pickled.
    """

    def __init__(self, paths: list[str] | tuple[str, ...], *, seq_len: int, global_batch_size: int,
                 seed: int, epoch: int = 1, dtype: str = "uint32",
                 tokenizer: dict[str, Any], repetition_filter: RepetitionFilter | None = None,
                 num_workers: int = 0, prefetch: int = 2, labels: list[str] | None = None,
                 ignore_fingerprint_mismatch: bool = False, cache_dir: str | None = None,
                 token_limits: tuple[int, ...] | None = None,
                 max_target_seq_len: int | None = None, packing: Packing | None = None,
                 tokenizer_setting: str | None = None) -> None:
        for path in paths:   # OLMo-core's fingerprint hashes each file's name as UTF-8
            require_utf8_name(path, "token file", "the data fingerprint (OLMo-core's)")
        self.dtype = parse_dtype(dtype)
        self.tokenizer = dict(tokenizer)
        self.vocab_size = int(tokenizer["vocab_size"])
        if self.vocab_size - 1 > np.iinfo(self.dtype).max:
            raise ConfigError(f"data.dtype {dtype} cannot hold vocab size {self.vocab_size}")
        # the ids read must be below this bound, named by the setting that sets it (limit_ids)
        self.id_bound = (self.vocab_size, f"{tokenizer_setting or 'the tokenizer'} "
                                          f"({self.vocab_size} ids)")
        self.packing = packing
        if packing is None:
            self.index = InstanceIndex.build(tuple(paths), seq_len, self.dtype, token_limits,
                                             max_target_seq_len)
        else:
            if token_limits is not None or max_target_seq_len is not None:
                raise ConfigError("packed instances take neither a source mixture nor "
                                  "data.max_target_seq_len")
            packed = PackedIndex(
                paths, seq_len, self.dtype, eos_token_id=int(tokenizer["eos_token_id"]),
                pad_token_id=int(tokenizer["pad_token_id"]), bos_token_id=tokenizer.get("bos_token_id"),
                source_group_size=packing.source_group_size,
                long_doc_strategy=packing.long_doc_strategy, cache_dir=cache_dir,
                start_group=random.random())
            if packed.num_instances < global_batch_size and packed.num_documents == 0:
                raise OlmaxError(f"data.instances=packed: no token file holds a document ending "
                                 f"in EOS id {packed.eos} ({tokenizer_setting or 'the tokenizer'}), "
                                 f"so there is nothing to pack (packing takes whole documents, "
                                 f"each ending in EOS; were the files made with another "
                                 f"tokenizer?)")
            self.index = packed
        self.plan = BatchPlan(self.index.num_instances, global_batch_size, seed, epoch, cache_dir)
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.epoch = epoch
        self.labels = list(labels) if labels is not None else None
        self.repetition_filter = repetition_filter
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.ignore_fingerprint_mismatch = ignore_fingerprint_mismatch
        self.fingerprint = make_fingerprint(self.index.paths, self.index.file_tokens,
                                            seq_len=seq_len, dtype=self.dtype, tokenizer=tokenizer,
                                            class_name=("NumpyPackedFSLDataset" if packing
                                                        else "NumpyFSLDataset" if token_limits is None
                                                        else "NumpyFSLDatasetMixture"),
                                            max_target_seq_len=max_target_seq_len, packing=packing)
        self._reader = TokenReader(self.dtype, cache_dir=cache_dir)

    # -- shape of the stream ----------------------------------------------------------------
    @property
    def num_instances(self) -> int:
        return self.index.num_instances

    @property
    def doc_lens_width(self) -> int | None:
        """Columns of a batch's ``doc_lens`` (the same for every batch and host); None when the
        batches carry none."""
        return self.index.max_docs if self.packing is not None and self.packing.doc_lens else None

    @property
    def batches_per_epoch(self) -> int:
        return self.plan.batches_per_epoch

    def epoch_of(self, b: int) -> int:
        return self.plan.epoch_of(b)

    def limit_ids(self, limit: int, setting: str) -> None:
        """Ids read from here on must also be below ``limit`` (the model's vocabulary), named by
        ``setting`` when one is not (an id past the model's rows would make its loss NaN)."""
        if limit < self.id_bound[0]:
            self.id_bound = (limit, setting)

    def _check_ids(self, ids: np.ndarray, path: str, start: int, end: int) -> None:
        check_ids(ids, self.id_bound[0], f"{path} (tokens {start}..{end})", self.id_bound[1])

    def check_fingerprint(self, saved: dict[str, Any]) -> None:
        """Raise OlmaxError naming the first differing file (and the override) unless ignored."""
        check_fingerprint(saved, self.fingerprint, ignore=self.ignore_fingerprint_mismatch)

    # -- reading ----------------------------------------------------------------------------
    def read_instances(self, ids: np.ndarray) -> np.ndarray:
        """Tokens of the given global instance ids, int32 ``[len(ids), seq_len]``."""
        if self.packing is not None:
            return self.read_packed(ids)[0]
        files, starts = self.index.locate(ids)
        spans = [(self.index.paths[f], s, s + self.seq_len)
                 for f, s in zip(files.tolist(), starts.tolist())]
        out = np.empty((len(ids), self.seq_len), dtype=np.int32)
        for row, ((path, s, e), tokens) in enumerate(zip(spans, self._reader.read_many(spans))):
            self._check_ids(tokens, path, s, e)
            out[row] = tokens
        return out

    def read_packed(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Packed instances: tokens int32 ``[n, seq_len]`` (padded with the pad id), ``label_mask``
        bool ``[n, seq_len]`` (False on padding) and ``doc_lens`` int32 ``[n, max_docs]``
        (OLMo-core's document lengths of each row, zero-padded)."""
        index: PackedIndex = self.index  # type: ignore[assignment]
        per_row = [index.documents(int(k)) for k in np.asarray(ids).tolist()]
        spans = [span for row in per_row for span in row]
        docs = iter(self._reader.read_many(spans))
        tokens = np.full((len(per_row), self.seq_len), index.pad, dtype=np.int32)
        label_mask = np.zeros((len(per_row), self.seq_len), dtype=bool)
        doc_lens = np.zeros((len(per_row), index.max_docs), dtype=np.int32)
        for row, row_spans in enumerate(per_row):
            at = 0
            for path, s, e in row_spans:
                doc = next(docs)
                self._check_ids(doc, path, s, e)
                tokens[row, at:at + len(doc)] = doc
                at += len(doc)
            label_mask[row, :at] = True
            lens = document_lengths(tokens[row], index.eos, index.bos)
            doc_lens[row, :len(lens)] = lens
        return tokens, label_mask, doc_lens

    def host_batch(self, b: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        """Rows ``[p * B / P, (p + 1) * B / P)`` of global batch b; only those rows are read."""
        B = self.global_batch_size
        if process_count <= 0 or B % process_count:
            raise ConfigError(f"global batch size {B} is not divisible by the process count {process_count}")
        if not 0 <= process_index < process_count:
            raise ConfigError(f"process index {process_index} not in [0, {process_count})")
        per = B // process_count
        ids = self.plan.instance_ids(b, process_index * per, (process_index + 1) * per)
        if self.packing is None:
            tokens = self.read_instances(ids)
            return {"tokens": tokens, "instance_ids": ids,
                    "instance_mask": instance_mask(tokens, self.repetition_filter)}
        tokens, label_mask, doc_lens = self.read_packed(ids)
        out = {"tokens": tokens, "instance_ids": ids, "label_mask": label_mask,
               "instance_mask": instance_mask(tokens, self.repetition_filter)}
        if self.packing.doc_lens:
            out["doc_lens"] = doc_lens
        return out

    def global_batch(self, b: int) -> dict[str, np.ndarray]:
        return self.host_batch(b, 0, 1)

    def iterate(self, start_b: int = 0, process_index: int = 0,
                process_count: int = 1) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Yields ``(b, host_batch(b, ...))`` for b = start_b, start_b + 1, ... (grain-backed, endless)."""
        ds = grain.MapDataset.range(start_b, _ITER_END).map(
            _HostBatch(self, process_index, process_count))
        threads = max(1, self.prefetch)
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=threads))
        if self.num_workers > 0:
            _ensure_absl_flags()
            it = it.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self.num_workers, per_worker_buffer_size=max(1, self.prefetch)),
                worker_init_fn=functools.partial(_end_with_parent, os.getpid()))
        return iter(it)


def _end_with_parent(parent: int, worker_index: int, worker_count: int) -> None:
    """In a grain worker process: end it once the trainer that started it is gone (the watchdog's
    exit, a kill -9), instead of reading on, orphaned, into the job's log."""
    del worker_index, worker_count

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="olmax-end-with-parent", daemon=True).start()


class _HostBatch:
    """Picklable grain transform: b -> (b, host batch)."""

    def __init__(self, data: TrainData, process_index: int, process_count: int) -> None:
        self.data = data
        self.process_index = process_index
        self.process_count = process_count

    def __call__(self, b: int) -> tuple[int, dict[str, np.ndarray]]:
        b = int(b)
        return b, self.data.host_batch(b, self.process_index, self.process_count)


def _ensure_absl_flags() -> None:
    """grain worker processes read absl flags; mark them parsed when the host program has not."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def build_train_data(data_cfg: DataConfig, *, seq_len: int, global_batch_size: int,
                     seed: int) -> TrainData:
    """TrainData for a run's data section (``seed`` is the run seed, as OLMo-core's loader uses it)."""
    if data_cfg.cache_dir is not None:
        local_dir(data_cfg.cache_dir, "data.cache_dir")      # a local folder, never a URL
    tok = get_tokenizer(data_cfg.tokenizer)
    if data_cfg.source() == "embedded" and tok.identity != get_tokenizer("dolma2").identity:
        raise ConfigError(f"data.embedded=true: the embedded corpus is tokenized with dolma2, but "
                          f"data.tokenizer is {data_cfg.tokenizer!r}; leave data.tokenizer at dolma2")
    limits = None
    if data_cfg.source() == "mixture":
        entries = allocate(data_cfg.mixture, seq_len=seq_len, global_batch_size=global_batch_size,
                           dtype=parse_dtype(data_cfg.dtype))
        paths, labels = [e.path for e in entries], [e.source for e in entries]
        limits = tuple(e.tokens for e in entries)
    else:
        paths, labels = resolve_paths(data_cfg)
    packing = None
    if data_cfg.instances == "packed":
        packing = Packing(data_cfg.source_group_size, data_cfg.long_doc_strategy, data_cfg.doc_lens)
    flt = None
    if data_cfg.repetition_filter:
        flt = RepetitionFilter(data_cfg.repetition_max_period, data_cfg.repetition_min_period,
                               data_cfg.repetition_max_count)
    return TrainData(paths, seq_len=seq_len, global_batch_size=global_batch_size, seed=seed,
                     epoch=data_cfg.epoch, dtype=data_cfg.dtype, tokenizer=tok.identity,
                     repetition_filter=flt, num_workers=data_cfg.num_workers,
                     prefetch=data_cfg.prefetch, labels=labels,
                     ignore_fingerprint_mismatch=data_cfg.ignore_fingerprint_mismatch,
                     cache_dir=data_cfg.cache_dir, token_limits=limits,
                     max_target_seq_len=data_cfg.max_target_seq_len, packing=packing,
                     tokenizer_setting=f"data.tokenizer {data_cfg.tokenizer!r}")


__all__ = ["TrainData", "batch_hash", "build_train_data"]
