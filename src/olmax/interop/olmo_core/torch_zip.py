"""``torch.save`` archives read and written without torch.

A ``torch.save`` file (torch >= 1.6) is a zip of uncompressed entries under one root folder:
``data.pkl`` (the object, pickle protocol 2, tensors as ``_rebuild_tensor_v2`` over persistent
storage ids), ``data/<key>`` (each storage's raw little-endian bytes, 64-byte aligned),
``byteorder``, ``version``, ``.format_version``, ``.storage_alignment`` and
``.data/serialization_id``. In a DCP ``.distcp`` file every item is one such archive at a byte
range, so the reader works on a range: it reads the archive's tail (the central directory), its
head (``data.pkl``), and then exactly the bytes of each tensor it is asked for.
"""

from __future__ import annotations

import collections
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator

import ml_dtypes
import numpy as np

from olmax.errors import OlmaxError
from olmax.interop.olmo_core import pickles
from olmax.interop.olmo_core.pickles import Call, Global, Persistent, TensorRef

Read = Callable[[int, int], bytes]      # (offset, nbytes) -> exactly those bytes

WINDOW = 64 << 10
NUMPY_DTYPES = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
                "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "int64": np.dtype(np.int64), "int32": np.dtype(np.int32),
                "int16": np.dtype(np.int16), "int8": np.dtype(np.int8),
                "uint8": np.dtype(np.uint8), "bool": np.dtype(np.bool_),
                "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
                "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
STORAGE_OF = {"float32": "FloatStorage", "bfloat16": "BFloat16Storage", "float16": "HalfStorage",
              "float64": "DoubleStorage", "int64": "LongStorage", "int32": "IntStorage",
              "uint8": "ByteStorage", "bool": "BoolStorage"}


@dataclass(frozen=True)
class Entry:
    header_offset: int
    size: int
    method: int
    crc: int          # the zip's CRC-32 of the entry's bytes


class Crcs:
    """The running CRC-32 of each archive entry being read, checked against the zip's once the
    bytes read reach the entry's end, streaming: a read that goes on where the last one ended
    advances it, a read from the entry's first byte starts it again, any other read (out of
    order) is left to one of those. An entry read whole, or from its start to its end in any
    number of pieces, is checked; a damaged one is an OlmaxError naming the file and entry. A CRC
    of 0 is none (``torch.serialization.set_crc32_options(False)`` writes 0 for every entry)."""

    def __init__(self) -> None:
        self._state: dict[Any, tuple[int, int] | None] = {}   # None: checked

    def feed(self, key: Any, entry: Entry, start: int, data: bytes, where: str, name: str) -> None:
        state = self._state.get(key, (0, 0))
        if state is None:
            return
        if start == 0:
            state = (0, 0)
        if state[0] != start:
            return
        pos, crc = start + len(data), zlib.crc32(data, state[1])
        if pos < entry.size:
            self._state[key] = (pos, crc)
            return
        if crc != entry.crc and entry.crc != 0:   # 0: none recorded (torch.save can skip it)
            raise OlmaxError(f"{where}: entry {name} fails its CRC-32 check (the zip records "
                             f"{entry.crc:08x}, its bytes give {crc:08x}): the file is damaged")
        self._state[key] = None

    def unchecked(self) -> list[Any]:
        """The entries read in part only (not yet checked)."""
        return [key for key, state in self._state.items() if state is not None]


