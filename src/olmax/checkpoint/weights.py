"""Parameters in the olmax checkpoint format (:mod:`olmax.checkpoint.format`), without the trainer.

``load_params``/``load_meta``/``load_model_config`` read the ``params`` and ``meta`` items of any step
directory (a training step's or a conversion's; given as a step dir, a run dir or a ``checkpoints/``
dir); the stored tree is checked against the shapes its model config implies before any array is
read. ``save_params`` is for single-process writers (conversion, export); training writes through
:class:`olmax.checkpoint.checkpointer.Checkpointer`. Output directories are written atomically: a
hidden temp dir next to the target is filled and then renamed; an existing non-empty target is
refused.

Streaming: a leaf may be a :class:`StreamedArray` (shape, dtype and a function that returns any
block of it). Orbax then writes it through :class:`StreamedArrayHandler`, a numpy handler that
opens the array with the chunk grid orbax chooses (stacked ``[n_layers, ...]`` leaves: one layer
per chunk; others: chunks of at most ``STREAM_CHUNK_BYTES``) and writes it chunk by chunk, one
chunk in memory at a time for the whole save. The stored arrays, their chunked zarr layout and
the tree metadata (``np.ndarray`` leaves) are the ones orbax writes for numpy leaves, so
:func:`load_params` restores them like any other checkpoint, sharded onto any mesh.
:func:`stored_arrays` reads a checkpoint back slice by slice the same way (export).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from olmax import store
from olmax.checkpoint import buckets
from olmax.checkpoint.format import (CHECKPOINT_LIBRARY, META_ITEM, OPT_STATE_ITEM, PARAMS_ITEM, check_meta,
                                     resolve_step_dir, stamp_meta)
from olmax.config import ModelConfig, from_dict, to_dict
from olmax.errors import ConfigError, OlmaxError
from olmax.io import atomic_output_dir, require_utf8_name
from olmax.model.finite import check_params, raise_non_finite, tensor_problem
from olmax.model.params import param_shapes



# ----------------------------------------------------------------------------------------------
# Streamed leaves

STREAM_CHUNK_BYTES = 256 << 20


class StreamedArray:
    """A checkpoint leaf that is never whole in memory: ``read(index)`` returns the numpy block of
    the array at ``index`` (a tuple of slices, one per axis) in ``dtype``. ``stacked`` leaves
    (``[n_layers, ...]``) are stored one layer per chunk."""

    def __init__(self, shape, dtype, read, *, stacked: bool = False) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.stacked = stacked
        self._read = read

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        block = np.asarray(self._read(index))
        want = tuple(len(range(*s.indices(n))) for s, n in zip(index, self.shape))
        if block.shape != want or block.dtype != self.dtype:
            raise ValueError(f"streamed block {index}: got {block.shape} {block.dtype}, "
                             f"expected {want} {self.dtype}")
        return block

    def save_args(self):
        return ocp.SaveArgs(chunk_byte_size=STREAM_CHUNK_BYTES,
                            shard_axes=(0,) if self.stacked and self.ndim > 1 else ())


def chunk_blocks(shape: tuple[int, ...], chunk: tuple[int, ...]) -> Iterator[tuple[slice, ...]]:
    """The blocks of a regular chunk grid over ``shape``, in C order."""
    starts = [range(0, n, c) for n, c in zip(shape, chunk)]
    for corner in itertools.product(*starts):
        yield tuple(slice(a, min(a + c, n)) for a, c, n in zip(corner, chunk, shape))


def _streamed_array_handler():
    class StreamedArrayHandler(ocp.type_handlers.NumpyHandler):
        """Orbax's numpy handler, writing a :class:`StreamedArray` chunk by chunk. One lock per
        event loop makes the leaves (which orbax writes concurrently) take turns, so one chunk
        is in memory at a time."""

        def __init__(self) -> None:
            super().__init__(deepcopy_host_arrays=False)
            self._locks: dict[int, asyncio.Lock] = {}

        async def _open_and_write(self, value, tspec, ts_context) -> None:
            t = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
            chunk = tuple(t.chunk_layout.write_chunk.shape)
            lock = self._locks.setdefault(id(asyncio.get_running_loop()), asyncio.Lock())
            for index in chunk_blocks(value.shape, chunk):
                async with lock:
                    block = value.read(index)
                    await t[index].write(block)
                    del block

    return StreamedArrayHandler()


def _streaming_registry():
    """Orbax's default type handlers plus :class:`StreamedArray` (a registry of this save only)."""
    th = ocp.type_handlers
    return th.create_type_handler_registry(
        *[(t, th.get_type_handler(t)) for t in th.supported_types()],
        (StreamedArray, _streamed_array_handler()))


