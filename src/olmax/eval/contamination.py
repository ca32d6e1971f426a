"""Contamination guard: does evaluation data occur in the training token files?

Used by ``olmax data overlap`` (a report on held-out sets and OLMES tasks) and, through
:class:`OverlapGuard`, by every evaluation suite that names the training files it must not overlap
(the trainer's in-loop evaluation): an overlapping held-out set is refused, or with
``warn``/``drop`` evaluated as is or without its flagged documents.

Two measures, between every evaluation document and the training stream:

- **exact documents**: the training files are cut into documents at EOS (as the data pipeline and
  OLMo-core do); a held-out document whose token sequence (EOS excluded) equals a training
  document's is a verbatim leak. Only training documents whose length equals some evaluation
  document's length are hashed (blake2b-64), so the cost is one pass over the lengths.
- **long n-grams** (default 13 tokens, the usual decontamination length): every window of ``n``
  consecutive tokens is hashed with a 64-bit polynomial hash (mod 2^64, vectorised in numpy). A
  document is a *near duplicate* when at least ``threshold`` of its distinct n-grams occur in
  training. Hash collisions are possible but rare (about one false n-gram per 2^64 / (|train| *
  |eval|)); they can inflate an n-gram count by one, never make a document a near duplicate alone.

Memory is bounded by the *evaluation* side (its n-gram hashes, sorted, plus one bit per hash for
"seen in training"); the training files are memory-mapped and streamed in fixed-size chunks
(overlapping by ``n - 1`` tokens), so a mix of any size is scanned in constant memory.
``max_train_tokens`` caps the scan (each file contributes its first share) for a quick check; the
report then says the scan was partial.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

from olmax.errors import OlmaxError
from olmax.data.heldout import document_spans, require_documents
from olmax.data.token_files import open_tokens
from olmax.eval.downstream import prepare_task

log = logging.getLogger(__name__)

NGRAM = 13
DEFAULT_THRESHOLD = 0.5
_P = np.uint64(0x100000001B3)  # FNV-64 prime as the polynomial base (odd: invertible mod 2^64)
# The n-gram probe's prefilter: a table of 2^22 flags, one per value of a hash's top 22 bits, set
# for the evaluation side's n-grams. A training n-gram whose flag is clear is in no evaluation
# set; only the few others are looked up exactly (a 16M-token chunk: ~0.3 s of binary search
# becomes a ~0.05 s table read and a search over ~1 % of it).
_FILTER_BITS = 22


def ngram_hashes(tokens: np.ndarray, n: int = NGRAM) -> np.ndarray:
    """uint64 hash of every length-``n`` window (``len(tokens) - n + 1`` values; none if shorter)."""
    t = np.asarray(tokens).astype(np.uint64) + np.uint64(1)
    m = len(t) - n + 1
    if m <= 0:
        return np.zeros(0, np.uint64)
    h = np.zeros(m, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _P + t[j: j + m]
    return h


def doc_hash(tokens: np.ndarray) -> int:
    """64-bit content hash of a document's token ids (as little-endian uint32)."""
    data = np.ascontiguousarray(np.asarray(tokens, dtype="<u4")).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass
class SetReport:
    name: str
    documents: int
    ngrams: int                        # distinct n-grams in the set
    ngrams_in_train: int = 0
    exact_documents: int = 0           # documents found verbatim in training
    near_duplicates: int = 0           # documents with >= threshold of their n-grams in training
    documents_with_ngram_overlap: int = 0
    max_ngram_fraction: float = 0.0
    flagged: list[int] = field(default_factory=list)    # indices of verbatim / near-duplicate documents

    @property
    def contaminated(self) -> bool:
        return self.exact_documents > 0 or self.near_duplicates > 0

    def describe(self) -> str:
        return (f"{self.name}: {self.documents} documents, {self.exact_documents} verbatim in training, "
                f"{self.near_duplicates} near duplicates (>= threshold of their {NGRAM}-grams), "
                f"{self.documents_with_ngram_overlap} share at least one n-gram; "
                f"{self.ngrams_in_train}/{self.ngrams} distinct n-grams seen in training")


@dataclass
class OverlapReport:
    ngram: int
    threshold: float
    train_files: int
    train_tokens_scanned: int
    train_documents_scanned: int
    partial: bool
    sets: list[SetReport]

    @property
    def contaminated(self) -> list[SetReport]:
        return [s for s in self.sets if s.contaminated]

    def to_dict(self) -> dict:
        d = asdict(self)
        for s, r in zip(d["sets"], self.sets):
            s["contaminated"] = r.contaminated
        return d


