"""Training checkpoints on Orbax: async, atomic, keep-last-K plus permanent, resharding restore.

Layout (:mod:`olmax.checkpoint.format`): ``RUN_DIR/checkpoints/<step>/`` holds three Orbax items,
``params/``, ``opt_state/`` and ``meta/`` (JSON: ``format_version``, ``step``, ``data_position``
(batches consumed, i.e. the next batch index the loader serves), ``seed``, ``model``
(``to_dict(ModelConfig)``), ``config`` (the resolved ``RunConfig``) and whatever else the trainer adds).

Atomicity comes from Orbax: a step is written under ``<step>.orbax-checkpoint-tmp-<writer>`` (a
directory of this checkpointer's own) and renamed to ``<step>`` only once every item of every process
is on disk, and old checkpoints are deleted only after a new one is committed. A process killed
mid-save therefore leaves a temporary directory that :class:`Checkpointer` reports (by name) and
removes when it next opens the directory; the previous step stays the latest complete one. A
trainer's commits are fenced by its run lock (:mod:`olmax.checkpoint.fence`): a save of an attempt
that was superseded while it was in flight is never committed.

Restore always goes through an *abstract* target (``jax.ShapeDtypeStruct`` with a sharding per leaf),
so a checkpoint written on N devices / P processes restores on any other device count, mesh or
process count, and in any dtype the target asks for (Orbax casts on read). Nothing platform-specific
is stored: arrays are plain zarr/OCDBT data, metadata is JSON.

Corruption (truncated or zeroed array files, unreadable or missing metadata, a missing item) surfaces
as a read error; :meth:`Checkpointer.restore_latest` reports the step by name, moves it aside to
``<step>.corrupt`` and falls back to the previous complete step. A problem that every checkpoint shares
(e.g. a model whose shapes differ from the checkpoint's) is reported as an error instead, and nothing
is moved.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from olmax import store, transport
from olmax.checkpoint import buckets, fence as fencing
from olmax.checkpoint.format import (ARRAY_ITEMS, CHECKPOINT_LIBRARY, META_ITEM, OPT_STATE_ITEM, PARAMS_ITEM, STEP_RE,
                                     TMP_RE, NewerFormat, check_meta, resolve_step_dir, stamp_meta)
from olmax.config import CheckpointConfig
from olmax.errors import OlmaxError, RestartableError
from olmax.io import require_utf8_name, storage_errno

log = logging.getLogger(__name__)

Report = Callable[[str], None]


def log_report(msg: str) -> None:
    """How the checkpointer (and the start of a run) reports: one log line, from process 0."""
    if jax.process_index() == 0:
        log.info("checkpoint: %s", msg)


_report = log_report


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:240]}"


# ----------------------------------------------------------------------------------------------
# State <-> items


def _get(state: Any, name: str) -> Any:
    return state[name] if isinstance(state, Mapping) else getattr(state, name)


def _has(state: Any, name: str) -> bool:
    return name in state if isinstance(state, Mapping) else hasattr(state, name)


def _step_like(template: Any, step: int) -> Any:
    """``step`` as an array shaped/typed/placed like ``template`` (a ShapeDtypeStruct or array)."""
    value = np.asarray(step, dtype=getattr(template, "dtype", np.int32))
    sharding = getattr(template, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value)


def _with(state: Any, **items: Any) -> Any:
    """``state`` with some fields replaced (a dict, a dataclass or a NamedTuple)."""
    if isinstance(state, Mapping):
        return {**state, **items}
    if dataclasses.is_dataclass(state):
        return dataclasses.replace(state, **items)
    if hasattr(state, "_replace"):
        return state._replace(**items)
    raise TypeError(f"cannot rebuild a {type(state).__name__} (expected a dict, dataclass or NamedTuple)")


def abstract_tree(tree: Any, shardings: Any = None, dtype: Any = None) -> Any:
    """Restore target: ``ShapeDtypeStruct`` per leaf, with the given shardings (a pytree or one sharding).

    ``dtype`` (optional) replaces the dtype of every floating-point leaf (a different dtype policy).
    """
    leaves, treedef = jax.tree.flatten(tree)
    if shardings is None:
        shard_leaves = [getattr(x, "sharding", None) for x in leaves]
    elif isinstance(shardings, jax.sharding.Sharding):
        shard_leaves = [shardings] * len(leaves)
    else:
        shard_leaves = treedef.flatten_up_to(shardings)

    def one(x: Any, s: Any) -> jax.ShapeDtypeStruct:
        dt = x.dtype
        if dtype is not None and np.issubdtype(np.dtype(dt), np.floating):
            dt = dtype
        return jax.ShapeDtypeStruct(np.shape(x), dt, sharding=s)

    return treedef.unflatten([one(x, s) for x, s in zip(leaves, shard_leaves)])


# ----------------------------------------------------------------------------------------------
# The checkpointer


class Checkpointer:
    """Saves and restores training state under ``directory`` (``RUN_DIR/checkpoints``).

    ``save`` is asynchronous when ``ckpt_cfg.async_save`` (device arrays are copied to host, then
    written in the background); ``wait`` blocks until the pending save is committed. Every process
    must call ``save``/``restore``/``wait``/``close`` (each writes its own shards).

    ``fence`` (a trainer's: its run lock's check) is called just before each save is committed and
    raises when this process may no longer write the run: the save is then dropped, its temporary
    directory removed, and the save fails with that error.
    """

    def __init__(self, directory: str | os.PathLike, ckpt_cfg: CheckpointConfig | None = None, *,
                 read_only: bool = False, report: Report | None = None,
                 fence: fencing.Fence | None = None) -> None:
        self.cfg = ckpt_cfg or CheckpointConfig()
        self.remote = store.is_bucket(str(directory))
        self.directory: Any = (store.bucket_path(str(directory), "checkpoint directory")
                               if self.remote else Path(directory).absolute())
        if not self.remote:
            require_utf8_name(self.directory, "checkpoint directory", CHECKPOINT_LIBRARY)
        self.report = report or _report
        self.read_only = read_only
        self.incomplete: list[str] = []   # interrupted saves found (and removed) when opening
        self.corrupt: list[str] = []      # checkpoints found unreadable by restore_latest
        self.fence = fence
        self.writer = "" if read_only else _writer_token()
        if read_only:
            found = (store.listdir(str(self.directory)) if self.remote
                     else Path(self.directory).is_dir())
            if not found:
                raise OlmaxError(f"checkpoint directory not found: {self.directory}")
        else:
            self._check_writable()
            self._scan_incomplete()
        self._mgr = self._manager()
        self._started: int | None = None      # the step of the last save started (async)

    # -- setup -------------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self.remote:
            if jax.process_index() == 0:
                store.check_bucket(self.directory, "checkpoint directory")
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if jax.process_index() == 0:
                with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".write-test-"):
                    pass
        except OSError as e:
            raise OlmaxError(f"checkpoint directory {self.directory} is not writable: "
                             f"{e.strerror or e}") from None

    def _scan_incomplete(self) -> None:
        if self.remote:
            self._scan_uncommitted()
            return
        names = sorted(p.name for p in self.directory.iterdir() if TMP_RE.match(p.name))
        self.incomplete = names
        for name in names:
            self.report(f"ignoring incomplete checkpoint {self.directory / name} "
                        "(an interrupted save); removing it")
            if jax.process_index() == 0:
                shutil.rmtree(self.directory / name, ignore_errors=True)
        _sync("olmax-checkpoint-scan")

    def _scan_uncommitted(self) -> None:
        """In a bucket: steps without their commit file (an interrupted save) are reported and
        removed (:mod:`olmax.checkpoint.buckets`)."""
        names = [n for n in store.listdir(self.directory) if STEP_RE.match(n)
                 and not buckets.committed(self.step_dir(int(n)))]
        self.incomplete = names
        for name in names:
            self.report(f"ignoring incomplete checkpoint {self.step_dir(int(name))} "
                        "(an interrupted save: no commit file); removing it")
            if jax.process_index() == 0:
                store.delete_tree(self.step_dir(int(name)))
        _sync("olmax-checkpoint-scan")

    def _manager(self) -> ocp.CheckpointManager:
        ro = self.read_only     # (orbax warns about every save setting a reader passes)
        extra: dict[str, Any] = {} if ro else {"temporary_path_class": fencing.temporary_path_class(
            remote=self.remote, writer=self.writer, fence=self.fence)}
        if self.remote:
            extra["atomicity_options"] = buckets.atomicity()
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=None if ro else self.cfg.keep,
            keep_period=None if ro else self.cfg.permanent_interval,
            save_interval_steps=0 if ro else 1,
            enable_async_checkpointing=self.cfg.async_save,
            cleanup_tmp_directories=not ro,
            read_only=ro,
            create=not ro,
            **extra,
        )
        handlers = {PARAMS_ITEM: ocp.StandardCheckpointHandler(),
                    OPT_STATE_ITEM: ocp.StandardCheckpointHandler(),
                    META_ITEM: ocp.JsonCheckpointHandler()}
        where = buckets.orbax_path(self.directory) if self.remote else self.directory
        return ocp.CheckpointManager(where, options=opts, item_handlers=handlers)

    # -- queries -----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Checkpoints, oldest first (as ``latest_step``: an in-flight save of this process counts)."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The newest checkpoint (complete on disk, or an async save of this process still in
        flight); not checked for corruption, see ``restore_latest``."""
        return self._mgr.latest_step()

    def step_dir(self, step: int) -> Any:
        """A step's directory: a Path, or a bucket path (str)."""
        return store.join(self.directory, str(step))

    def should_save(self, step: int) -> bool:
        return step % self.cfg.interval == 0

    # -- save --------------------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: Mapping[str, Any], force: bool = False) -> bool:
        """Save ``state`` (``params`` and ``opt_state``) and ``meta`` at ``step``.

        Without ``force`` only steps that are multiples of ``checkpoint.interval`` are saved. A step
        already on disk is not saved again. Returns whether a save was started.
        """
        if self.read_only:
            raise OlmaxError(f"checkpoint directory {self.directory} was opened read-only")
        if not (force or self.should_save(step)):
            return False
        self._raise_pending()
        if step in self._mgr.all_steps():
            return False
        meta = stamp_meta(dict(meta), step=int(step))
        args = ocp.args.Composite(**{
            PARAMS_ITEM: ocp.args.StandardSave(_get(state, PARAMS_ITEM)),
            OPT_STATE_ITEM: ocp.args.StandardSave(_get(state, OPT_STATE_ITEM)),
            META_ITEM: ocp.args.JsonSave(meta),
        })
        # the previous save first (Orbax waits for it anyway): its error is its own step's
        self._saving(self._started, self._mgr.wait_until_finished)
        self._raise_pending()
        self._started = int(step)
        self._saving(step, lambda: self._mgr.save(step, args=args, force=True))
        return True

    def _saving(self, step: int | None, call: Callable[[], Any]) -> Any:
        """``call()``, a part of a save; its error (an OSError, or one wrapped by Orbax or
        TensorStore) as the save's one line, made once that error is handled: the listing of
        what is kept then fails (if it does) on its own, not chained to the save's error."""
        try:
            return call()
        except Exception as e:
            error = e
        raise self._save_error(step, error) from None

    def _save_error(self, step: int | None, e: BaseException) -> OlmaxError:
        try:
            kept = sorted(int(n) for n in self._names() if STEP_RE.match(n))
            intact = f"previous checkpoints intact: {kept or 'none'}"
        except (OSError, OlmaxError):   # a store that is gone cannot be listed either
            intact = "previous checkpoints not listed (the store did not answer)"
        what = f"at step {step} " if step is not None else ""
        if self.remote:     # a store that cannot be reached (after TensorStore's retries): 75
            final = transport.final_error(str(self.directory), e)
            final = None if isinstance(final, transport.NotFound) else final
            cls = OlmaxError if final is not None else RestartableError
            return cls(f"checkpoint save {what}to {self.directory} failed "
                       f"({_short(e) if final is None else final}); {intact}")
        if step is not None and _renamed_onto_a_step(e) and Path(self.step_dir(step)).is_dir():
            return RestartableError(      # the fence passed just before a takeover: 75, not 2
                f"checkpoint save at step {step} to {self.directory} found the step committed "
                f"meanwhile by another writer of this run (an attempt that this one replaced, "
                f"whose save was in flight); a restart resumes from it; {intact}")
        code = storage_errno(e)
        if code is not None:    # the storage's trouble (a full disk, read-only): a restart can help
            return RestartableError(f"checkpoint save {what}to {self.directory} failed: "
                                    f"{os.strerror(code)}; {intact}")
        return OlmaxError(f"checkpoint save {what}to {self.directory} failed ({_short(e)}); "
                          f"{intact}")

    def _names(self) -> list[str]:
        if self.remote:
            return [n for n in store.listdir(self.directory)
                    if not STEP_RE.match(n) or buckets.committed(self.step_dir(int(n)))]
        return [p.name for p in self.directory.iterdir()]

    def _raise_pending(self) -> None:
        """The error of the last save started, which ran in the background, if it failed."""
        self._saving(self._started, self._mgr.check_for_errors)

    def wait(self) -> None:
        """Block until the pending async save (if any) is committed; raise OlmaxError if it failed."""
        self._saving(self._started, self._mgr.wait_until_finished)
        self._raise_pending()

    def close(self) -> None:
        try:
            self._saving(self._started, self._mgr.close)     # (its error is the pending save's)
        finally:
            self._remove_own_temporaries()

    def _remove_own_temporaries(self) -> None:
        """What a save of this checkpointer left behind (one the fence refused, whose directory a
        newer attempt had removed and the writer made again, say); nobody else writes there."""
        if self.read_only or self.remote or jax.process_index() != 0:
            return
        try:
            names = [p.name for p in self.directory.iterdir()]
        except OSError:
            return
        for name in fencing.own_temporaries(names, self.writer):
            shutil.rmtree(self.directory / name, ignore_errors=True)

    # -- restore -----------------------------------------------------------------------------

    def read_meta(self, step: int) -> dict:
        """The ``meta`` item of ``step``, validated (format version, step)."""
        meta = self._mgr.restore(step, args=ocp.args.Composite(
            **{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
        return check_meta(meta, self.step_dir(step), step)

    def restore(self, step: int, abstract_state: Any, *,
                items: tuple[str, ...] = ARRAY_ITEMS) -> tuple[Any, dict]:
        """Restore ``step`` onto ``abstract_state`` (``ShapeDtypeStruct`` leaves with shardings).

        ``items`` limits what is read (e.g. ``("params",)``); the other fields of the abstract state
        come back unchanged. Returns ``(state, meta)``.
        """
        meta = self.read_meta(step)
        args = {name: ocp.args.StandardRestore(_get(abstract_state, name)) for name in items}
        restored = self._mgr.restore(step, args=ocp.args.Composite(**args))
        fields = {name: restored[name] for name in items}
        if _has(abstract_state, "step"):  # TrainState.step: the trainer step, from meta
            fields["step"] = _step_like(_get(abstract_state, "step"), step)
        return _with(abstract_state, **fields), meta

    def restore_latest(self, abstract_state: Any, *, items: tuple[str, ...] = ARRAY_ITEMS,
                       check_meta: Callable[[dict], None] | None = None
                       ) -> tuple[int, Any, dict] | None:
        """Restore the newest readable checkpoint: ``(step, state, meta)``, or None when there is none.

        A checkpoint that fails to read while an older one reads fine is corrupt: it is reported by
        name and moved aside to ``<step>.corrupt``. If every checkpoint fails, the newest one's error
        is raised (as OlmaxError) and nothing is moved. ``check_meta`` may raise OlmaxError to reject
        a checkpoint that does not belong to this run (that error is raised directly), and so is
        a checkpoint in a newer format (:class:`~olmax.checkpoint.format.NewerFormat`): it is not
        corrupt, and resuming from an older step would silently undo the newer run's progress.
        """
        steps = self.all_steps()
        failures: list[tuple[int, str]] = []
        for step in reversed(steps):
            try:
                meta = self.read_meta(step)
            except NewerFormat:
                raise
            except Exception as e:
                failures.append((step, f"unreadable meta ({_short(e)})"))
                continue
            if check_meta is not None:
                check_meta(meta)
            try:
                state, meta = self.restore(step, abstract_state, items=items)
            except Exception as e:
                failures.append((step, _short(e)))
                continue
            for bad, why in failures:
                self._quarantine(bad, why)
            return step, state, meta
        if failures:
            step, why = failures[0]
            raise OlmaxError(f"no readable checkpoint in {self.directory}: newest "
                             f"{self.step_dir(step)} failed ({why})")
        return None

    def _quarantine(self, step: int, why: str) -> None:
        src = self.step_dir(step)
        dst = store.join(self.directory, f"{step}.corrupt")
        if store.exists(store.join(dst, META_ITEM) if self.remote else dst):
            dst = store.join(self.directory, f"{step}.corrupt-{int(time.time())}")
        name = str(dst).rsplit("/", 1)[-1]
        self.report(f"checkpoint {src} is corrupt ({why}); moved to {name}, "
                    "using the previous one")
        self.corrupt.append(str(src))
        if jax.process_index() == 0:
            if self.remote:
                store.move_tree(src, dst)
            else:
                os.replace(src, dst)
        _sync(f"olmax-quarantine-{step}")
        self._mgr.reload()


def _renamed_onto_a_step(e: BaseException) -> bool:
    """Whether ``e`` is (or was caused by) a commit's rename refused because its step exists."""
    return any(isinstance(x, FileExistsError) or (isinstance(x, OSError) and x.errno == errno.ENOTEMPTY)
               for x in transport.chain(e))


def _writer_token() -> str:
    """A token of this checkpointer that every process shares (process 0's, broadcast)."""
    token = np.frombuffer(os.urandom(4), dtype=np.uint32)[0] >> 1
    if jax.process_count() > 1:
        token = multihost_utils.broadcast_one_to_all(np.int32(token))
    return f"{int(token):08x}"


# ----------------------------------------------------------------------------------------------
# Helpers for the trainer


def open_step_dir(path: str | os.PathLike, report: Report | None = None) -> tuple[Checkpointer, int]:
    """A read-only :class:`Checkpointer` over the step dir ``path`` resolves to (a step dir, a run
    dir or a ``checkpoints/`` dir: see :func:`olmax.checkpoint.format.resolve_step_dir`), and its step."""
    step_dir = resolve_step_dir(path)
    parent, _, name = str(step_dir).rstrip("/").rpartition("/")
    if not STEP_RE.match(name):
        raise OlmaxError(f"{step_dir}: not a training checkpoint step dir (its name is not a step)")
    return Checkpointer(parent if store.is_bucket(str(step_dir)) else Path(parent), read_only=True,
                        report=report), int(name)
