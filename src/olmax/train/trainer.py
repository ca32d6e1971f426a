"""The training loop: a RunConfig and a run directory in, a trained checkpoint and metrics out.

``Trainer(cfg, run_dir).run()``:

1. ``jax.distributed`` from ``cfg.distributed``/the environment; the (data, fsdp, tensor) mesh;
   parameter and optimizer-state shardings from the logical-axis rules (FSDP by default); the
   step compiled ahead of time and checked against the devices' memory, its ``auto`` micro-batch
   and remat policy chosen from that memory (:mod:`olmax.train.fit`), before the run directory is
   written.
2. Training data (``olmax.data.loader.build_train_data``); trainer step s >= 1 consumes data batch
   b = s - 1. Each process reads only its rows (``host_batch``) and the global array is assembled
   with ``jax.make_array_from_process_local_data``.
3. The start state from :func:`olmax.train.start.start_state` (resume from
   ``RUN_DIR/checkpoints/``, else warm start from ``init.checkpoint`` / ``init.hf_dir``, else a
   fresh init from ``init.seed``).
4. Per step: LR from the OLMo-core schedule at ``step`` (counted from 1), the compiled step, then
   one line in ``metrics.jsonl``: ``step, loss`` (CE, full precision), ``z_loss, lr, grad_norm``
   (pre-clip), ``skipped, tokens`` (cumulative tokens trained on), ``batch_hash`` (sha256 of the
   global batch's token ids as uint32 little-endian), ``epoch``, plus what the callbacks add
   (``tokens_per_sec, mfu``, evaluation results). A NaN/Inf loss (or an applied NaN/Inf gradient)
   is logged and stops the run with :class:`NonFiniteLossError`, before any callback sees it.

Callbacks (:mod:`olmax.train.callbacks`: speed monitor, checkpoint saves, evaluation, dashboard)
are built from the config through the registry and called in order, each hook for every callback;
they see a :class:`~olmax.train.callbacks.base.RunView`, not the trainer.

Run directory (created by process 0 if needed): ``metrics.jsonl``, ``tb/`` (TensorBoard),
``config.yaml`` (the resolved config: a length in epochs or tokens written as its step count),
``run_info.json`` (olmax version, git revision, JAX version, devices, the length as given and
resolved, command line, what JAX and libtpu said while starting), ``fit.json`` (the step's ``auto`` micro-batch and remat policy as chosen,
with the memory of each candidate tried: :mod:`olmax.train.fit`; a resumed run keeps them),
``checkpoints/``, ``hangs/`` (stacks the watchdog wrote), and
``.olmax-lock`` while a trainer holds it (one writer per run directory:
:mod:`olmax.train.callbacks.run_lock`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, cast

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils
from tqdm import tqdm

import olmax
from olmax.reporting import startup_messages
from olmax.checkpoint.checkpointer import Checkpointer
from olmax.config import RunConfig, to_dict
from olmax.checkpoint.format import resolve_step_dir
from olmax.errors import NeedsAttentionError, OlmaxError, RestartableError
from olmax.data.loader import batch_hash, build_train_data
from olmax import store
from olmax.store import run_location
from olmax.model.params import count_params
from olmax.parallel.distributed import check_devices, maybe_initialize
from olmax.parallel.mesh import check_rows_per_process, make_mesh
from olmax.train.callbacks import Callback, RunView, build_callbacks
from olmax.train.callbacks.run_lock import NoLock, RunLock, lock_run_dir
from olmax.train.start import Start, initial_state, run_tokenizer, start_state
from olmax.train.run_log import MetricsLogger, metrics_location, rewind_jsonl
from olmax.train.optim import build_optimizer
from olmax.train.schedules import build_schedule
from olmax.config import TrainConfig
from olmax.config.schema import Remat
from olmax.device_memory import raising_does_not_fit
from olmax.train.fit import (FSDP_HINT, StepFit, agree_across_processes, check_record, fit_step,
                             memory_hints)
from olmax.train.step import abstract_batch

log = logging.getLogger(__name__)

FIT_RECORD = "fit.json"    # the step's auto settings, as chosen (olmax.train.fit)
STATE_WHERE = "the training state (parameters and optimizer state)"


class NonFiniteLossError(NeedsAttentionError):
    """A step's loss (or an applied gradient) is NaN/Inf: the run stops without saving that state."""

    @classmethod
    def at(cls, step: int, what: str, ckpt: Checkpointer) -> "NonFiniteLossError":
        """The error for ``step``, naming the last good checkpoint (pending saves are committed
        first: they hold earlier, finite states)."""
        ckpt.wait()
        last = ckpt.latest_step()
        good = (f"the last good checkpoint is {ckpt.step_dir(last)}" if last is not None
                else "no checkpoint was written")
        return cls(f"{what} at step {step}: stopping without saving this state; {good} "
                   "(lower optim.lr or check the data)")


