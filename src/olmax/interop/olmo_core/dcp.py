"""torch.distributed.checkpoint (DCP) folders, as OLMo-core writes them, without torch.

A DCP folder is a pickled ``.metadata`` and ``__<rank>_<k>.distcp`` data files. ``.metadata``
lists every flat key (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...): a tensor's dtype,
shape and chunks (offsets and sizes), or a pickled value (BYTE_IO); and for each chunk or value
the file and byte range holding it, a complete ``torch.save`` archive. That list is also the only
list of the folder's files (an HTTP folder cannot be listed).

:class:`DcpReader` reads one tensor at a time: each chunk's archive is opened by its byte range
(tail, head, then the tensor's bytes), and the chunks are placed by their offsets into the full
tensor after a check that they tile it exactly. :func:`write_dcp` writes a folder from
``(key, value)`` pairs, one chunk per tensor, one ``.distcp`` file.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from olmax.errors import OlmaxError
from olmax.interop.olmo_core import pickles
from olmax.interop.olmo_core.pickles import DCP_META, Global, New, Record, TensorRef
from olmax.interop.olmo_core.torch_zip import (Archive, Crcs, PiecedArray, is_zip, numpy_dtype,
                                                write_torch_save)

METADATA = ".metadata"
NOUN = "checkpoint file"       # what a missing remote file of a checkpoint is called


# ----------------------------------------------------------------------------------------------
# Files: a local folder or a URL


class Files:
    """The files of a checkpoint folder: a local path or an ``https://``/``s3://``/``gs://`` URL
    (ranged reads through :mod:`olmax.data.remote`)."""

    def __init__(self, root: str | os.PathLike) -> None:
        from olmax.data.remote import is_remote

        self.root = str(root).rstrip("/")
        self.remote = is_remote(self.root)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def exists(self, rel: str) -> bool:
        """Whether the folder has file ``rel``: False for a missing file only; a store that
        cannot be reached or a denied request is raised (exit 75 or 2, naming the URL)."""
        if not self.remote:
            return Path(self.path(rel)).is_file()
        from olmax.data.remote import remote_files
        from olmax.transport import NotFound

        try:
            remote_files().info(self.path(rel), noun=NOUN)
        except NotFound:
            return False
        return True

    def size(self, rel: str) -> int:
        if not self.remote:
            try:
                return Path(self.path(rel)).stat().st_size
            except OSError as e:
                raise OlmaxError(f"{self.path(rel)}: {e.strerror or e}") from None
        from olmax.data.remote import remote_files

        return remote_files().info(self.path(rel), noun=NOUN)["size"]

    def read(self, rel: str, offset: int, n: int) -> bytes:
        if n == 0:
            return b""
        if not self.remote:
            try:
                fd = os.open(self.path(rel), os.O_RDONLY)
            except OSError as e:
                raise OlmaxError(f"{self.path(rel)}: {e.strerror or e}") from None
            try:
                data = os.pread(fd, n, offset)
            finally:
                os.close(fd)
            if len(data) != n:
                raise OlmaxError(f"{self.path(rel)}: truncated (bytes {offset}..{offset + n} "
                                 f"asked, the file ends at {offset + len(data)})")
            return data
        from olmax.data.remote import remote_files

        return remote_files().read_direct(self.path(rel), offset, n, noun=NOUN)

    def read_all(self, rel: str) -> bytes:
        return self.read(rel, 0, self.size(rel))


# ----------------------------------------------------------------------------------------------
# Metadata


@dataclass(frozen=True)
class Location:
    """Where one chunk or value is: a file of the folder and a byte range in it."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    at: Location


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class DcpMetadata:
    tensors: dict[str, TensorMeta]
    values: dict[str, Location]              # BYTE_IO entries
    checkpoint_id: str | None

    @property
    def files(self) -> list[str]:
        """The data files that hold anything, from the metadata (the folder's only file list)."""
        at = [c.at.file for t in self.tensors.values() for c in t.chunks]
        return sorted(set(at) | {v.file for v in self.values.values()})