# ----------------------------------------------------------------------------------------------
# Saving


def _checkpointer(restore_concurrent_gb: int | None = None):
    """Composite checkpointer for the params + meta items. ``restore_concurrent_gb`` bounds the
    bytes orbax reads at once (its default, 96 GB, lets a restore briefly hold about twice the
    model); it must be at least the largest single array."""
    kw = {} if restore_concurrent_gb is None else {"restore_concurrent_gb": restore_concurrent_gb}
    # opt_state (training step dirs) is known but never read here: without a handler for it,
    # orbax warns twice per read that the item "could not be restored".
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        **{PARAMS_ITEM: ocp.StandardCheckpointHandler(**kw),
           OPT_STATE_ITEM: ocp.StandardCheckpointHandler(),
           META_ITEM: ocp.JsonCheckpointHandler()}))


def save_params(directory: str | os.PathLike, params: Any, model_cfg: ModelConfig, *,
                extra_meta: Mapping[str, Any] | None = None,
                before_commit: Callable[[], None] | None = None) -> Path:
    """Write ``params`` (arrays in any dtype; numpy, jax or :class:`StreamedArray`) and the model
    config as a step dir.

    ``extra_meta`` is merged into the meta JSON (it may not override ``model`` or
    ``format_version``). Atomic; refuses an existing non-empty ``directory``. ``before_commit``
    runs once everything is written and may raise to discard it all.
    """
    require_utf8_name(os.path.abspath(directory), "checkpoint directory", CHECKPOINT_LIBRARY)
    meta = dict(extra_meta or {})
    for key in ("model", "format_version"):
        if key in meta:
            raise ValueError(f"extra_meta may not set '{key}'")
    meta = stamp_meta(meta, model=to_dict(model_cfg))
    streamed = any(isinstance(x, StreamedArray) for x in jax.tree.leaves(params))
    if streamed:  # the general pytree handler (same on-disk format) takes registered leaf types
        save_args = jax.tree.map(lambda x: x.save_args() if isinstance(x, StreamedArray)
                                 else ocp.SaveArgs(), params)
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_streaming_registry())
        checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
            **{PARAMS_ITEM: handler, META_ITEM: ocp.JsonCheckpointHandler()}))
        item = ocp.args.PyTreeSave(params, save_args=save_args)
    else:
        checkpointer, item = _checkpointer(), ocp.args.StandardSave(params)
    with atomic_output_dir(directory) as tmp:
        try:
            checkpointer.save(tmp, args=ocp.args.Composite(**{PARAMS_ITEM: item,
                                                              META_ITEM: ocp.args.JsonSave(meta)}),
                              force=True)
        finally:
            checkpointer.close()
        if before_commit is not None:
            before_commit()
    return Path(directory)


def save_train_state(directory: str | os.PathLike, step: int, params: Any, opt_state: Any,
                     model_cfg: ModelConfig, *, extra_meta: Mapping[str, Any] | None = None) -> Path:
    """Write a training checkpoint outside training: ``directory/<step>/`` with ``params``,
    ``opt_state`` and ``meta`` (leaves: numpy or :class:`StreamedArray`, written chunk by chunk),
    as :class:`olmax.checkpoint.checkpointer.Checkpointer` lays a step out, so ``directory`` reads
    as a ``checkpoints/`` dir. Atomic; refuses an existing non-empty ``directory``."""
    require_utf8_name(os.path.abspath(directory), "checkpoint directory", CHECKPOINT_LIBRARY)
    meta = dict(extra_meta or {})
    for key in ("model", "format_version", "step"):
        meta.pop(key, None)
    meta = stamp_meta(meta, model=to_dict(model_cfg), step=int(step))

    def args(tree: Any) -> Any:
        save_args = jax.tree.map(lambda x: x.save_args() if isinstance(x, StreamedArray)
                                 else ocp.SaveArgs(), tree)
        return ocp.args.PyTreeSave(tree, save_args=save_args)

    handler = lambda: ocp.PyTreeCheckpointHandler(  # noqa: E731
        type_handler_registry=_streaming_registry())
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        **{PARAMS_ITEM: handler(), OPT_STATE_ITEM: handler(), META_ITEM: ocp.JsonCheckpointHandler()}))
    with atomic_output_dir(directory) as tmp:
        try:
            checkpointer.save(tmp / str(int(step)), args=ocp.args.Composite(
                **{PARAMS_ITEM: args(params), OPT_STATE_ITEM: args(opt_state),
                   META_ITEM: ocp.args.JsonSave(meta)}), force=True)
        finally:
            checkpointer.close()
    return Path(directory)


