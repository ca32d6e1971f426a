"""Dataset fingerprint: what must not change under a resumed run.

The dict holds the files (path, basename, size in bytes) in order, seq_len, dtype and the tokenizer
(name, vocab, EOS, pad, BOS). ``olmo_core_sha256`` is OLMo-core's own ``NumpyDatasetBase.fingerprint``
for a ``NumpyFSLDataset`` over the same files (sha256 over the class name, vocab/pad/EOS/dtype/
max_target_sequence_length/BOS and each file's basename and size), so it can be compared with an
OLMo-core data-loader ``state_dict``'s ``dataset_fingerprint``.

Two fingerprints are compared like with like: the files by basename and size in order, the
lengths, the dtype, the packing, and the tokenizer by its ids (not its name). A mismatch is refused
in one line that says what differs and whether the data order would change (other files, sizes,
order or lengths) or not (the same files read as other token ids). Against an OLMo-core
checkpoint, which keeps only the sha256, :func:`olmo_core_difference` finds what differs from what
the checkpoint does keep (its tokenizer ids, its file names, its lengths).
"""

from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace
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
        "class_name": class_name,
        "seq_len": seq_len,
        "max_target_seq_len": max_target_seq_len,
        "packing": None if packing is None else {
            "source_group_size": packing.source_group_size,
            "long_doc_strategy": packing.long_doc_strategy},
        "dtype": dtype.name,
        "tokenizer": {k: tokenizer.get(k) for k in
                      ("name", "identifier", "vocab_size", "eos_token_id", "pad_token_id",
                       "bos_token_id")},
        "files": [{"path": p, "name": os.path.basename(p), "size": s} for p, s in zip(paths, sizes)],
        "olmo_core_sha256": olmo_core_fingerprint(
            paths, sizes, vocab_size=tokenizer["vocab_size"], pad_token_id=tokenizer["pad_token_id"],
            eos_token_id=tokenizer["eos_token_id"], dtype=dtype,
            bos_token_id=tokenizer.get("bos_token_id"), class_name=class_name,
            max_target_seq_len=max_target_seq_len, seq_len=seq_len, packing=packing),
    }


ID_FIELDS = ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")


def id_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The token ids two tokenizer identities differ in (``eos_token_id was 0, now 999``), or
    None; names and files are not compared (OLMo-core's fingerprint hashes the ids alone)."""
    diffs = [f"{k} was {saved.get(k)}, now {current.get(k)}" for k in ID_FIELDS
             if saved.get(k) != current.get(k)]
    return " and ".join(diffs) or None


def file_difference(old: list[tuple[str, Any]], new: list[tuple[str, Any]], what: str = "data file"
                    ) -> str | None:
    """How two lists of data files (name, size) differ: files added or removed, the same files
    in another order, or the first that differs; None when they agree. A size of None is not
    compared (a list that names the files only)."""
    def same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
        return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])

    if len(old) == len(new) and all(same(a, b) for a, b in zip(old, new)):
        return None
    if len(old) == len(new) and sorted(n for n, _ in old) == sorted(n for n, _ in new) and \
            all(any(same(a, b) for b in new) for a in old):
        i = next(i for i, (a, b) in enumerate(zip(old, new)) if not same(a, b))
        return (f"the same {what}s in another order ({what} {i} was {old[i][0]}, now "
                f"{new[i][0]})")
    for i, (a, b) in enumerate(zip(old, new)):
        if not same(a, b):
            sizes = a[1] is not None and b[1] is not None
            return (f"{what} {i} was {a[0]}{f' ({a[1]} bytes)' if sizes else ''}, now "
                    f"{b[0]}{f' ({b[1]} bytes)' if sizes else ''}")
    if len(old) > len(new):
        return f"{len(old) - len(new)} file(s) removed, first: {old[len(new)][0]}"
    return f"{len(new) - len(old)} file(s) added, first: {new[len(old)][0]}"