class Archive:
    """One ``torch.save`` archive at ``[0, length)`` of ``read``; ``where`` names it in errors.
    Every entry's bytes are checked against its CRC-32 as they are read (:class:`Crcs`: the
    archive's own, or ``crcs`` shared by the archives of a checkpoint under ``key``)."""

    def __init__(self, read: Read, length: int, where: str, *, crcs: Crcs | None = None,
                 key: Any = None) -> None:
        self.where = where
        self.length = length
        self._read = read
        self._crcs = crcs if crcs is not None else Crcs()
        self._key = key
        self._head = read(0, min(length, WINDOW)) if length > 0 else b""
        self.entries = self._central_directory()
        names = list(self.entries)
        self.root = names[0].split("/", 1)[0] if names else ""
        if f"{self.root}/data.pkl" not in self.entries:
            raise OlmaxError(f"{where}: not a torch.save archive (no data.pkl)")

    # -- raw access -----------------------------------------------------------------------------
    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or offset + n > self.length:
            raise OlmaxError(f"{self.where}: truncated (needs bytes {offset}..{offset + n} of "
                             f"{self.length})")
        if offset + n <= len(self._head):
            return self._head[offset:offset + n]
        data = self._read(offset, n)
        if len(data) != n:
            raise OlmaxError(f"{self.where}: truncated (short read at byte {offset})")
        return data

    def _central_directory(self) -> dict[str, Entry]:
        if self.length < 22:
            raise OlmaxError(f"{self.where}: truncated ({self.length} bytes is no zip archive)")
        tail_n = min(self.length, WINDOW)
        tail = self.read(self.length - tail_n, tail_n)
        at = tail.rfind(b"PK\x05\x06")
        if at < 0:
            raise OlmaxError(f"{self.where}: truncated or not a torch.save archive (no zip end record)")
        count, cd_size, cd_offset = struct.unpack("<HII", tail[at + 10:at + 20])
        if cd_offset == 0xFFFFFFFF or count == 0xFFFF:
            count, cd_size, cd_offset = self._zip64_end(tail, at)
        cd = self.read(cd_offset, cd_size)
        entries: dict[str, Entry] = {}
        pos = 0
        for _ in range(count):
            if cd[pos:pos + 4] != b"PK\x01\x02":
                raise OlmaxError(f"{self.where}: corrupt zip central directory")
            method, = struct.unpack("<H", cd[pos + 10:pos + 12])
            crc, csize, usize = struct.unpack("<III", cd[pos + 16:pos + 28])
            n, e, c = struct.unpack("<HHH", cd[pos + 28:pos + 34])
            header, = struct.unpack("<I", cd[pos + 42:pos + 46])
            name = cd[pos + 46:pos + 46 + n].decode("utf-8")
            extra = cd[pos + 46 + n:pos + 46 + n + e]
            usize, csize, header = _zip64_fields(extra, usize, csize, header)
            entries[name] = Entry(header, usize, method, crc)
            pos += 46 + n + e + c
        return entries

    def _zip64_end(self, tail: bytes, at: int) -> tuple[int, int, int]:
        loc = tail.rfind(b"PK\x06\x07", 0, at)
        if loc < 0:
            raise OlmaxError(f"{self.where}: corrupt zip64 end record")
        rec_offset, = struct.unpack("<Q", tail[loc + 8:loc + 16])
        rec = self.read(rec_offset, 56)
        count, cd_size, cd_offset = struct.unpack("<QQQ", rec[32:56])
        return count, cd_size, cd_offset

    # -- entries --------------------------------------------------------------------------------
    def data_offset(self, name: str) -> int:
        """Where entry ``name``'s bytes start (past its local header)."""
        entry = self._entry(name)
        head = self.read(entry.header_offset, 30)
        if head[:4] != b"PK\x03\x04":
            raise OlmaxError(f"{self.where}: corrupt zip entry {name}")
        n, e = struct.unpack("<HH", head[26:30])
        return entry.header_offset + 30 + n + e

    def _entry(self, name: str) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            raise OlmaxError(f"{self.where}: torch.save archive has no entry {name}")
        if entry.method != 0:
            raise OlmaxError(f"{self.where}: entry {name} is compressed (torch.save stores entries)")
        return entry

    def entry_bytes(self, name: str, start: int = 0, n: int | None = None) -> bytes:
        entry = self._entry(name)
        n = entry.size - start if n is None else n
        if start + n > entry.size:
            raise OlmaxError(f"{self.where}: entry {name} holds {entry.size} bytes, "
                             f"{start + n} needed")
        data = self.read(self.data_offset(name) + start, n)
        self._crcs.feed((self._key, name), entry, start, data, self.where, name)
        return data

    def load(self) -> Any:
        """The archive's object, tensors as :class:`~pickles.TensorRef`."""
        return pickles.load(self.entry_bytes(f"{self.root}/data.pkl"), self.where, torch_save=True)

    def array(self, ref: TensorRef, rows: slice | None = None) -> np.ndarray:
        """The tensor ``ref`` of this archive (``rows``: a range of its first axis) as a C-ordered
        numpy array, reading those bytes only."""
        dtype = numpy_dtype(ref.storage.dtype.name, self.where)
        shape = ref.shape
        first, last = (0, shape[0] if shape else 1) if rows is None else \
            rows.indices(shape[0])[:2]
        out_shape = shape if rows is None else (last - first,) + shape[1:]
        if any(d == 0 for d in out_shape):
            return np.zeros(out_shape, dtype)
        if ref.stride != _contiguous_strides(shape):
            raise OlmaxError(f"{self.where}: tensor of shape {list(shape)} is not contiguous "
                             f"(strides {list(ref.stride)})")
        if ref.offset + int(np.prod(shape, dtype=np.int64)) > ref.storage.numel:
            raise OlmaxError(f"{self.where}: tensor reaches past its storage")
        row = int(np.prod(shape[1:], dtype=np.int64))
        start = ref.offset + first * row
        count = int(np.prod(out_shape, dtype=np.int64))
        raw = self.entry_bytes(f"{self.root}/data/{ref.storage.key}", start * dtype.itemsize,
                               count * dtype.itemsize)
        return np.frombuffer(raw, dtype).reshape(out_shape)


