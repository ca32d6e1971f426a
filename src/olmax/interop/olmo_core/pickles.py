"""The pickles of an OLMo-core checkpoint, read and written without torch.

A pickle is a program: loading one may call any function it names. :func:`load` therefore runs
a restricted unpickler that resolves only the globals of :data:`ALLOWED` (the classes torch's DCP
``.metadata``, ``torch.save`` archives and OLMo-core's trainer state name) to small local stand-ins;
any other global is refused with one line naming it (an :class:`~olmax.errors.OlmaxError`).

The stand-ins:

- DCP records (``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``MetadataIndex``,
  ``_StorageInfo``, ...) are :class:`Record` objects holding the pickled state as attributes
  (``TensorProperties`` pickles a 5-tuple, kept as ``state``);
- ``torch.Size`` is a tuple, a ``torch.<dtype>`` a :class:`DType`, layouts and memory formats names;
- ``torch._utils._rebuild_tensor_v2`` over a persistent storage id gives a :class:`TensorRef`
  (where the bytes are, not the bytes);
- torchao's float8 weight wrapper (``_rebuild_from_type_v2`` of ``WeightWithDynamicFloat8CastTensor``)
  gives the plain tensor it wraps;
- numpy arrays in the trainer's RNG state become :class:`Opaque` (never used).

:class:`Writer` emits the same kinds of pickles (protocol 2) for the export: globals by name, so
torch need not be importable to write what torch reads.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Callable

from olmax.errors import OlmaxError

DCP_META = "torch.distributed.checkpoint.metadata"
SHARD_META = "torch.distributed._shard.sharded_tensor.metadata"
FLOAT8_WRAPPER = ("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor")


class Record:
    """A pickled object of an allow-listed class: its state as attributes."""

    kind = "Record"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}      # (dict state, slots state)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        return f"{self.kind}({self.__dict__})"


def _record_class(name: str, hashable: bool = False, **defaults: Any) -> type:
    """A :class:`Record` class; ``defaults`` stand for fields a pickle leaves out (dataclass
    fields at their default value are not always written)."""
    attrs: dict[str, Any] = {"kind": name, **defaults}
    if hashable:    # MetadataIndex: a dict key, built before it is inserted
        attrs["__hash__"] = lambda self: hash((self.fqn, self.offset, self.index))
        attrs["__eq__"] = lambda self, o: (self.fqn, self.offset, self.index) == (
            o.fqn, o.offset, o.index)
    return type(name, (Record,), attrs)


@dataclass(frozen=True)
class DType:
    """A ``torch.<name>`` dtype."""

    name: str


class Opaque:
    """A value the reader never looks at (numpy RNG state, torchao configs): absorbs its
    construction and state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any) -> "Opaque":
        return Opaque()


@dataclass(frozen=True)
class StorageRef:
    """A ``torch.save`` storage: its dtype and its archive entry ``data/<key>``."""

    dtype: DType
    key: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor in a ``torch.save`` archive: a view (offset, shape, stride in elements) of a storage."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _Wrapper:
    """A tensor subclass being rebuilt by ``_rebuild_wrapper_subclass`` (no data of its own)."""

    def __init__(self, *args: Any) -> None:
        self.cls = args[0] if args else None


def _rebuild_tensor_v2(storage: Any, offset: int, size: tuple, stride: tuple, *rest: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise OlmaxError(f"torch.save archive: a tensor over {type(storage).__name__}, not a storage")
    return TensorRef(storage, int(offset), tuple(int(d) for d in size), tuple(int(s) for s in stride))


def _rebuild_from_type_v2(func: Callable, new_type: Any, args: tuple, state: Any) -> Any:
    """torch's rebuild of a tensor subclass; torchao's float8 weight wrapper -> the tensor inside."""
    if new_type is not _FLOAT8_MARK:
        raise OlmaxError(f"torch.save archive: tensor subclass {new_type!r} is not one olmax reads")
    inner = state.get("_tensor") if isinstance(state, dict) else None
    if not isinstance(inner, TensorRef):
        raise OlmaxError("torch.save archive: a float8 weight wrapper without its plain tensor")
    return inner


_FLOAT8_MARK = _record_class("WeightWithDynamicFloat8CastTensor")

_STORAGES = {"FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
             "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
             "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
             "BoolStorage": "bool"}
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
           "bool", "float8_e4m3fn", "float8_e5m2")


def _allowed() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties"):
        table[(DCP_META, name)] = _record_class(name)
    table[(DCP_META, "StorageMeta")] = _record_class("StorageMeta", checkpoint_id=None)
    table[(SHARD_META, "TensorProperties")] = _record_class("TensorProperties")
    table[(DCP_META, "MetadataIndex")] = _record_class("MetadataIndex", hashable=True, offset=None,
                                                       index=None)
    for module in ("olmo_core.distributed.checkpoint.filesystem",
                   "torch.distributed.checkpoint.filesystem"):
        table[(module, "_StorageInfo")] = _record_class("_StorageInfo")
    for module in (DCP_META, SHARD_META):
        for name in ("_MEM_FORMAT_ENCODING", "MEM_FORMAT_ENCODING"):
            table[(module, name)] = lambda value: int(value)
    table[("torch", "Size")] = tuple
    table[("torch", "device")] = str
    table[("torch.serialization", "_get_layout")] = str
    for d in _DTYPES:
        table[("torch", d)] = DType(d)
    for storage, d in _STORAGES.items():
        table[("torch", storage)] = DType(d)
    table[("torch._utils", "_rebuild_tensor_v2")] = _rebuild_tensor_v2
    table[("torch._tensor", "_rebuild_from_type_v2")] = _rebuild_from_type_v2
    table[("torch._utils", "_rebuild_wrapper_subclass")] = _Wrapper
    table[FLOAT8_WRAPPER] = _FLOAT8_MARK
    for name in ("LinearMMConfig", "ScaledMMConfig"):
        table[("torchao.float8.float8_training_tensor", name)] = Opaque
    table[("collections", "OrderedDict")] = collections.OrderedDict
    table[("builtins", "set")] = set
    table[("builtins", "frozenset")] = frozenset
    table[("_codecs", "encode")] = lambda text, encoding="utf-8": str(text).encode(encoding)
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(module, "_reconstruct")] = Opaque()
        table[(module, "scalar")] = Opaque()
    table[("numpy", "ndarray")] = Opaque
    table[("numpy", "dtype")] = Opaque
    return table