def _attr(obj: Any, name: str, where: str) -> Any:
    if not hasattr(obj, name):
        raise OlmaxError(f"{where}: {getattr(obj, 'kind', type(obj).__name__)} without '{name}'")
    return getattr(obj, name)


def parse_metadata(data: bytes, where: str) -> DcpMetadata:
    """The DCP ``.metadata`` pickle, checked: every chunk and value has a location."""
    md = pickles.load(data, where)
    if not isinstance(md, Record) or md.kind != "Metadata":
        raise OlmaxError(f"{where}: not a DCP Metadata pickle")
    storage: dict[tuple, Location] = {}
    for index, info in dict(_attr(md, "storage_data", where)).items():
        key = (index.fqn, None if index.offset is None else tuple(index.offset))
        storage[key] = Location(str(info.relative_path), int(info.offset), int(info.length))
    tensors: dict[str, TensorMeta] = {}
    values: dict[str, Location] = {}
    for key, meta in dict(_attr(md, "state_dict_metadata", where)).items():
        if meta.kind == "BytesStorageMetadata":
            if (key, None) not in storage:
                raise OlmaxError(f"{where}: no data location for value '{key}' (a missing chunk)")
            values[key] = storage[(key, None)]
            continue
        if meta.kind != "TensorStorageMetadata":
            raise OlmaxError(f"{where}: '{key}' has unknown storage kind {meta.kind}")
        props = _attr(meta, "properties", where)
        dtype = getattr(props, "dtype", None) or props.state[0]
        shape = tuple(int(d) for d in meta.size)
        chunks = []
        for c in meta.chunks:
            offsets = tuple(int(d) for d in c.offsets)
            if (key, offsets) not in storage:
                raise OlmaxError(f"{where}: no data location for '{key}' chunk at {list(offsets)} "
                                 "(a missing chunk)")
            chunks.append(Chunk(offsets, tuple(int(d) for d in c.sizes), storage[(key, offsets)]))
        tensors[key] = TensorMeta(dtype.name, shape, tuple(chunks))
        _check_coverage(key, tensors[key], where)
    sm = getattr(md, "storage_meta", None)
    return DcpMetadata(tensors, values, getattr(sm, "checkpoint_id", None))


def _check_coverage(key: str, t: TensorMeta, where: str) -> None:
    """The chunks lie inside the tensor, do not overlap, and together cover it."""
    boxes = []
    for c in t.chunks:
        if len(c.offsets) != len(t.shape) or len(c.sizes) != len(t.shape) or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, t.shape)):
            raise OlmaxError(f"{where}: '{key}' chunk at {list(c.offsets)} of size {list(c.sizes)} "
                             f"lies outside the tensor's {list(t.shape)}")
        boxes.append((c.offsets, c.sizes))
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[:i]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb)) and len(oa):
                raise OlmaxError(f"{where}: '{key}' chunks at {list(ob)} and {list(oa)} overlap")
    covered = sum(int(np.prod(s, dtype=np.int64)) for _, s in boxes)
    if covered != int(np.prod(t.shape, dtype=np.int64)):
        raise OlmaxError(f"{where}: the chunks of '{key}' cover {covered} of its "
                         f"{int(np.prod(t.shape, dtype=np.int64))} elements (a missing chunk)")


# ----------------------------------------------------------------------------------------------
# Reading