class EvalIndex:
    """The evaluation side: per-set documents, their hashes and n-gram hashes."""

    def __init__(self, sets: Mapping[str, Sequence[np.ndarray]], n: int = NGRAM) -> None:
        self.n = n
        self.names = list(sets)
        self.docs: list[list[np.ndarray]] = [[np.asarray(d) for d in sets[k]] for k in self.names]
        self.doc_ngrams = [[np.unique(ngram_hashes(d, n)) for d in docs] for docs in self.docs]
        all_ng = [g for per in self.doc_ngrams for g in per]
        self.ngrams = np.unique(np.concatenate(all_ng)) if all_ng else np.zeros(0, np.uint64)
        self.seen = np.zeros(len(self.ngrams), bool)
        self._flags = np.zeros(1 << _FILTER_BITS, bool)
        self._flags[(self.ngrams >> np.uint64(64 - _FILTER_BITS)).astype(np.intp)] = True
        self.doc_hashes: dict[int, list[tuple[int, int]]] = {}   # hash -> [(set, doc)]
        self.lengths = np.unique([len(d) for docs in self.docs for d in docs]).astype(np.int64)
        for s, docs in enumerate(self.docs):
            for i, d in enumerate(docs):
                self.doc_hashes.setdefault(doc_hash(d), []).append((s, i))
        self.exact: set[tuple[int, int]] = set()

    def probe_ngrams(self, hashes: np.ndarray) -> None:
        if len(self.ngrams) == 0 or len(hashes) == 0:
            return
        hashes = hashes[self._flags[(hashes >> np.uint64(64 - _FILTER_BITS)).astype(np.intp)]]
        idx = np.searchsorted(self.ngrams, hashes)
        idx[idx == len(self.ngrams)] = 0
        hit = self.ngrams[idx] == hashes
        self.seen[idx[hit]] = True

    def probe_document(self, doc: np.ndarray) -> None:
        for where in self.doc_hashes.get(doc_hash(doc), ()):
            s, i = where
            if np.array_equal(self.docs[s][i], doc):
                self.exact.add(where)

    def report(self, threshold: float) -> list[SetReport]:
        seen_hashes = self.ngrams[self.seen]
        out = []
        for s, name in enumerate(self.names):
            per = self.doc_ngrams[s]
            distinct = np.unique(np.concatenate(per)) if per else np.zeros(0, np.uint64)
            r = SetReport(name, len(self.docs[s]), int(len(distinct)),
                          int(np.isin(distinct, seen_hashes).sum()))
            for i, g in enumerate(per):
                frac = float(np.isin(g, seen_hashes).mean()) if len(g) else 0.0
                exact = (s, i) in self.exact
                r.exact_documents += exact
                near = len(g) > 0 and frac >= threshold and not exact
                r.near_duplicates += near
                r.documents_with_ngram_overlap += frac > 0
                r.max_ngram_fraction = max(r.max_ngram_fraction, frac)
                if exact or near:
                    r.flagged.append(i)
            out.append(r)
        return out


