"""Held-out sets in OLMo-core's padded form (``NumpyPaddedFSLDataset``, ``data/numpy_dataset.py``).

One instance per document: documents end at each EOS (``data/utils.py: iter_document_indices`` with
no BOS; tokens after a file's last EOS belong to no document and are dropped), the EOS stays part of
its document, each document is truncated to its first ``seq_len`` tokens
(``segment_documents_into_instances``) and right-padded with the pad id; ``label_mask`` is True on
the document's tokens and False on padding. Files are taken in order, documents in file order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from olmax.errors import ConfigError, OlmaxError
from olmax.data.token_files import check_ids, open_tokens

SCAN_TOKENS = 1 << 24


def document_spans(path: str, *, eos_token_id: int, dtype=np.uint32) -> np.ndarray:
    """``[n_docs, 2]`` int64 (start, end) of each EOS-terminated document of a token file (read in
    pieces of ``SCAN_TOKENS``; a remote file by ranged reads)."""
    tokens = open_tokens(path, dtype)
    ends = [np.flatnonzero(np.asarray(tokens[a: a + SCAN_TOKENS]) == eos_token_id).astype(np.int64)
            + a + 1 for a in range(0, len(tokens), SCAN_TOKENS)]
    ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    starts = np.concatenate(([0], ends[:-1]))[: len(ends)].astype(np.int64)
    return np.stack([starts, ends], axis=1)


def padded_instances(paths: list[str] | tuple[str, ...], seq_len: int, *, eos_token_id: int,
                     pad_token_id: int, max_docs: int | None = None, dtype=np.uint32,
                     vocab_size: int | None = None,
                     vocab_setting: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens int32 [N, seq_len], label_mask bool [N, seq_len])``, one row per document.
    Ids must be below ``vocab_size`` (``vocab_setting``: what sets it, for the error line)."""
    rows: list[np.ndarray] = []
    for path in paths:
        spans = document_spans(path, eos_token_id=eos_token_id, dtype=dtype)
        if max_docs is not None:
            spans = spans[: max_docs - len(rows)]
        if len(spans) == 0:
            continue
        tokens = open_tokens(path, dtype)
        if not isinstance(tokens, np.ndarray):  # remote: one pass of ranged reads, not one per document
            tokens = tokens[: int(spans[-1, 1])]
        for start, end in spans.tolist():
            doc = np.asarray(tokens[start: min(end, start + seq_len)])
            if vocab_size is not None:
                check_ids(doc, vocab_size, f"{path} (tokens {start}..{end})", vocab_setting)
            rows.append(doc)
        if max_docs is not None and len(rows) >= max_docs:
            break
    out = np.full((len(rows), seq_len), pad_token_id, dtype=np.int32)
    mask = np.zeros((len(rows), seq_len), dtype=np.bool_)
    for i, doc in enumerate(rows):
        out[i, : doc.size] = doc
        mask[i, : doc.size] = True
    return out, mask


def require_documents(files: Sequence[str], *, eos_token_id: int, dtype=np.uint32) -> None:
    """Every held-out token file must hold at least one EOS-terminated document."""
    dt = np.dtype(dtype).newbyteorder("<")
    for f in files:
        if len(document_spans(f, eos_token_id=eos_token_id, dtype=dt)) == 0:
            raise OlmaxError(f"held-out token file {f} holds no EOS-terminated document "
                             f"(EOS id {eos_token_id}, {dt.name} tokens)")


def load_heldout_sets(sets: dict[str, list[str]], seq_len: int, *, eos_token_id: int, pad_token_id: int,
                      vocab_size: int | None = None, max_docs: int | None = None,
                      dtype=np.uint32, vocab_setting: str | None = None
                      ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{label: (tokens, label_mask)} in the padded form; an empty set is an error."""
    out = {}
    for label, files in sets.items():
        require_documents(files, eos_token_id=eos_token_id, dtype=dtype)
        tokens, mask = padded_instances(files, seq_len, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                        max_docs=max_docs, dtype=dtype, vocab_size=vocab_size,
                                        vocab_setting=vocab_setting)
        if len(tokens) == 0:
            raise OlmaxError(f"held-out set '{label}' has no EOS-terminated document ({', '.join(files)})")
        out[label] = (tokens, mask)
    if not out:
        raise ConfigError("no held-out sets given")
    return out