def non_finite(metrics: Mapping[str, Any]) -> str | None:
    """What is not finite in a step's metrics (the loss, or the norm of a gradient that was
    applied), or None."""
    loss = float(metrics["loss"])
    if not math.isfinite(loss):
        return f"loss {loss}"
    grad_norm = float(metrics.get("grad_norm", 0.0))
    if not metrics.get("skipped") and not math.isfinite(grad_norm):
        return f"gradient norm {grad_norm}"
    return None


def _git_revision() -> str | None:
    src = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True,
                             timeout=10)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def create_run_dir(path: Any) -> bool:
    """Create the run directory (and its parents); True when it did not exist before. A path that
    is a file, lies below one or cannot be created is one OlmaxError naming it. A bucket path is
    checked instead (the bucket exists and takes writes; :func:`olmax.store.check_bucket`)."""
    if store.is_bucket(path):
        store.check_bucket(path)
        return False
    if path.exists() and not path.is_dir():
        raise OlmaxError(f"run directory {path} exists and is not a directory")
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OlmaxError(f"run directory {path}: a parent path is a file, not a directory") from None
    except OSError as e:
        raise OlmaxError(f"cannot create run directory {path}: {e.strerror or e}") from None
    return created


class Trainer:
    """See the module docstring. ``callbacks``: added to the registry's (sorted by ``order``).
    ``attempt``: which start of a scheduled job this is (``JOB.N``, :mod:`olmax.lockfile`);
    ``expect_devices``: the (platform, device count) the job was written for, checked first."""

    def __init__(self, cfg: RunConfig, run_dir: str | os.PathLike, *,
                 callbacks: Iterable[Callback] = (), quiet: bool = False,
                 attempt: str | None = None,
                 expect_devices: tuple[str, int] | None = None,
                 step_pricer: Callable[[Any], Callable[[Any], float | None] | None] | None = None) -> None:
        self.cfg = cfg
        # mesh -> the price of a compiled step on it (olmax.perf.step_price.step_pricer), which
        # train.auto_choice=estimate chooses the auto settings by; None: auto chooses by memory
        self.step_pricer = step_pricer
        self.run_dir = run_location(run_dir)     # a Path, or a bucket path (str)
        self.extra_callbacks = list(callbacks)
        self.quiet = quiet
        self.attempt = attempt
        self._validate()
        maybe_initialize(cfg.distributed, who="olmax train")
        if expect_devices is not None:
            check_devices(expect_devices)
        self.is_main = jax.process_index() == 0
        self.logger: MetricsLogger | None = None
        self.run_view: RunView | None = None
        self.summary: dict[str, Any] = {}
        self._batches: Iterator[tuple[int, dict]] = iter(())   # the run's batches (_first_batches)

    # -- setup -------------------------------------------------------------------------------

    def _validate(self) -> None:
        """What training needs beyond a valid RunConfig (which checked its own sections and the
        rules between them): a data source; then the optimizer and schedule."""
        self.cfg.data.source()   # exactly one training data source (ConfigError otherwise)
        self.tx = build_optimizer(self.cfg.optim)
        # a length in epochs or tokens is a step count once the data is read (_build); a length
        # in steps (or the scheduler's own t_max) gives the schedule now
        t = self.cfg.train
        if t.max_steps is not None or self.cfg.scheduler.t_max is not None:
            self.schedule = build_schedule(self.cfg.scheduler, self.cfg.optim.lr, t.max_steps or 1)

    def _note(self, message: str) -> None:
        if self.is_main:
            log.info(message)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def _flush_logs(self) -> None:
        if self.logger is not None:
            self.logger.flush()

    def _prepare_run_dir(self) -> None:
        if not self.is_main:
            return
        cfg_yaml = yaml.safe_dump(json.loads(json.dumps(to_dict(self.cfg))), sort_keys=False)
        path = store.join(self.run_dir, "config.yaml")
        old = store.read_bytes(path)
        if old is not None and old.decode("utf-8", errors="replace") != cfg_yaml:
            path = store.join(self.run_dir, f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml")
            old = store.read_bytes(path)
        if old is None:
            store.write_bytes(path, cfg_yaml.encode())
        info = {"olmax_version": olmax.__version__, "git_revision": _git_revision(),
                "jax_version": jax.__version__, "devices": jax.device_count(),
                "device_kind": jax.devices()[0].device_kind, "processes": jax.process_count(),
                "profile": self.runtime.profile_name, "attn_impl": self.runtime.attn_impl,
                "length": self.length, "max_steps": self.cfg.train.max_steps, "command": sys.argv,
                "startup_messages": startup_messages(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        store.write_bytes(store.join(self.run_dir, "run_info.json"),
                          (json.dumps(info, indent=2) + "\n").encode())
        if self.fit.auto:    # reused on resume, so the run keeps its micro-batches
            record = {**self.fit.record(), "device_kind": info["device_kind"], "devices": info["devices"]}
            store.write_bytes(store.join(self.run_dir, FIT_RECORD),
                              (json.dumps(record, indent=2) + "\n").encode())

    def _build(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        self.mesh = make_mesh(cfg.mesh)
        check_rows_per_process(self.mesh.devices)
        if t.global_batch_size % jax.process_count():
            raise OlmaxError(f"train.global_batch_size {t.global_batch_size} is not divisible by "
                             f"the process count {jax.process_count()}")
        # the data's tokenizer: the one named, else the starting checkpoint's (said in a line)
        self.cfg = cfg = run_tokenizer(cfg, report=self._note)
        self.data = build_train_data(cfg.data, seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                                     seed=cfg.seed)
        if self.data.num_instances < t.global_batch_size:
            raise OlmaxError(f"training data has {self.data.num_instances} instances of {t.seq_len} "
                             f"tokens, fewer than one global batch ({t.global_batch_size})")
        self.data.limit_ids(cfg.model.padded_vocab_size,
                            f"the model's vocabulary (model.padded_vocab_size "
                            f"{cfg.model.padded_vocab_size}; data.tokenizer {cfg.data.tokenizer!r})")
        # The step compiled ahead of time, before the run directory is touched: a step that does
        # not fit the devices is one line, and auto settings are chosen from its memory.
        self.fit = fit = self._fit_step()
        st = fit.training
        assert st is not None
        # The resolved settings are part of the run's config (config.yaml, checkpoint meta).
        self.runtime = st.runtime
        t = replace(t, profile=st.runtime.profile_name, micro_batch_size=fit.micro_batch_size,
                    remat=cast(Remat, fit.remat))
        self.cfg = cfg = replace(cfg, train=t)
        # The run's length as a step count (train.max_epochs / max_tokens resolved on this data):
        # config.yaml records it, and the schedule's horizon is it unless scheduler.t_max is set.
        self.length = t.length
        if t.max_steps is None:
            self.length += (f" = {t.steps_for(self.data.batches_per_epoch, cfg.data.epoch)} steps"
                            f" ({self.data.batches_per_epoch} batches of {t.global_batch_size} x "
                            f"{t.seq_len} per epoch)")
        train = t.resolved(self.data.batches_per_epoch, cfg.data.epoch)
        assert train.max_steps is not None and train.last_step is not None
        self.last_step: int = train.last_step       # the length's end, or the hard stop before it
        self.cfg = cfg = replace(cfg, train=train)
        self.schedule = build_schedule(cfg.scheduler, cfg.optim.lr, train.max_steps)
        self.step_fn, self._fresh_state = fit.compiled, st.fresh_state
        self.abstract_state = st.abstract_state
        self.batch_sharding, self.n_micro = st.batch_shardings, st.n_micro

    def _fit_step(self) -> StepFit:
        """The compiled training step, its ``auto`` settings chosen to fit the devices (an earlier
        choice of this run first: ``RUN_DIR/fit.json``), the same on every process."""
        cfg, t = self.cfg, self.cfg.train
        seed = cfg.init.seed if cfg.init.seed is not None else cfg.seed
        packed = getattr(self.data, "packing", None) is not None
        width = getattr(self.data, "doc_lens_width", None)
        devices = list(self.mesh.devices.flat)
        where = (f"the training step ({len(devices)} x {devices[0].device_kind}, mesh "
                 f"{dict(self.mesh.shape)}, batch {t.global_batch_size} x {t.seq_len})")

        def fit_with(train: TrainConfig, prefer=None) -> StepFit:
            return fit_step(cfg.model, train, self.tx, self.mesh, jax.random.key(seed),
                            lambda st: abstract_batch(st, t.global_batch_size, t.seq_len,
                                                      packed=packed, doc_lens_width=width),
                            where=where, prefer=prefer,
                            price=self.step_pricer(self.mesh) if self.step_pricer else None)

        self.step_where = where
        prefer = self._earlier_fit() if "auto" in (t.micro_batch_size, t.remat) else None
        fit = fit_with(t, prefer)
        agreed = agree_across_processes((fit.micro_batch_size, fit.remat))
        if agreed != (fit.micro_batch_size, fit.remat):   # this process chose otherwise: process 0's
            fit = fit_with(replace(t, micro_batch_size=agreed[0], remat=cast(Remat, agreed[1])))
            fit.auto = tuple(k for k in ("micro_batch_size", "remat") if getattr(t, k) == "auto")
        self.memory_hints = memory_hints(t, fit.micro_batch_size, fit.remat)
        if fit.auto:
            earlier = "" if prefer is None else (
                ", this run's earlier choice" if prefer == agreed else
                f" (this run's earlier micro-batch {prefer[0]} with remat {prefer[1]} no longer fits)")
            if self.is_main:
                log.info(f"olmax train: chose {fit.summary()}{earlier}")
        return fit

    def _earlier_fit(self) -> tuple[int, str] | None:
        """The (micro-batch, remat) this run chose before (``RUN_DIR/fit.json``), if any."""
        path = store.join(self.run_dir, FIT_RECORD)
        raw = store.read_bytes(path)
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise OlmaxError(f"{path}: not JSON; remove it to choose the step's settings again") from None
        return check_record(record, str(path))

    def _global_batch(self, host: dict) -> tuple[dict, str]:
        t = self.cfg.train
        shape = (t.global_batch_size, t.seq_len)
        tokens = np.asarray(host["tokens"], dtype=np.int32)
        mask = np.asarray(host["instance_mask"], dtype=bool)
        batch = {
            "tokens": jax.make_array_from_process_local_data(self.batch_sharding["tokens"], tokens, shape),
            "instance_mask": jax.make_array_from_process_local_data(
                self.batch_sharding["instance_mask"], mask, shape[:1]),
        }
        # packed instances (data.instances=packed): padding is not scored; documents are masked
        for key, dtype in (("label_mask", bool), ("doc_lens", np.int32)):
            if key in host:
                x = np.asarray(host[key], dtype=dtype)
                batch[key] = jax.make_array_from_process_local_data(
                    self.batch_sharding[key], x, (t.global_batch_size, *x.shape[1:]))
        if jax.process_count() == 1:
            return batch, batch_hash(tokens)
        return batch, batch_hash(multihost_utils.process_allgather(tokens, tiled=True))

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to ``train.max_steps`` (or ``train.hard_stop``, or until stopped); returns a summary dict.

        A run that holds no checkpoint of its own is built and checked whole before its run
        directory is touched (data, callbacks, the start state from ``init.*`` with every check
        that can refuse it), so a refused start leaves nothing there; a run that resumes takes
        the directory's lock first and writes nothing before its checkpoint is accepted. The run
        directory is locked for the whole run (:mod:`olmax.train.callbacks.run_lock`): a second
        trainer on it stops before touching anything (a directory this trainer created for
        nothing is removed again)."""
        bucket = store.is_bucket(self.run_dir)
        if bucket and self.is_main:   # the store answers and takes writes (a probe, removed)
            store.check_bucket(self.run_dir)
        prepared = None if self._holds_checkpoints() else self._prepare()
        created = create_run_dir(self.run_dir) if self.is_main and not bucket else False
        try:
            lock = lock_run_dir(self.run_dir, is_main=self.is_main, attempt=self.attempt)
        except BaseException:
            if prepared is not None:
                self._close(prepared[0], None, None, quietly=True)
            if created:
                with contextlib.suppress(OSError):
                    self.run_dir.rmdir()      # only if still empty
            raise
        try:   # the lock is a callback too: it stops the run if it is ever taken over
            return self._run(lock, prepared)
        finally:
            lock.release()

    def _holds_checkpoints(self) -> bool:
        """Whether the run directory holds a checkpoint to resume from, as process 0 sees it
        (every process takes the same path)."""
        holds = False
        if self.is_main:
            try:
                resolve_step_dir(self.run_dir)
                holds = True
            except RestartableError:     # the store did not answer: a restart may see it
                raise
            except OlmaxError:
                holds = False
        if jax.process_count() > 1:
            holds = bool(multihost_utils.broadcast_one_to_all(np.int32(holds)))
        return holds

    def _prepare(self) -> tuple[list[Callback], Start]:
        """A run without checkpoints: its pieces (:meth:`_build`), its callbacks and its start
        state from ``init.*`` (:func:`~olmax.train.start.initial_state`), built and checked
        before anything is written."""
        self._build()
        callbacks = build_callbacks(self.cfg, self.extra_callbacks)   # checks eval inputs
        try:
            with raising_does_not_fit(STATE_WHERE, [FSDP_HINT]):
                start = initial_state(self.cfg, self.abstract_state, self._fresh_state, self.data)
            self._batches = self._first_batches(start.step)
        except BaseException:
            self._close(callbacks, None, None, quietly=True)
            raise
        return callbacks, start

    def _first_batches(self, step: int) -> Iterator[tuple[int, dict]]:
        """The batches from ``step`` on, the first one read now: its token ids are checked against
        the model's vocabulary (and its files read) before anything is written."""
        if step >= self.last_step:
            return iter(())
        it = self.data.iterate(step, jax.process_index(), jax.process_count())
        first = next(it)
        return itertools.chain([first], it)

    def _run(self, lock: RunLock | NoLock, prepared: tuple[list[Callback], Start] | None
             ) -> dict[str, Any]:
        if prepared is None:
            self._build()          # bad data/mesh settings fail before anything is written
            callbacks = build_callbacks(self.cfg, [lock, *self.extra_callbacks])
        else:
            callbacks = sorted([lock, *prepared[0]], key=lambda cb: cb.order)
        try:
            ckpt = Checkpointer(store.join(self.run_dir, "checkpoints"), self.cfg.checkpoint,
                                fence=lock.check)     # a superseded attempt commits nothing
        except BaseException:
            self._close(callbacks, None, None, quietly=True)
            raise
        run = self.run_view = RunView(self.cfg, self.run_dir, self.is_main, checkpointer=ckpt,
                                  mesh=self.mesh, mesh_shape=dict(self.mesh.shape),
                                  data_fingerprint=self.data.fingerprint, log_fn=self.log,
                                  flush_fn=self._flush_logs)
        bar, losses, failed = None, [], True
        try:
            if prepared is None or ckpt.latest_step() is not None:   # checked before any write
                with raising_does_not_fit(STATE_WHERE, [FSDP_HINT]):
                    start = start_state(self.cfg, ckpt, self.abstract_state, self._fresh_state,
                                        self.data)
                self._batches = self._first_batches(start.step)
            else:
                start = prepared[1]
            if self.is_main:
                rewind_jsonl(metrics_location(self.run_dir), start.step)
            self._prepare_run_dir()
            run.state, run.step, run.origin = start.state, start.step, start.origin
            self.logger = MetricsLogger(self.run_dir, self.cfg.logging, enabled=self.is_main,
                                        run_config=to_dict(self.cfg), purge_step=start.step + 1)
            bar = self._announce(start.step)
            self._loop(run, callbacks, bar, losses)
            failed = False
        except BaseException as e:
            for cb in callbacks:
                with contextlib.suppress(Exception):
                    cb.on_error(run, e)
            raise
        finally:
            self._close(callbacks, ckpt, bar, quietly=failed)
        self.summary = {
            "run_dir": str(self.run_dir), "start_step": start.step, "last_step": run.step,
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "min_loss": min(losses) if losses else None, "tokens_per_sec": None,
            "stopped_early": run.stop_requested,
        }
        for cb in callbacks:
            self.summary.update(cb.summary())
        return self.summary

    def _announce(self, start: int) -> tqdm | None:
        """The status line, and a progress bar (process 0, unless quiet or nothing to do)."""
        t = self.cfg.train
        if not self.is_main or self.quiet:
            return None
        last = self.last_step
        stop = f", hard stop at step {t.hard_stop}" if last != t.max_steps else ""
        log.info(f"olmax train: {count_params(self.cfg.model) / 1e6:.1f}M params, mesh "
                 f"{dict(self.mesh.shape)}, batch {t.global_batch_size}x{t.seq_len}, "
                 f"{self.n_micro} micro-batch(es), {self.length}{stop}, "
                 f"steps {start + 1}..{last}, run dir {self.run_dir}")
        if not self.cfg.logging.progress or start >= last:
            return None
        return tqdm(total=last, initial=start, desc="train", unit="step", dynamic_ncols=True,
                    file=sys.stderr)

    def _loop(self, run: RunView, callbacks: list[Callback], bar: tqdm | None, losses: list[float]) -> None:
        t = self.cfg.train
        for cb in callbacks:
            cb.on_train_start(run)
        last = self.last_step
        it = self._batches
        for step in range(run.step + 1, last + 1):
            b, host = next(it)
            if b != step - 1:
                raise OlmaxError(f"data loader served batch {b} for step {step}")
            batch, digest = self._global_batch(host)
            lr = self.schedule(step)
            with raising_does_not_fit(self.step_where, self.memory_hints):   # at run time
                state, m = self.step_fn(run.state, batch, np.float32(lr))
                run.state, run.step = state, step
                m = jax.device_get(m)
            metrics: dict[str, Any] = {
                "loss": float(m["loss"]), "z_loss": float(m["z_loss"]), "lr": lr,
                "grad_norm": float(m["grad_norm"]), "skipped": bool(m["skipped"] > 0),
                "tokens": step * t.global_batch_size * t.seq_len,
                "batch_hash": digest, "epoch": int(self.data.epoch_of(b)),
            }
            losses.append(metrics["loss"])
            what = non_finite(metrics)
            if what:
                self.log(step, metrics)
                raise NonFiniteLossError.at(step, what, run.checkpointer)
            for cb in callbacks:
                metrics.update(cb.on_step_end(run, step, metrics) or {})
            self.log(step, metrics)
            for cb in callbacks:
                cb.after_log(run, step, metrics)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.2e}")
            if run.stop_requested:
                break
        for cb in callbacks:
            cb.on_train_end(run)

    def _close(self, callbacks: list[Callback], ckpt: Checkpointer | None, bar: tqdm | None,
               quietly: bool) -> None:
        """Close callbacks, the checkpointer (committing pending saves, while the run lock is still
        held: each commit is fenced by it), bar and logger; a failure to close is raised only when
        nothing else is being raised."""
        errors: list[BaseException] = []
        last = [cb for cb in callbacks if isinstance(cb, (RunLock, NoLock))]
        closes = [cb.close for cb in callbacks if cb not in last]
        closes += ([ckpt.close] if ckpt is not None else []) + [cb.close for cb in last]
        for close in closes:
            try:
                close()
            except Exception as e:  # every resource is released before raising
                errors.append(e)
        if bar is not None:
            bar.close()
        if self.logger is not None:
            self.logger.close()
        if errors and not quietly:
            raise errors[0]