def scan_training(paths: Sequence[str], index: EvalIndex, *, eos_token_id: int, dtype=np.uint32,
                  chunk_tokens: int = 1 << 24, max_train_tokens: int | None = None,
                  progress: Callable[[int], None] | None = None) -> tuple[int, int, bool]:
    """Stream the training files through ``index``; returns (tokens, documents, partial)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    n = index.n
    per_file = None if max_train_tokens is None else max(n, max_train_tokens // max(1, len(paths)))
    total_tokens = total_docs = 0
    partial = False
    for path in paths:
        data = open_tokens(path, dtype)
        end = len(data)
        if per_file is not None and end > per_file:
            end, partial = per_file, True
        longest = int(index.lengths.max(initial=0))
        carry = np.zeros(0, dtype=np.int64)    # the open document's tokens from earlier chunks
        carry_len = 0                          # its true length (tokens dropped once > longest)
        for start in range(0, end, chunk_tokens):
            stop = min(end, start + chunk_tokens)
            chunk = np.asarray(data[start:stop]).astype(np.int64)
            # n-grams: windows starting in [start, stop), reading up to n-1 tokens ahead
            ahead = np.asarray(data[stop: min(end, stop + n - 1)]).astype(np.int64)
            index.probe_ngrams(ngram_hashes(np.concatenate([chunk, ahead]), n))
            # exact documents: split at EOS, hash those of a length some evaluation doc has
            eos = np.flatnonzero(chunk == eos_token_id)
            if len(eos):
                starts = np.concatenate([[0], eos[:-1] + 1])
                lengths = eos - starts
                lengths[0] += carry_len
                total_docs += len(eos)
                for k in np.flatnonzero(np.isin(lengths, index.lengths)):
                    doc = chunk[starts[k]: eos[k]]
                    if k == 0 and carry_len:
                        doc = np.concatenate([carry, doc])
                    index.probe_document(doc)
                carry = chunk[eos[-1] + 1:]
                carry_len = len(carry)
            else:
                carry = np.concatenate([carry, chunk])
                carry_len += len(chunk)
            if carry_len > longest:
                carry = carry[:0]
            total_tokens += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return total_tokens, total_docs, partial


def overlap(train_paths: Sequence[str], eval_sets: Mapping[str, Sequence[np.ndarray]], *,
            eos_token_id: int, ngram: int = NGRAM, threshold: float = DEFAULT_THRESHOLD,
            dtype=np.uint32, max_train_tokens: int | None = None, chunk_tokens: int = 1 << 24,
            progress: Callable[[int], None] | None = None) -> OverlapReport:
    """Exact-document and n-gram overlap of each evaluation set with the training files."""
    if not train_paths:
        raise OlmaxError("overlap: no training files given")
    index = EvalIndex(eval_sets, ngram)
    tokens, docs, partial = scan_training(train_paths, index, eos_token_id=eos_token_id, dtype=dtype,
                                          chunk_tokens=chunk_tokens, max_train_tokens=max_train_tokens,
                                          progress=progress)
    return OverlapReport(ngram, threshold, len(train_paths), tokens, docs, partial, index.report(threshold))


def documents_from_token_files(paths: Sequence[str], *, eos_token_id: int, dtype=np.uint32) -> list[np.ndarray]:
    """EOS-terminated documents of token files, EOS removed (held-out sets)."""
    require_documents(paths, eos_token_id=eos_token_id, dtype=dtype)
    dt = np.dtype(dtype).newbyteorder("<")
    docs = []
    for path in paths:
        spans = document_spans(path, eos_token_id=eos_token_id, dtype=dtype)
        data = open_tokens(path, dt)
        if len(spans) and not isinstance(data, np.ndarray):  # remote: one pass, not one per document
            data = data[: int(spans[-1, 1])]
        for a, b in spans.tolist():
            docs.append(np.asarray(data[a: b - 1]).astype(np.int64))
    return docs


def check_heldout_disjoint(train_paths: Sequence[str], heldout: Mapping[str, Sequence[str]], *,
                           eos_token_id: int, allow: bool = False, ngram: int = NGRAM,
                           threshold: float = DEFAULT_THRESHOLD, dtype=np.uint32,
                           max_train_tokens: int | None = None,
                           override_hint: str = "eval.allow_overlap=true") -> OverlapReport:
    """The trainer's guard: raise OlmaxError when a held-out set overlaps the training files.

    ``heldout`` maps labels to token files. With ``allow`` the report is returned instead.
    """
    sets = {label: documents_from_token_files(files, eos_token_id=eos_token_id, dtype=dtype)
            for label, files in heldout.items()}
    report = overlap(train_paths, sets, eos_token_id=eos_token_id, ngram=ngram, threshold=threshold,
                     dtype=dtype, max_train_tokens=max_train_tokens)
    bad = report.contaminated
    if bad and not allow:
        worst = bad[0]
        raise OlmaxError(
            f"held-out set '{worst.name}' overlaps the training data: {worst.exact_documents} of "
            f"{worst.documents} documents appear verbatim in the training files and "
            f"{worst.near_duplicates} share >= {threshold:.0%} of their {ngram}-grams"
            + (f" (also: {', '.join(s.name for s in bad[1:])})" if len(bad) > 1 else "")
            + f"; use a disjoint held-out set or set {override_hint}")
    return report


def downstream_documents(names: Sequence[str], tokenizer: Any, limit: int | None
                         ) -> dict[str, list[np.ndarray]]:
    """{task: [token arrays]}: each document's context followed by its gold continuation."""
    out = {}
    for name in names:
        task = prepare_task(name, tokenizer, 1 << 30, limit=limit)
        docs = {}
        for inst in task.instances:
            if inst.choices is not None:
                gold = inst.choices[inst.label_id] if isinstance(inst.label_id, int) else inst.choices[0]
                docs.setdefault(inst.doc_id, inst.query + [gold])
            elif inst.cont_id == inst.label_id or task.metric_type in ("bpb", "ce_loss"):
                docs.setdefault(inst.doc_id, inst.query + inst.continuation[-1:])
        out[name] = [np.asarray(d, np.int64) for d in docs.values()]
    return out


@dataclass(frozen=True)
class OverlapGuard:
    """What an evaluation suite does about held-out sets that overlap ``train_paths``: ``refuse``
    (an OlmaxError naming the set and ``override_hint``), ``warn`` (evaluate as is) or ``drop``
    (evaluate without the flagged documents). ``max_train_tokens`` bounds the scan."""

    train_paths: tuple[str, ...]
    mode: Literal["refuse", "warn", "drop"] = "refuse"
    dtype: Any = np.uint32
    max_train_tokens: int | None = None
    override_hint: str = "eval.allow_overlap=true"

    def check(self, heldout: Mapping[str, Sequence[str]], eos_token_id: int
              ) -> tuple[OverlapReport, dict[str, list[int]]]:
        """The report, and {label: document indices to drop} (empty unless ``drop``)."""
        report = check_heldout_disjoint(
            list(self.train_paths), heldout, eos_token_id=eos_token_id, allow=self.mode != "refuse",
            dtype=np.dtype(self.dtype), max_train_tokens=self.max_train_tokens,
            override_hint=self.override_hint)
        if report.partial:
            log.warning("contamination check scanned %d of the training tokens "
                        "(eval.overlap_max_train_tokens)", report.train_tokens_scanned)
        for s in report.contaminated:
            log.warning("held-out set overlaps training data: %s", s.describe())
        flagged = {s.name: s.flagged for s in report.contaminated} if self.mode == "drop" else {}
        return report, flagged