def _zip64_fields(extra: bytes, usize: int, csize: int, header: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[pos:pos + 4])
        if tag == 1:
            vals = list(struct.unpack(f"<{size // 8}Q", extra[pos + 4:pos + 4 + size // 8 * 8]))
            if usize == 0xFFFFFFFF:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF:
                csize = vals.pop(0)
            if header == 0xFFFFFFFF:
                header = vals.pop(0)
        pos += 4 + size
    return usize, csize, header


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def numpy_dtype(name: str, where: str = "") -> np.dtype:
    try:
        return NUMPY_DTYPES[name]
    except KeyError:
        raise OlmaxError(f"{where}: tensor dtype torch.{name} is not one olmax reads") from None


def is_zip(data: bytes) -> bool:
    return data[:4] == b"PK\x03\x04"


# ----------------------------------------------------------------------------------------------
# Writing

ALIGN = 64


class PiecedArray:
    """An array written without ever being whole in memory: ``pieces()`` yields it as C-ordered
    blocks of consecutive rows (called twice: once for the checksum, once for the bytes)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any,
                 pieces: Callable[[], Iterator[np.ndarray]]) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.ndim = len(self.shape)
        self.pieces = pieces


def _tensor_node(array: np.ndarray | PiecedArray, key: str) -> Call:
    dtype = array.dtype
    name = next((n for n, d in NUMPY_DTYPES.items() if d == dtype and n in STORAGE_OF), None)
    if name is None:
        raise OlmaxError(f"cannot write a {dtype} tensor to a torch.save archive")
    pid = Persistent(("storage", Global("torch", STORAGE_OF[name]), key, "cpu", int(array.size)))
    return Call(Global("torch._utils", "_rebuild_tensor_v2"),
                (pid, 0, tuple(array.shape), _contiguous_strides(array.shape), False,
                 collections.OrderedDict()))


def _replace_arrays(value: Any, arrays: list) -> Any:
    if isinstance(value, PiecedArray):
        arrays.append(value)
        return _tensor_node(value, str(len(arrays) - 1))
    if isinstance(value, np.ndarray):
        arrays.append(value if value.flags.c_contiguous else value.copy(order="C"))
        return _tensor_node(arrays[-1], str(len(arrays) - 1))
    if isinstance(value, collections.OrderedDict):
        return collections.OrderedDict((k, _replace_arrays(v, arrays)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _replace_arrays(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_arrays(v, arrays) for v in value]
    if isinstance(value, tuple):
        return tuple(_replace_arrays(v, arrays) for v in value)
    return value


def write_torch_save(f: BinaryIO, value: Any, root: str = "archive") -> int:
    """Write ``value`` (plain data; numpy arrays become tensors; pickle nodes of
    :mod:`~pickles` as given) as a ``torch.save`` archive at ``f``'s position. Returns its length."""
    arrays: list = []
    pkl = pickles.dumps(_replace_arrays(value, arrays))
    entries: list[tuple[str, Any]] = [(f"{root}/data.pkl", pkl), (f"{root}/.format_version", b"1"),
                                      (f"{root}/.storage_alignment", b"64"),
                                      (f"{root}/byteorder", b"little")]
    entries += [(f"{root}/data/{i}", a) for i, a in enumerate(arrays)]
    entries += [(f"{root}/version", b"3"), (f"{root}/.data/serialization_id", b"0" * 40)]
    writer = _ZipWriter(f)
    for name, data in entries:
        writer.add(name, data)
    return writer.finish()


class _ZipWriter:
    """Uncompressed zip entries, each one's data 64-byte aligned (as torch writes them)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.start = f.tell()
        self.central: list[bytes] = []

    def add(self, name: str, data: Any) -> None:
        def buffers() -> Iterator[memoryview]:
            if isinstance(data, PiecedArray):
                for piece in data.pieces():
                    yield memoryview(np.ascontiguousarray(piece, data.dtype).reshape(-1)
                                     .view(np.uint8))
            elif isinstance(data, np.ndarray):
                yield memoryview(data.reshape(-1).view(np.uint8))
            else:
                yield memoryview(data)

        size, crc = 0, 0
        for buf in buffers():
            size += buf.nbytes
            crc = zlib.crc32(buf, crc)
        if isinstance(data, PiecedArray) and size != data.size * data.dtype.itemsize:
            raise OlmaxError(f"torch.save entry {name}: pieces hold {size} bytes, the array "
                             f"{data.size * data.dtype.itemsize}")
        if size >= 0xFFFFFFFF:
            raise OlmaxError(f"torch.save entry {name}: {size} bytes is past the zip32 limit")
        crc &= 0xFFFFFFFF
        offset = self.f.tell() - self.start
        raw = name.encode("utf-8")
        pad = (-(offset + 30 + len(raw) + 4)) % ALIGN
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        self.f.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0x21, crc, size, size,
                                 len(raw), len(extra)) + raw + extra)
        for buf in buffers():
            self.f.write(buf)
        self.central.append(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0,
                                        0x21, crc, size, size, len(raw), 0, 0, 0, 0, 0, offset) + raw)

    def finish(self) -> int:
        cd_offset = self.f.tell() - self.start
        cd = b"".join(self.central)
        self.f.write(cd)
        self.f.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(self.central),
                                 len(self.central), len(cd), cd_offset, 0))
        return self.f.tell() - self.start