# ----------------------------------------------------------------------------------------------
# Locating and loading


def load_meta(path: str | os.PathLike) -> dict:
    """The meta JSON of the step dir ``path`` resolves to (format version checked). Read once per
    process while its files stay as they are (resolving a run and starting it both ask)."""
    step = resolve_step_dir(path)
    return copy.deepcopy(_read_meta(step, _files_stamp(store.join(step, META_ITEM))))


def _orbax_dir(step: Any) -> Any:
    """A step dir as Orbax takes it (a bucket path through :mod:`olmax.checkpoint.buckets`)."""
    return buckets.orbax_path(step) if store.is_bucket(str(step)) else step


def has_item(step: Any, item: str) -> bool:
    """Whether the step dir ``step`` (a Path or a bucket path) holds ``item`` (``opt_state``)."""
    if store.is_bucket(str(step)):
        return bool(store.listdir(store.join(step, item)))
    return (Path(step) / item).is_dir()


def _files_stamp(folder: Any) -> tuple:
    """Names, sizes and modification times of the files below ``folder``: what a rewrite changes."""
    if store.is_bucket(str(folder)):
        got = store.stat(store.join(folder, "metadata"))
        return (got or {}).get("version"), (got or {}).get("size")
    try:
        return tuple(sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
                            for p in folder.rglob("*") if p.is_file()))
    except OSError:
        return ()


