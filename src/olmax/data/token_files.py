"""OLMo token files: raw, headerless, little-endian unsigned-int arrays (no ``.npy`` header).

This is the format OLMo-core reads (``data/utils.py: load_array_slice`` does
``np.frombuffer(get_bytes_range(path, start * itemsize, n * itemsize))``) and Dolma writes: the
documents of a file concatenated, each followed by one EOS. dolma2 (vocab 100278) uses uint32.

Readers here never map a whole file into Python objects: sizes come from ``stat`` and reads are
``pread`` of the exact byte range. A path may also be an ``s3://``, ``gs://`` or ``http(s)://``
URL (:mod:`olmax.data.remote`): its size comes from the store and its reads are ranged requests.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable

import numpy as np

from olmax.errors import ConfigError, OlmaxError
from olmax.data.manifests import check_against_manifest, directory_hint
from olmax.data.remote import is_remote, remote_files
from olmax.io import atomic_output, sha256_file

TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64}


def parse_dtype(name: str) -> np.dtype:
    if name not in TOKEN_DTYPES:
        raise ConfigError(f"data.dtype: expected one of {', '.join(TOKEN_DTYPES)}, got {name!r}")
    return np.dtype(TOKEN_DTYPES[name]).newbyteorder("<")


def file_size(path: str, cache_dir: str | os.PathLike | None = None) -> int:
    """Bytes in a token file (local or remote); a missing file, or anything but a regular file
    (a folder, a device), is an OlmaxError naming it."""
    if is_remote(path):
        return remote_files(cache_dir).size(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise OlmaxError(f"token file not found: {path}") from None
    except OSError as e:
        raise OlmaxError(f"cannot read token file {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OlmaxError(f"{path} is a directory, not a token file{directory_hint(path)}")
    if not stat.S_ISREG(st.st_mode):
        raise OlmaxError(f"{path} is not a regular file (token files are plain files)")
    return st.st_size


def file_identity(path: str) -> list:
    """What a cache built from a token file is keyed by: for a local file its resolved absolute
    path, size and modification time (ns); for a remote one its URL, size, and the MD5 and version
    the store states (ETag, generation, Last-Modified...; None where it states none)."""
    if is_remote(path):
        info = remote_files().info(path)
        return [path, info["size"], info.get("md5"), info.get("version")]
    try:
        st = os.stat(path)
    except OSError as e:
        raise OlmaxError(f"cannot read token file {path}: {e.strerror}") from None
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def prefetch_sizes(paths: Iterable[str]) -> None:
    """Ask the stores for the sizes of the remote files among ``paths``, many at a time (later
    :func:`file_size` calls are then answered from memory)."""
    remote = [p for p in paths if is_remote(p)]
    if remote:
        remote_files().sizes(remote)


def file_num_tokens(path: str, dtype: np.dtype) -> int:
    """Token count of a file from its size; a missing file, a size not a multiple of the item size,
    or a size other than the ``manifest.json`` beside it lists (:mod:`olmax.data.manifests`) is an
    :class:`OlmaxError` naming the file."""
    size = file_size(path)
    if not is_remote(path):
        check_against_manifest(path, size, dtype)
    if size % dtype.itemsize:
        raise OlmaxError(
            f"{path}: size {size} bytes is not a multiple of {dtype.itemsize} "
            f"({dtype.name} tokens); the file is truncated or not a token file"
        )
    return size // dtype.itemsize


class RemoteTokens:
    """A remote token file as a read-only 1-D array: ``len`` and contiguous slices, each slice
    fetched with concurrent ranged requests of at most ``piece`` bytes."""

    def __init__(self, path: str, dtype: np.dtype, num_tokens: int, piece: int = 8 << 20) -> None:
        self.path, self.dtype, self.num_tokens, self.piece = path, dtype, num_tokens, piece

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, item: slice) -> np.ndarray:
        if not isinstance(item, slice):
            raise IndexError("RemoteTokens supports slices only")
        start, stop, step = item.indices(self.num_tokens)
        if step != 1:
            raise IndexError("RemoteTokens supports contiguous slices only")
        size = self.dtype.itemsize
        a, b = start * size, max(start, stop) * size
        parts = remote_files().read_ranges(
            [(self.path, o, min(self.piece, b - o)) for o in range(a, b, self.piece)])
        return np.frombuffer(b"".join(parts), dtype=self.dtype)


def open_tokens(path: str, dtype: np.dtype) -> np.ndarray | RemoteTokens:
    """A token file as a read-only 1-D array (local: a memory map; remote: :class:`RemoteTokens`)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    n = file_num_tokens(path, dtype)
    if is_remote(path):
        return RemoteTokens(path, dtype, n)
    if n == 0:
        return np.zeros(0, dtype)
    try:
        return np.memmap(path, mode="r", dtype=dtype, shape=(n,))
    except (OSError, ValueError) as e:
        raise OlmaxError(f"cannot read token file {path}: {e}") from None


