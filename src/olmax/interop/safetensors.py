"""safetensors files and directories, read and written tensor by tensor (no memory map, no torch).

The format: a little-endian u64 header length, a JSON header (``{name: {"dtype", "shape",
"data_offsets"}}`` with offsets relative to the data section, plus ``__metadata__``), then the
tensors' bytes back to back. A directory holds ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Only safetensors directories are read
(:func:`check_safetensors_dir`): the pickle formats (``pytorch_model.bin``, ...) can run code when
loaded. Every block read is checked for NaN/Inf. Nothing here knows which model the tensors
belong to (:mod:`olmax.interop.hf` maps them).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import ml_dtypes
import numpy as np

from olmax.errors import OlmaxError
from olmax.model.finite import raise_non_finite, tensor_problem

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# safetensors dtype codes read and written
DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}
_CODES = {dt.name: code for code, dt in DTYPES.items()}
# Bytes per element of every safetensors dtype (its header's lengths are checked by them).
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E5M2FNUZ": 1,
            "F8_E4M3FNUZ": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4,
            "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}

PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")


def check_safetensors_dir(hf_dir: str | os.PathLike) -> Path:
    """``hf_dir`` as a Path when it is a directory with safetensors weights (``model.safetensors``
    or its sharded index). Any other HF directory is refused before a byte of it is read: the
    pickle formats (``pytorch_model.bin``, ``.pt``, ...) can run code when loaded."""
    d = Path(hf_dir)
    if not d.is_dir():
        if d.exists():
            raise OlmaxError(f"{d} is a file, not a Hugging Face model directory")
        raise OlmaxError(f"Hugging Face model directory not found: {d}")
    if (d / SINGLE_FILE).is_file() or (d / INDEX_FILE).is_file():
        return d
    pickled = sorted({p.name for pattern in PICKLE_WEIGHTS for p in d.glob(pattern)})
    if pickled:
        raise OlmaxError(f"{d} holds {', '.join(pickled[:3])} but no {SINGLE_FILE}: olmax reads "
                         f"safetensors weights only (pickled weights can run code when loaded); "
                         f"convert the directory to safetensors first")
    raise OlmaxError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE} (not a Hugging Face safetensors model "
                     f"directory)")


_MAX_HEADER_BYTES = 100 << 20


def read_safetensors_header(path: Path) -> tuple[int, dict[str, dict]]:
    """``(data start offset, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors file,
    checked against the file's size (a truncated or foreign file is an OlmaxError naming it)."""
    def bad(why: str) -> OlmaxError:
        return OlmaxError(f"{path}: unreadable safetensors file ({why})")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            n = struct.unpack("<Q", head)[0]
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise bad(f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
    except OSError as e:
        raise OlmaxError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + n
    spans = []
    for name, entry in header.items():
        try:
            shape = [int(d) for d in entry["shape"]]
            lo, hi = (int(o) for o in entry["data_offsets"])
            code = str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"malformed entry for '{name}'") from None
        if code not in ITEMSIZE:
            raise bad(f"tensor '{name}' has dtype {code!r}, which is no safetensors dtype")
        if any(d < 0 for d in shape) or hi - lo != math.prod(shape) * ITEMSIZE[code]:
            raise bad(f"tensor '{name}' {shape} {code} spans {hi - lo} bytes")
        if not 0 <= lo <= hi or start + hi > size:
            raise bad(f"tensor '{name}' lies past the end of the file ({size} bytes; truncated?)")
        spans.append((lo, hi, name))
    # the tensors' bytes tile the data section, which ends the file (as the safetensors library
    # requires): a length that disagrees anywhere is a damaged or altered file
    at = 0
    for lo, hi, name in sorted(spans):
        if lo != at:
            raise bad(f"tensor '{name}' starts at data byte {lo}, the one before it ends at {at} "
                      f"({'overlap' if lo < at else 'gap'})")
        at = hi
    if start + at != size:
        raise bad(f"the tensors end at byte {start + at}, the file at {size}")
    return start, header


class SafetensorsDir:
    """The weights of an HF directory (single file or sharded index), read tensor by tensor (or
    by row ranges) with plain reads: no memory map, so nothing but the requested bytes enters
    the process.

    Every block read is checked for NaN/Inf: an OlmaxError naming the tensor, or with
    ``collect_non_finite`` the tensor's name is noted in :attr:`non_finite` and reading goes on
    (a streaming writer fails after its last write instead of inside its writer threads, and
    every bad tensor is named)."""

    def __init__(self, hf_dir: str | os.PathLike, *, collect_non_finite: bool = False):
        self.dir = Path(hf_dir)
        self.collect_non_finite = collect_non_finite
        self.non_finite: dict[str, str] = {}     # tensor name -> file
        index, single = self.dir / INDEX_FILE, self.dir / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise OlmaxError(f"{index}: not a safetensors index (no weight_map)") from None
        elif single.is_file():
            weight_map = None
        else:
            raise OlmaxError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self._entries: dict[str, tuple[str, int, dict]] = {}   # name -> (file, data start, entry)
        self.location: dict[str, str] = {}
        for fname in files:
            path = self.dir / fname
            if not path.is_file():
                raise OlmaxError(f"{path}: missing (listed in {INDEX_FILE})")
            start, header = read_safetensors_header(path)
            for k, entry in header.items():
                if k not in self.location:
                    self.location[k] = fname
                    self._entries[k] = (fname, start, entry)
        if weight_map:
            for name, fname in weight_map.items():
                if self.location.get(name) != fname:
                    raise OlmaxError(f"{self.dir / fname}: has no tensor '{name}' "
                                     f"(listed in {INDEX_FILE})")

    def names(self) -> list[str]:
        return list(self.location)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        entry = self._entries[name][2]
        return tuple(int(d) for d in entry["shape"]), str(entry["dtype"])

    def read(self, name: str) -> np.ndarray:
        shape, _ = self.info(name)
        return self.read_rows(name, 0, shape[0] if shape else 1).reshape(shape)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (along the first axis) of a tensor, as a new numpy array."""
        fname, data_start, entry = self._entries[name]
        shape, code = self.info(name)
        dt = DTYPES[code]
        row = math.prod(shape[1:]) * dt.itemsize
        out = np.empty((stop - start, *shape[1:]), dt)
        view = memoryview(out.reshape(-1).view(np.uint8))
        path = self.dir / fname
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(data_start + int(entry["data_offsets"][0]) + start * row)
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise OlmaxError(f"{path}: cannot read tensor '{name}' (file truncated)")
                    got += n
        except OSError as e:
            raise OlmaxError(f"{path}: cannot read tensor '{name}' ({e.strerror})") from None
        problem = tensor_problem(name if (start, stop) == (0, shape[0] if shape else 1)
                                 else f"{name} rows {start}..{stop - 1}", out)
        if problem and not self.collect_non_finite:
            raise_non_finite(str(path), [problem])
        if problem:
            self.non_finite[name] = fname
        return out

    def check_non_finite(self, order: Callable[[str], Any] | None = None) -> None:
        """Raise an OlmaxError naming every tensor found non-finite while collecting (sorted by
        ``order``, a sort key of tensor names)."""
        files = sorted({str(self.dir / f) for f in self.non_finite.values()})
        raise_non_finite(", ".join(files), sorted(self.non_finite, key=order))


def safetensors_header(layout: list[tuple[str, tuple[int, ...], np.dtype]]) -> tuple[bytes, int]:
    """The bytes a safetensors file of ``layout`` (name, shape, dtype in file order) starts with
    (see :func:`write_safetensors`), and the length of its data section."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dt in layout:
        nbytes = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": _CODES[dt.name], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def write_safetensors(path: Path, layout: list[tuple[str, tuple[int, ...], np.dtype]],
                       arrays: Iterable[tuple[str, np.ndarray]]) -> int:
    """Write one safetensors file tensor by tensor: the header (from ``layout``: name, shape,
    dtype in file order) first, then each array of ``arrays`` as it comes, so only one tensor is
    in memory. Format: u64 little-endian header length, the JSON header (``data_offsets`` relative
    to the data section, padded with spaces to 8 bytes), the tensors' bytes back to back.
    Returns the data bytes written."""
    head, offset = safetensors_header(layout)
    with open(path, "wb") as f:
        f.write(head)
        it = iter(arrays)
        for name, shape, dt in layout:
            got_name, a = next(it)
            if got_name != name or tuple(a.shape) != tuple(shape) or a.dtype != dt:
                raise ValueError(f"{path}: expected {name} {shape} {dt}, got {got_name} "
                                 f"{a.shape} {a.dtype}")
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    return offset


def plan_shards(shapes: Mapping[str, tuple[int, ...]], itemsize: int,
                max_shard_bytes: int) -> dict[str, str]:
    """Tensor name -> safetensors file name: tensors in order, a new shard whenever the next one
    would pass ``max_shard_bytes`` (HF's ``model-0000k-of-0000n.safetensors`` names; one
    ``model.safetensors`` when everything fits)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    n = len(shards)
    fnames = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                                          for k in range(n)]
    return {name: fnames[k] for k, names in enumerate(shards) for name in names}
