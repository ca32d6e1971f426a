"""Dataset fingerprint: what must not change under a resumed run.

The dict holds the files (path, basename, size in bytes) in order, seq_len, dtype and the tokenizer
(name, vocab, EOS, pad, BOS). ``olmo_core_sha256`` is OLMo-core's own ``NumpyDatasetBase.fingerprint``
for a ``NumpyFSLDataset`` over the same files (sha256 over the class name, vocab/pad/EOS/dtype/
max_target_sequence_length/BOS and each file's basename and size), so it can be compared with an
OLMo-core data-loader ``state_dict``'s ``dataset_fingerprint``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from olmax.errors import OlmaxError

FINGERPRINT_VERSION = 1
OVERRIDE = "data.ignore_fingerprint_mismatch=true"


def olmo_core_fingerprint(paths: tuple[str, ...], sizes: tuple[int, ...], *, vocab_size: int,
                          seq_len: int | None = None,
                          pad_token_id: int, eos_token_id: int, dtype: np.dtype,
                          bos_token_id: int | None, class_name: str = "NumpyFSLDataset",
                          max_target_seq_len: int | None = None, packing: Any = None) -> str:
    """``NumpyFSLDataset.fingerprint`` (``data/numpy_dataset.py``).

    OLMo 3's official scripts set ``max_target_sequence_length=8192``; it is part of the hash.

    For a source mixture, ``class_name="NumpyFSLDatasetMixture"`` and sizes are the allocations.
    With ``packing`` (:class:`olmax.data.packed.Packing`), ``NumpyPackedFSLDataset``'s fields."""
    h = hashlib.sha256()
    h.update(f"class={class_name}".encode())
    common = (("vocab_size", vocab_size), ("pad_token_id", pad_token_id),
              ("eos_token_id", eos_token_id), ("dtype", np.dtype(dtype).type))
    if packing is None:
        fields = common + (("max_target_sequence_length", max_target_seq_len),
                           ("bos_token_id", bos_token_id))
    else:
        fields = common + (("long_doc_strategy", packing.long_doc_strategy),
                           ("bos_token_id", bos_token_id), ("sequence_length", seq_len))
        if packing.source_group_size > 1:
            fields += (("source_group_size", packing.source_group_size),)
    for name, value in fields:
        h.update(f"{name}={value},".encode())
    for path, size in zip(paths, sizes):
        h.update(f"path={os.path.basename(path)},size={size},".encode())
    return h.hexdigest()


def make_fingerprint(paths: tuple[str, ...], file_tokens: tuple[int, ...], *, seq_len: int,
                     dtype: np.dtype, tokenizer: dict[str, Any],
                     class_name: str = "NumpyFSLDataset",
                     max_target_seq_len: int | None = None, packing: Any = None) -> dict[str, Any]:
    dtype = np.dtype(dtype)
    sizes = tuple(n * dtype.itemsize for n in file_tokens)
    return {
        "version": FINGERPRINT_VERSION,
        "seq_len": seq_len,
        "max_target_seq_len": max_target_seq_len,
        "packing": None if packing is None else {
            "source_group_size": packing.source_group_size,
            "long_doc_strategy": packing.long_doc_strategy},
        "dtype": dtype.name,
        "tokenizer": {k: tokenizer.get(k) for k in
                      ("name", "vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")},
        "files": [{"path": p, "name": os.path.basename(p), "size": s} for p, s in zip(paths, sizes)],
        "olmo_core_sha256": olmo_core_fingerprint(
            paths, sizes, vocab_size=tokenizer["vocab_size"], pad_token_id=tokenizer["pad_token_id"],
            eos_token_id=tokenizer["eos_token_id"], dtype=dtype,
            bos_token_id=tokenizer.get("bos_token_id"), class_name=class_name,
            max_target_seq_len=max_target_seq_len, seq_len=seq_len, packing=packing),
    }


def fingerprint_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """One line describing the first difference, or None when they agree.

    Files are compared by basename and size (OLMo-core's rule), so moving the data is not a change.
    """
    for key in ("seq_len", "max_target_seq_len", "dtype", "packing"):
        if saved.get(key) != current.get(key):
            return f"{key} was {saved.get(key)!r}, now {current.get(key)!r}"
    if saved.get("tokenizer") != current.get("tokenizer"):
        return f"tokenizer was {saved.get('tokenizer')!r}, now {current.get('tokenizer')!r}"
    old, new = saved.get("files", []), current.get("files", [])
    for i, (a, b) in enumerate(zip(old, new)):
        if (a.get("name"), a.get("size")) != (b.get("name"), b.get("size")):
            return (f"data file {i} was {a.get('path')} ({a.get('size')} bytes), "
                    f"now {b.get('path')} ({b.get('size')} bytes)")
    if len(old) != len(new):
        if len(old) > len(new):
            return f"{len(old) - len(new)} file(s) removed, first: {old[len(new)].get('path')}"
        return f"{len(new) - len(old)} file(s) added, first: {new[len(old)].get('path')}"
    return None


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], *, ignore: bool = False) -> None:
    diff = fingerprint_difference(saved, current)
    if diff is not None and not ignore:
        raise OlmaxError(f"dataset fingerprint mismatch: {diff}; the data order would change "
                         f"(override with {OVERRIDE})")