class TokenReader:
    """Reads token ranges with ``os.pread``; keeps one descriptor per file (per process). Remote
    files (URLs) are read with ranged requests (:mod:`olmax.data.remote`), through the
    read-through cache in ``cache_dir`` when one is given.

    Picklable: descriptors are dropped on pickling and reopened lazily (grain worker processes).
    """

    def __init__(self, dtype: np.dtype, max_open: int = 256,
                 cache_dir: str | os.PathLike | None = None) -> None:
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.max_open = max_open
        self.cache_dir = cache_dir
        self._fds: dict[str, int] = {}

    def __getstate__(self) -> dict:
        return {"dtype": self.dtype, "max_open": self.max_open, "cache_dir": self.cache_dir,
                "_fds": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= self.max_open:
                self.close()
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise OlmaxError(f"cannot open token file {path}: {e.strerror}") from None
            self._fds[path] = fd
        return fd

    def read_many(self, spans: list[tuple[str, int, int]]) -> list[np.ndarray]:
        """Tokens ``[start, stop)`` of each ``(path, start, stop)``; the remote ones are fetched
        together (concurrent ranged requests), the local ones with ``pread``."""
        out: list[np.ndarray | None] = [None] * len(spans)
        remote = [i for i, (p, _, _) in enumerate(spans) if is_remote(p)]
        if remote:
            size = self.dtype.itemsize
            got = remote_files(self.cache_dir).read_ranges(
                [(spans[i][0], spans[i][1] * size, (spans[i][2] - spans[i][1]) * size) for i in remote])
            for i, data in zip(remote, got):
                out[i] = np.frombuffer(data, dtype=self.dtype)
        for i, (p, a, b) in enumerate(spans):
            if out[i] is None:
                out[i] = self.read(p, a, b)
        return out  # type: ignore[return-value]

    def read(self, path: str, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of ``path`` as a native-endian array of the file dtype."""
        if is_remote(path):
            return self.read_many([(path, start, stop)])[0]
        n = stop - start
        nbytes = n * self.dtype.itemsize
        buf = os.pread(self._fd(path), nbytes, start * self.dtype.itemsize)
        if len(buf) != nbytes:
            raise OlmaxError(f"{path}: short read at token {start} (file changed or truncated?)")
        return np.frombuffer(buf, dtype=self.dtype)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def check_ids(ids: np.ndarray, vocab_size: int, where: str, setting: str | None = None) -> None:
    """Every id must be < vocab_size; otherwise an OlmaxError naming ``where`` and the position.
    ``setting``: what sets the bound, as a user changes it (``data.tokenizer 'dolma2' (100278
    ids)``); the line then leads with it, not with the file (which may be a cache's)."""
    if ids.size and int(ids.max()) >= vocab_size:
        pos = int(np.argmax(ids >= vocab_size))
        if setting:
            raise OlmaxError(f"{setting} does not hold token id {int(ids[pos])}, at position "
                             f"{pos} of {where}: the ids come from another tokenizer")
        raise OlmaxError(
            f"{where}: token id {int(ids[pos])} at position {pos} is >= vocab size {vocab_size}"
        )


def write_tokens_atomic(path: str | os.PathLike, chunks: Iterable[np.ndarray], dtype: np.dtype,
                        *, overwrite: bool = False) -> int:
    """Write ``chunks`` back to back as one raw little-endian token file, atomically.

    Returns the number of tokens written. Refuses to replace an existing file unless ``overwrite``.
    """
    if Path(path).exists() and not overwrite:
        raise OlmaxError(f"{path} already exists; refusing to overwrite")
    le = np.dtype(dtype).newbyteorder("<")
    n = 0
    with atomic_output(path) as f:
        for chunk in chunks:
            arr = np.ascontiguousarray(chunk, dtype=le)
            f.write(arr.tobytes())
            n += arr.size
    return n


class DocumentWriter:
    """Writes documents (each + one EOS) into token files of at most ``max_tokens`` tokens.

    A file is closed before a document would overflow it (a longer single document gets a file of
    its own). File k is ``directory / name(k)``, written atomically; :attr:`files` records each one's
    name, documents, tokens and sha256.
    """

    def __init__(self, directory: str | os.PathLike, name, *, max_tokens: int, dtype: np.dtype,
                 eos_token_id: int, vocab_size: int) -> None:
        self.directory = Path(directory)
        self.name = name
        self.max_tokens = max_tokens
        self.dtype = np.dtype(dtype)
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.files: list[dict] = []
        self.documents = 0
        self.tokens = 0
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0

    def add(self, ids: list[int], where: str) -> None:
        arr = np.empty(len(ids) + 1, dtype=self.dtype)
        arr[:-1] = ids
        arr[-1] = self.eos_token_id
        check_ids(arr, self.vocab_size, where)
        if self._pending and self._pending_tokens + arr.size > self.max_tokens:
            self.flush()
        self._pending.append(arr)
        self._pending_tokens += arr.size
        self.documents += 1
        self.tokens += arr.size

    def flush(self) -> None:
        if not self._pending:
            return
        name = self.name(len(self.files))
        write_tokens_atomic(self.directory / name, self._pending, self.dtype)
        self.files.append({"path": name, "documents": len(self._pending), "tokens": self._pending_tokens,
                           "sha256": sha256_file(self.directory / name)})
        self._pending, self._pending_tokens = [], 0