ALLOWED = _allowed()


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str, storage: Callable[[tuple], Any] | None) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where
        self._storage = storage

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise OlmaxError(f"{self._where}: the pickle names {module}.{name}, which is not among "
                             "the classes an OLMo-core checkpoint holds (refused: a pickle is code)"
                             ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._storage is None:
            raise OlmaxError(f"{self._where}: unexpected persistent id in a plain pickle")
        return self._storage(pid)


def _torch_storage(pid: Any) -> StorageRef:
    """``('storage', <dtype>, key, location, numel)``, torch.save's persistent id of a storage."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
            and isinstance(pid[1], DType)):
        raise OlmaxError(f"torch.save archive: unexpected persistent id {pid!r}")
    return StorageRef(pid[1], str(pid[2]), int(pid[4]))


def load(data: bytes, where: str, *, torch_save: bool = False) -> Any:
    """Unpickle ``data`` (``torch_save``: the ``data.pkl`` of a torch.save archive) with the
    allow-list. Any failure is one OlmaxError naming ``where``."""
    try:
        return _Unpickler(data, where, _torch_storage if torch_save else None).load()
    except OlmaxError:
        raise
    except Exception as e:  # truncated or malformed pickles raise assorted types
        raise OlmaxError(f"{where}: unreadable pickle ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class Global:
    """``module.name`` in a pickle being written."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """``func(*args)`` (REDUCE), then optionally ``BUILD`` with ``state``."""

    func: Global
    args: tuple
    state: Any = None


@dataclass(frozen=True)
class New:
    """``cls.__new__(cls, *args)`` (NEWOBJ), then ``BUILD`` with ``state``."""

    cls: Global
    args: tuple
    state: Any


@dataclass(frozen=True)
class Pairs:
    """A dict written from ``(key, value)`` pairs (its keys may be nodes, which do not hash)."""

    items: tuple


@dataclass(frozen=True)
class Persistent:
    """A persistent id (``torch.save``'s storages)."""

    pid: tuple


class Writer:
    """A protocol-2 pickle of plain values, :class:`Global`, :class:`Call`, :class:`New` and
    :class:`Pairs` and :class:`Persistent` nodes. No memo: every value is written where it occurs."""

    def __init__(self) -> None:
        self.out = io.BytesIO()

    def dumps(self, value: Any) -> bytes:
        self.out.write(b"\x80\x02")
        self._value(value)
        self.out.write(b".")
        return self.out.getvalue()

    def _value(self, v: Any) -> None:
        w = self.out.write
        if v is None:
            w(b"N")
        elif v is True or v is False:
            w(b"\x88" if v else b"\x89")
        elif isinstance(v, int):
            if -(1 << 31) <= v < (1 << 31):
                w(b"J" + struct.pack("<i", v))
            else:
                enc = pickle.encode_long(v)
                w(b"\x8a" + bytes([len(enc)]) + enc)
        elif isinstance(v, float):
            w(b"G" + struct.pack(">d", v))
        elif isinstance(v, str):
            enc = v.encode("utf-8")
            w(b"X" + struct.pack("<I", len(enc)) + enc)
        elif isinstance(v, Global):
            w(b"c" + f"{v.module}\n{v.name}\n".encode("ascii"))
        elif isinstance(v, Pairs):
            w(b"}")
            if v.items:
                w(b"(")
                for k, x in v.items:
                    self._value(k)
                    self._value(x)
                w(b"u")
        elif isinstance(v, Persistent):
            self._value(v.pid)
            w(b"Q")
        elif isinstance(v, Call):
            self._value(v.func)
            self._value(tuple(v.args))
            w(b"R")
            if v.state is not None:
                self._value(v.state)
                w(b"b")
        elif isinstance(v, New):
            self._value(v.cls)
            self._value(tuple(v.args))
            w(b"\x81")
            self._value(v.state)
            w(b"b")
        elif isinstance(v, tuple):
            w(b"(")
            for x in v:
                self._value(x)
            w(b"t")
        elif isinstance(v, list):
            w(b"]")
            if v:
                w(b"(")
                for x in v:
                    self._value(x)
                w(b"e")
        elif isinstance(v, dict):
            if isinstance(v, collections.OrderedDict):
                self._value(Global("collections", "OrderedDict"))
                w(b")R")
            else:
                w(b"}")
            if v:
                w(b"(")
                for k, x in v.items():
                    self._value(k)
                    self._value(x)
                w(b"u")
        else:
            raise TypeError(f"cannot pickle {type(v).__name__}")


def dumps(value: Any) -> bytes:
    return Writer().dumps(value)