@functools.lru_cache(maxsize=16)
def _read_meta(step: Path, _stamp: tuple) -> dict:
    try:
        meta = _checkpointer().restore(_orbax_dir(step), args=ocp.args.Composite(
            **{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
    except Exception as e:  # orbax raises assorted types for unreadable items
        raise OlmaxError(f"cannot read checkpoint meta in {step}: {str(e).splitlines()[0]}") from None
    check_meta(meta, store.join(step, META_ITEM))
    if "model" not in meta:
        raise OlmaxError(f"{step}/{META_ITEM}: not an olmax checkpoint (no 'model' entry)")
    return meta


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored with a checkpoint (step dir, run dir or checkpoints dir)."""
    meta = load_meta(path)
    try:
        return from_dict(ModelConfig, meta["model"], "meta.model")
    except ConfigError as e:
        raise OlmaxError(f"{resolve_step_dir(path)}: bad model config in meta: {e}") from None


def stored_param_shapes(path: str | os.PathLike) -> dict:
    """{dotted name: (shape, dtype)} of the stored params, from orbax metadata (no array reads)."""
    step = resolve_step_dir(path)
    try:
        tree = _checkpointer().metadata(_orbax_dir(step)).item_metadata[PARAMS_ITEM]
    except Exception as e:
        raise OlmaxError(f"cannot read params metadata in {step}: {str(e).splitlines()[0]}") from None
    tree = getattr(tree, "tree", tree)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {_dotted(kp): (tuple(m.shape), np.dtype(m.dtype)) for kp, m in flat}


def _dotted(keypath) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def _checked_config(step: Path) -> tuple[ModelConfig, dict]:
    """The step's ModelConfig and stored {name: (shape, dtype)}, the stored tree checked against
    the config's parameter shapes."""
    cfg = load_model_config(step)
    stored = stored_param_shapes(step)
    expected = {_dotted(kp): s for kp, s in jax.tree_util.tree_flatten_with_path(
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))[0]}
    for name in sorted(set(stored) | set(expected)):
        if name not in stored:
            raise OlmaxError(f"{step}: checkpoint has no parameter '{name}' required by its model config")
        if name not in expected:
            raise OlmaxError(f"{step}: unexpected parameter '{name}' for its model config")
        if stored[name][0] != tuple(expected[name]):
            raise OlmaxError(f"{step}: parameter '{name}' has shape {list(stored[name][0])}, "
                             f"the model config implies {list(expected[name])}")
    return cfg, stored


def load_params(path: str | os.PathLike, *, dtype=None, shardings: Any = None,
                check_finite: bool = True):
    """Restore ``(params, ModelConfig)`` from a step dir, a run dir or a ``checkpoints/`` dir.

    ``dtype``: cast every array on restore (None keeps the stored dtype). ``shardings``: a pytree
    of ``jax.sharding.Sharding`` matching the params (restore onto any device layout); None puts
    everything on the default device. The stored tree must match the config's parameter shapes,
    and (``check_finite``) hold no NaN/Inf (:mod:`olmax.model.finite`: an OlmaxError naming them).
    """
    step = resolve_step_dir(path)
    cfg, stored = _checked_config(step)
    if shardings is None:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: default, param_shapes(cfg),
                                 is_leaf=lambda x: isinstance(x, tuple))
    shapes = param_shapes(cfg)
    flat_shapes, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    flat_shard = treedef.flatten_up_to(shardings)
    target = [jax.ShapeDtypeStruct(tuple(s), dtype or stored[_dotted(kp)][1], sharding=sh)
              for (kp, s), sh in zip(flat_shapes, flat_shard)]
    target = jax.tree_util.tree_unflatten(treedef, target)
    largest = max(math.prod(t.shape) * np.dtype(t.dtype).itemsize for t in jax.tree.leaves(target))
    try:
        restored = _checkpointer(max(1, math.ceil(largest / 1e9))).restore(
            _orbax_dir(step), args=ocp.args.Composite(
                **{PARAMS_ITEM: ocp.args.StandardRestore(target)}))[PARAMS_ITEM]
    except Exception as e:
        raise OlmaxError(f"cannot restore params from {step}: {str(e).splitlines()[0]}") from None
    if check_finite:
        check_params(restored, f"checkpoint {step}")
    return restored, cfg


class StoredArray:
    """One stored parameter, read by slices (``a[i]``, ``a[:, :v]``) into numpy; nothing else of
    it is read or kept."""

    def __init__(self, store, name: str, store_path: str | os.PathLike = "") -> None:
        self._store = store
        self.name = name
        self.store_path = store_path
        self.shape = tuple(store.shape)
        self.dtype = np.dtype(store.dtype.numpy_dtype)

    def __getitem__(self, index) -> np.ndarray:
        try:
            out = np.asarray(self._store[index].read().result())
        except Exception as e:  # tensorstore reports missing or corrupt chunks as ValueError etc.
            raise OlmaxError(f"cannot read parameter '{self.name}': {str(e).splitlines()[0]}") from None
        where = f"{self.name}[{index}]" if isinstance(index, (int, np.integer)) else self.name
        problem = tensor_problem(where, out)
        if problem:
            raise_non_finite(f"checkpoint {self.store_path}", [problem])
        return out


def stored_arrays(path: str | os.PathLike, item: str = PARAMS_ITEM,
                  prefix: str = "") -> tuple[dict, ModelConfig]:
    """``(params, ModelConfig)`` where each leaf is a :class:`StoredArray` over the checkpoint's
    array (orbax's layout: one zarr array per dotted parameter name in the item's OCDBT store),
    for streaming a model out of a checkpoint slice by slice. ``item`` and ``prefix`` open a
    params-shaped subtree of another item instead (``opt_state``, ``inner.0.mu.``: Adam's first
    moment)."""
    step = resolve_step_dir(path)
    cfg, _ = _checked_config(step)
    opener = _ocdbt_opener(step, item)
    tree = jax.tree_util.tree_map_with_path(lambda kp, _s: opener(prefix + _dotted(kp)),
                                            param_shapes(cfg),
                                            is_leaf=lambda x: isinstance(x, tuple))
    return tree, cfg


def stored_array(path: str | os.PathLike, item: str, name: str) -> StoredArray:
    """One array of a step dir's item by its dotted name (e.g. ``opt_state``, ``inner.0.count``)."""
    return _ocdbt_opener(resolve_step_dir(path), item)(name)


def _ocdbt_opener(step: Any, item_name: str) -> Callable[[str], StoredArray]:
    item = store.join(step, item_name)
    try:
        raw = store.read_bytes(store.join(item, "_METADATA"))
        if raw is None:
            raise FileNotFoundError(f"no {store.join(item, '_METADATA')}")
        fmt = json.loads(raw.decode())
    except (OSError, ValueError) as e:
        raise OlmaxError(f"{item}: unreadable tree metadata ({e})") from None
    base: Any = (store.tensorstore_kvstore(f"{item}/") if store.is_bucket(str(item))
                 else f"file://{item}")
    if not fmt.get("use_ocdbt", False):
        raise OlmaxError(f"{item}: not an OCDBT checkpoint (written by an old orbax?)")
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    driver = "zarr3" if fmt.get("use_zarr3") else "zarr"

    def open_one(name: str) -> StoredArray:
        spec = {"driver": driver, "kvstore": {"driver": "ocdbt", "base": base, "path": name}}
        try:
            return StoredArray(ts.open(spec, open=True, read=True, context=context).result(), name,
                               step)
        except Exception as e:
            raise OlmaxError(f"{item}: cannot open array '{name}': "
                             f"{str(e).splitlines()[0]}") from None

    return open_one


__all__ = ["save_params", "save_train_state", "load_params", "load_model_config", "load_meta",
           "stored_param_shapes", "StreamedArray", "StoredArray", "stored_arrays", "stored_array"]