def fingerprint_difference(saved: dict[str, Any], current: dict[str, Any]
                           ) -> tuple[str, bool] | None:
    """The first difference as ``(one line, whether the data order changes)``, or None when
    they agree. Files are compared by basename and size (OLMo-core's rule), so moving the data is
    not a change; tokenizers by their ids (a name is not data)."""
    for key in ("seq_len", "max_target_seq_len", "dtype", "packing"):
        if saved.get(key) != current.get(key):
            return f"{key} was {saved.get(key)!r}, now {current.get(key)!r}", True
    old, new = ([(f.get("path"), f.get("size")) for f in fp.get("files", [])]
                for fp in (saved, current))
    files = file_difference(old, new)
    if files is not None:
        return files, True
    ids = id_difference(saved.get("tokenizer") or {}, current.get("tokenizer") or {})
    if ids is not None:
        return f"the tokenizer's {ids}", False
    return None


def mismatch_message(diff: str, order_changes: bool) -> str:
    """The one line a fingerprint mismatch is refused with: what differs and what it means."""
    means = ("the data order would change" if order_changes else
             "the same files in the same order, read as other token ids")
    return f"dataset fingerprint mismatch: {diff}; {means} (override with {OVERRIDE})"


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], *, ignore: bool = False) -> None:
    diff = fingerprint_difference(saved, current)
    if diff is not None and not ignore:
        raise OlmaxError(mismatch_message(*diff))


def olmo_core_difference(fingerprint: str, current: dict[str, Any], *,
                         tokenizer: dict[str, Any] | None, paths: list[str] | None,
                         max_target_seq_len: Any = "unknown") -> tuple[str, bool]:
    """Why ``fingerprint`` (an OLMo-core checkpoint's ``dataset_fingerprint``) is not the
    ``olmo_core_sha256`` of ``current`` (this run's fingerprint dict), as far as the checkpoint
    tells: its tokenizer ids (``config.json``), its files' names in order (``data_paths.txt``)
    and its ``max_target_sequence_length`` (``train/rank0.pt``). OLMo-core keeps no file sizes,
    so same names, order, ids and lengths leave the sizes. ``(one line, whether the data order
    changes)``."""
    ours_ids = current.get("tokenizer") or {}
    if tokenizer is not None and id_difference(tokenizer, ours_ids) is not None:
        theirs = {**ours_ids, **{k: tokenizer.get(k) for k in ID_FIELDS}}
        again = _sha_with_ids(current, theirs)
        ids = id_difference(tokenizer, ours_ids)
        if again == fingerprint:
            return f"only the tokenizer's ids differ: the checkpoint's {ids}", False
        return f"the tokenizer's ids differ (the checkpoint's {ids}), and its data too", True
    if max_target_seq_len != "unknown" and max_target_seq_len != current.get("max_target_seq_len"):
        return (f"max_target_seq_len was {max_target_seq_len!r}, now "
                f"{current.get('max_target_seq_len')!r}", True)
    files = [(f.get("name"), f.get("size")) for f in current.get("files", [])]
    if paths is not None:
        listed = file_difference([(os.path.basename(p), None) for p in paths], files)
        if listed is not None:
            return listed + " (the checkpoint's data_paths.txt)", True
        return ("the same file names in the same order as the checkpoint's data_paths.txt, "
                "so their sizes differ"), True
    return "the data files or their sizes differ (the checkpoint lists no files)", True


def _sha_with_ids(current: dict[str, Any], tokenizer: dict[str, Any]) -> str:
    """``current``'s OLMo-core sha256 with other tokenizer ids."""
    files = current.get("files", [])
    packing = current.get("packing")
    return olmo_core_fingerprint(
        tuple(f["path"] for f in files), tuple(f["size"] for f in files),
        vocab_size=tokenizer["vocab_size"], pad_token_id=tokenizer["pad_token_id"],
        eos_token_id=tokenizer["eos_token_id"], dtype=np.dtype(current["dtype"]),
        bos_token_id=tokenizer.get("bos_token_id"),
        class_name=current.get("class_name", "NumpyFSLDataset"),
        max_target_seq_len=current.get("max_target_seq_len"), seq_len=current.get("seq_len"),
        packing=None if packing is None else SimpleNamespace(**packing))