class DcpReader:
    """A DCP folder (``files`` at its root), read one tensor or value at a time."""

    def __init__(self, files: Files) -> None:
        self.files = files
        self.where = files.root
        if not files.exists(METADATA):
            raise OlmaxError(f"{files.path(METADATA)}: not found (not a DCP checkpoint folder)")
        self.meta = parse_metadata(files.read_all(METADATA), files.path(METADATA))
        self._sizes: dict[str, int] = {}
        self.crcs = Crcs()       # every chunk's entries checked as they are read

    def keys(self) -> list[str]:
        return list(self.meta.tensors) + list(self.meta.values)

    def check_files(self) -> None:
        """Every data file the metadata names exists and is long enough for its ranges."""
        ends: dict[str, int] = {}
        locs = [c.at for t in self.meta.tensors.values() for c in t.chunks]
        for at in locs + list(self.meta.values.values()):
            ends[at.file] = max(ends.get(at.file, 0), at.offset + at.length)
        for name, end in sorted(ends.items()):
            size = self._size(name)
            if size < end:
                raise OlmaxError(f"{self.files.path(name)}: truncated ({size} bytes, the metadata "
                                 f"places data up to byte {end})")

    def _size(self, name: str) -> int:
        if name not in self._sizes:
            if not self.files.exists(name):
                raise OlmaxError(f"{self.files.path(name)}: missing (the metadata names it)")
            self._sizes[name] = self.files.size(name)
        return self._sizes[name]

    def _archive(self, at: Location, what: str) -> Archive:
        end = at.offset + at.length
        if self._size(at.file) < end:
            raise OlmaxError(f"{self.files.path(at.file)}: truncated ({self._size(at.file)} bytes, "
                             f"{what} needs bytes up to {end})")
        return Archive(lambda o, n: self.files.read(at.file, at.offset + o, n), at.length,
                       f"{self.files.path(at.file)} ({what})", crcs=self.crcs,
                       key=(at.file, at.offset))

    def tensor(self, key: str, rows: slice | None = None) -> np.ndarray:
        """The tensor ``key`` (``rows``: a range of its first axis), assembled from its chunks;
        of a chunk cut along the first axis only the rows asked for are read."""
        t = self.meta.tensors.get(key)
        if t is None:
            raise OlmaxError(f"{self.where}: the checkpoint has no tensor '{key}'")
        dtype = numpy_dtype(t.dtype, self.where)
        lo, hi = (0, t.shape[0] if t.shape else 0) if rows is None else rows.indices(t.shape[0])[:2]
        out = np.empty(t.shape if rows is None else (hi - lo,) + t.shape[1:], dtype)
        for c in t.chunks:
            if rows is not None and (c.offsets[0] >= hi or c.offsets[0] + c.sizes[0] <= lo):
                continue
            archive = self._archive(c.at, key)
            ref = archive.load()
            if not isinstance(ref, TensorRef):
                raise OlmaxError(f"{archive.where}: holds {type(ref).__name__}, not a tensor")
            if ref.shape != c.sizes or numpy_dtype(ref.storage.dtype.name, archive.where) != dtype:
                raise OlmaxError(f"{archive.where}: chunk is {list(ref.shape)} "
                                 f"{ref.storage.dtype.name}, the metadata says {list(c.sizes)} "
                                 f"{t.dtype}")
            if rows is None:
                block = archive.array(ref)
                out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = block
                continue
            a, b = max(lo, c.offsets[0]), min(hi, c.offsets[0] + c.sizes[0])
            block = archive.array(ref, slice(a - c.offsets[0], b - c.offsets[0]))
            rest = tuple(slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:]))
            out[(slice(a - lo, b - lo),) + rest] = block
            del block
        return out

    def value(self, key: str) -> Any:
        """A BYTE_IO value: a ``torch.save`` archive or a plain pickle."""
        at = self.meta.values.get(key)
        if at is None:
            raise OlmaxError(f"{self.where}: the checkpoint has no value '{key}'")
        head = self.files.read(at.file, at.offset, min(4, at.length))
        if is_zip(head):
            value = self._archive(at, key).load()
        else:
            value = pickles.load(self.files.read(at.file, at.offset, at.length),
                                 f"{self.files.path(at.file)} ({key})")
        if isinstance(value, TensorRef):
            raise OlmaxError(f"{self.where}: value '{key}' is a tensor")
        return value


# ----------------------------------------------------------------------------------------------
# Writing


def _tensor_meta_node(dtype: str, shape: tuple[int, ...]) -> New:
    g = lambda name: Global(DCP_META, name)  # noqa: E731
    size = pickles.Call(Global("torch", "Size"), (tuple(shape),))
    props = New(g("TensorProperties"), (), (Global("torch", dtype),
                                            pickles.Call(Global("torch.serialization", "_get_layout"),
                                                         ("torch.strided",)),
                                            False, pickles.Call(g("_MEM_FORMAT_ENCODING"), (0,)),
                                            False))
    chunk = New(g("ChunkStorageMetadata"), (),
                {"offsets": pickles.Call(Global("torch", "Size"), ((0,) * len(shape),)),
                 "sizes": size})
    return New(g("TensorStorageMetadata"), (), {"properties": props, "size": size,
                                                 "chunks": [chunk]})


def _index_node(key: str, ndim: int | None) -> New:
    offset = None if ndim is None else pickles.Call(Global("torch", "Size"), ((0,) * ndim,))
    return New(Global(DCP_META, "MetadataIndex"), (),
               {"fqn": key, "offset": offset, "index": None if ndim is None else 0})


def _storage_node(file: str, offset: int, length: int) -> New:
    return New(Global("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"), (),
               {"relative_path": file, "offset": offset, "length": length})


def write_dcp(folder: Path, items: Iterable[tuple[str, Any]], checkpoint_id: str) -> None:
    """Write a DCP folder: ``items`` are ``(flat key, value)``, a numpy array (a tensor, one chunk)
    or a plain value (BYTE_IO, as a ``torch.save`` archive). ``folder`` must exist. One data file,
    ``__0_0.distcp``, written item by item."""
    data_file = "__0_0.distcp"
    sd_meta: dict[str, Any] = {}
    planner: dict[str, tuple] = {}
    storage: list[tuple[New, New]] = []
    with open(folder / data_file, "wb") as f:
        for key, value in items:
            offset = f.tell()
            length = write_torch_save(f, value, root="archive")
            if isinstance(value, (np.ndarray, PiecedArray)):
                dtype = next(n for n, d in _NUMPY_NAMES.items() if d == value.dtype)
                sd_meta[key] = _tensor_meta_node(dtype, tuple(value.shape))
                index = _index_node(key, value.ndim)
            else:
                sd_meta[key] = New(Global(DCP_META, "BytesStorageMetadata"), (), {})
                index = _index_node(key, None)
            planner[key] = tuple(_planner_path(key))
            storage.append((index, _storage_node(data_file, offset, length)))
    metadata = New(Global(DCP_META, "Metadata"), (), {
        "state_dict_metadata": sd_meta,
        "planner_data": planner,
        "storage_data": pickles.Pairs(tuple(storage)),
        "storage_meta": New(Global(DCP_META, "StorageMeta"), (),
                            {"checkpoint_id": checkpoint_id, "save_id": str(uuid.uuid4()),
                             "load_id": None, "modules": []}),
        "version": None,
    })
    (folder / METADATA).write_bytes(pickles.dumps(metadata))


_NUMPY_NAMES = {n: numpy_dtype(n) for n in ("float32", "bfloat16", "float16", "float64", "int64",
                                            "int32", "uint8", "bool")}


def _planner_path(key: str) -> list[str]:
    """DCP's ``planner_data``: the path of a flat key in the state dict OLMo-core saves,
    ``{"model": {fqn: ...}, "optim": {"state.<fqn>.exp_avg": ...}}`` (its optimizer state
    flattened, as its trainer saves it): ``("model", fqn)``, ``("optim", "state.<fqn>.exp_avg")``.
    OLMo-core's ``load_keys`` rebuilds that dict from these paths and looks the keys up in it."""
    head, _, rest = key.partition(".")
    return [head, rest]
