"""The training loop: a RunConfig and a run directory in, a trained checkpoint and metrics out.

``Trainer(cfg, run_dir).run()``:

1. ``jax.distributed`` from ``cfg.distributed``/the environment; the (data, fsdp, tensor) mesh;
   parameter and optimizer-state shardings from the logical-axis rules (FSDP by default).
2. Training data (``olmax.data.loader.build_train_data``); trainer step s >= 1 consumes data batch
   b = s - 1. Each process reads only its rows (``host_batch``) and the global array is assembled
   with ``jax.make_array_from_process_local_data``.
3. Start state from the checkpoint callback (resume from ``RUN_DIR/checkpoints/``, else warm start
   from ``init.checkpoint`` / ``init.hf_dir``, else a fresh init from ``init.seed``).
4. Per step: LR from the OLMo-core schedule at ``step`` (counted from 1), the compiled step, then
   the callbacks (speed monitor, checkpointing, evaluation) and one line in ``metrics.jsonl``:
   ``step, loss`` (CE, full precision), ``z_loss, lr, grad_norm`` (pre-clip), ``skipped, tokens``
   (cumulative tokens trained on), ``tokens_per_sec, mfu, batch_hash`` (sha256 of the global
   batch's token ids as uint32 little-endian), ``epoch``. A NaN/Inf loss stops the run.

Run directory: ``metrics.jsonl``, ``tb/`` (TensorBoard), ``config.yaml`` (the resolved config),
``run_info.json`` (olmax version, git revision, JAX version, devices, command line),
``checkpoints/``, and ``.olmax-lock`` while a trainer holds it (one writer per run directory).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from olmax.config import OlmaxError, RunConfig, to_dict
from olmax.io import write_json_atomic, write_text_atomic


def batch_hash(tokens: np.ndarray) -> str:
    """sha256 of token ids as uint32 little-endian, row-major."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<u4").tobytes()).hexdigest()


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


class NonFiniteLossError(OlmaxError):
    """Raised when a step's loss is NaN or Inf."""


class Trainer:
    """See the module docstring. Attributes callbacks may use: ``cfg``, ``model_cfg``, ``run_dir``,
    ``mesh``, ``data``, ``state``, ``params``, ``step``, ``is_main``, ``log(step, metrics)``,
    ``stop_requested``."""

    def __init__(self, cfg: RunConfig, run_dir: str | os.PathLike, *, callbacks: list | None = None,
                 quiet: bool = False) -> None:
        from olmax.parallel.distributed import maybe_initialize

        maybe_initialize(cfg.distributed)
        import jax

        self.cfg = cfg
        self.model_cfg = cfg.model
        self.run_dir = Path(run_dir)
        self.extra_callbacks = list(callbacks or [])
        self.quiet = quiet
        self.is_main = jax.process_index() == 0
        self.step = 0
        self.state: Any = None
        self.stop_requested = False
        self.logger: Any = None
        self.speed: Any = None
        self.summary: dict[str, Any] = {}
        self._validate()

    # -- setup -------------------------------------------------------------------------------

    def _validate(self) -> None:
        t = self.cfg.train
        if t.max_steps <= 0:
            raise OlmaxError(f"train.max_steps must be positive (got {t.max_steps})")
        if t.seq_len <= 1:
            raise OlmaxError(f"train.seq_len must be at least 2 (got {t.seq_len})")
        if t.seq_len > self.model_cfg.max_seq_len and self.model_cfg.rope_scaling is None:
            raise OlmaxError(f"train.seq_len {t.seq_len} exceeds model.max_seq_len "
                             f"{self.model_cfg.max_seq_len}")
        if t.global_batch_size <= 0:
            raise OlmaxError(f"train.global_batch_size must be positive (got {t.global_batch_size})")
        from olmax.train.optim import build_optimizer
        from olmax.train.schedules import build_schedule
        from olmax.train.step import COMPUTE_DTYPES

        if t.compute_dtype not in COMPUTE_DTYPES:
            raise OlmaxError(f"train.compute_dtype must be one of {list(COMPUTE_DTYPES)} "
                             f"(got {t.compute_dtype!r})")
        self.tx = build_optimizer(self.cfg.optim)
        self.schedule = build_schedule(self.cfg.scheduler, self.cfg.optim.lr, t.max_steps)

    @property
    def params(self) -> Any:
        return self.state.params

    def log(self, step: int, metrics: dict) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def _say(self, msg: str) -> None:
        if self.is_main and not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def _prepare_run_dir(self) -> None:
        import jax

        import olmax

        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg_text = json.dumps(to_dict(self.cfg), indent=2)
        import yaml

        cfg_yaml = yaml.safe_dump(json.loads(cfg_text), sort_keys=False)
        path = self.run_dir / "config.yaml"
        if path.exists() and path.read_text() != cfg_yaml:
            path = self.run_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml"
        if not path.exists():
            write_text_atomic(path, cfg_yaml)
        info = {"olmax_version": olmax.__version__, "git_revision": _git_revision(),
                "jax_version": jax.__version__, "devices": jax.device_count(),
                "device_kind": jax.devices()[0].device_kind, "processes": jax.process_count(),
                "attn_impl": self.attn_impl,
                "command": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write_json_atomic(self.run_dir / "run_info.json", info)

    def _build(self) -> None:
        import jax

        from olmax.data.loader import build_train_data
        from olmax.parallel.mesh import make_mesh
        from olmax.train.step import build_sharded_training

        cfg, t = self.cfg, self.cfg.train
        self.mesh = make_mesh(cfg.mesh)
        seed = cfg.init.seed if cfg.init.seed is not None else cfg.seed
        st = build_sharded_training(self.model_cfg, t, self.tx, self.mesh, jax.random.key(seed))
        if t.global_batch_size % jax.process_count():
            raise OlmaxError(f"train.global_batch_size {t.global_batch_size} is not divisible by "
                             f"the process count {jax.process_count()}")
        self.data = build_train_data(cfg.data, seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                                     seed=cfg.seed)
        if self.data.num_instances < t.global_batch_size:
            raise OlmaxError(f"training data has {self.data.num_instances} instances of {t.seq_len} "
                             f"tokens, fewer than one global batch ({t.global_batch_size})")
        self.step_fn, self._init_state = st.step_fn, st.init_state
        self.state_shardings, self.abstract_state = st.state_shardings, st.abstract_state
        self.batch_sharding, self.n_micro = st.batch_shardings, st.n_micro
        self.attn_impl = st.attn_impl

    def _callbacks(self) -> list:
        from olmax.train.callbacks.speed_monitor import SpeedMonitor

        self.speed = SpeedMonitor()
        cbs: list = [self.speed]
        try:
            from olmax.train.callbacks.evaluator import EvaluatorCallback
        except ImportError:
            EvaluatorCallback = None  # type: ignore[assignment,misc]
        # first: it checks the eval tasks and files, and nothing is opened yet
        ev = EvaluatorCallback.from_config(self.cfg) if EvaluatorCallback is not None else None
        try:
            from olmax.train.callbacks.checkpointing import CheckpointCallback
        except ImportError:
            CheckpointCallback = None  # type: ignore[assignment,misc]
        self.ckpt_cb = (CheckpointCallback(self.cfg, self.run_dir, model_cfg=self.model_cfg)
                        if CheckpointCallback is not None else None)
        if self.ckpt_cb is not None:
            cbs.append(self.ckpt_cb)
        if ev is not None:
            cbs.append(ev)
        from olmax.train.callbacks.dashboard import DashboardCallback

        return cbs + self.extra_callbacks + [DashboardCallback()]

    def _initial_state(self) -> Any:
        if self.ckpt_cb is not None:
            state = self.ckpt_cb.initial_state(self.abstract_state, self._init_state, self.data)
            return state, int(self.ckpt_cb.resumed_step or 0)
        if self.cfg.init.checkpoint or self.cfg.init.hf_dir:
            raise OlmaxError("init.checkpoint / init.hf_dir need olmax.checkpoint")
        return self._init_state(None), 0

    def _global_batch(self, host: dict) -> tuple[dict, str]:
        import jax

        t = self.cfg.train
        shape = (t.global_batch_size, t.seq_len)
        tokens = np.asarray(host["tokens"], dtype=np.int32)
        mask = np.asarray(host["instance_mask"], dtype=bool)
        batch = {
            "tokens": jax.make_array_from_process_local_data(self.batch_sharding["tokens"], tokens, shape),
            "instance_mask": jax.make_array_from_process_local_data(
                self.batch_sharding["instance_mask"], mask, shape[:1]),
        }
        if jax.process_count() == 1:
            digest = batch_hash(tokens)
        else:
            from jax.experimental import multihost_utils

            everything = multihost_utils.process_allgather(tokens, tiled=True)
            digest = batch_hash(everything)
        return batch, digest

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to ``train.max_steps`` (or until stopped); returns a summary dict. The run
        directory is locked for the whole run (:mod:`olmax.train.run_lock`): a second trainer on
        it stops before touching anything."""
        from olmax.train.run_lock import lock_run_dir

        lock = lock_run_dir(self.run_dir, is_main=self.is_main)
        self.extra_callbacks.append(lock)     # stops the run if the lock is ever taken over
        try:
            return self._run()
        finally:
            self.extra_callbacks.remove(lock)
            lock.release()

    def _run(self) -> dict[str, Any]:
        import jax

        from olmax.train.metrics import MetricsLogger, rewind_jsonl

        t = self.cfg.train
        self._build()              # bad data/mesh settings fail before anything is written
        self._prepare_run_dir()
        callbacks = self._callbacks()
        self.state, start = self._initial_state()
        self.step = start
        if start == 0 and self.is_main and (self.run_dir / "metrics.jsonl").exists():
            rewind_jsonl(self.run_dir / "metrics.jsonl", 0)   # a restart from scratch
        self.logger = MetricsLogger(self.run_dir, self.cfg.logging, enabled=self.is_main,
                                    run_config=to_dict(self.cfg), purge_step=start + 1)
        self._say(f"olmax train: {self.model_cfg.num_params() / 1e6:.1f}M params, mesh "
                  f"{dict(self.mesh.shape)}, batch {t.global_batch_size}x{t.seq_len}, "
                  f"{self.n_micro} micro-batch(es), steps {start + 1}..{t.max_steps}, "
                  f"run dir {self.run_dir}")
        bar = None
        if self.is_main and self.cfg.logging.progress and not self.quiet and start < t.max_steps:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, initial=start, desc="train", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        losses: list[float] = []
        try:
            for cb in callbacks:
                if hasattr(cb, "on_train_start"):
                    cb.on_train_start(self)
            it = self.data.iterate(start, jax.process_index(), jax.process_count()) \
                if start < t.max_steps else iter(())
            for step in range(start + 1, t.max_steps + 1):
                b, host = next(it)
                if b != step - 1:
                    raise OlmaxError(f"data loader served batch {b} for step {step}")
                batch, digest = self._global_batch(host)
                lr = self.schedule(step)
                self.state, m = self.step_fn(self.state, batch, np.float32(lr))
                m = jax.device_get(m)
                self.step = step
                metrics: dict[str, Any] = {
                    "loss": float(m["loss"]), "z_loss": float(m["z_loss"]), "lr": lr,
                    "grad_norm": float(m["grad_norm"]), "skipped": bool(m["skipped"] > 0),
                    "tokens": step * t.global_batch_size * t.seq_len,
                    "batch_hash": digest, "epoch": int(self.data.epoch_of(b)),
                }
                losses.append(metrics["loss"])
                if not math.isfinite(metrics["loss"]):
                    self._stop_non_finite(step, metrics, callbacks)
                for cb in callbacks:
                    if hasattr(cb, "on_step_end") and cb is not self.ckpt_cb:
                        extra = cb.on_step_end(self, step, metrics)
                        if extra:
                            metrics.update(extra)
                self.log(step, metrics)
                # Checkpoint only once the step's metrics line is written: a resume rewinds
                # metrics.jsonl to the restored step, so that step's line must already be there.
                if self.ckpt_cb is not None:
                    self.ckpt_cb.on_step_end(self, step, metrics)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.2e}")
                if self.stop_requested:
                    break
            for cb in callbacks:
                if hasattr(cb, "on_train_end"):
                    cb.on_train_end(self)
        except BaseException:
            if self.ckpt_cb is not None:
                try:
                    self.ckpt_cb.close()
                except Exception:
                    pass
            raise
        finally:
            if bar is not None:
                bar.close()
            if self.logger is not None:
                self.logger.close()
        self.summary = {
            "run_dir": str(self.run_dir), "start_step": start, "last_step": self.step,
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "min_loss": min(losses) if losses else None,
            "tokens_per_sec": self.speed.steady_tokens_per_sec() if self.speed else None,
            "stopped_early": self.stop_requested,
        }
        return self.summary

    def _stop_non_finite(self, step: int, metrics: dict, callbacks: list) -> None:
        """Log the step, let the checkpoint callback report the last good checkpoint, stop."""
        self.log(step, metrics)
        if self.ckpt_cb is not None:
            self.ckpt_cb.on_step_end(self, step, metrics)   # raises with the checkpoint situation
        raise NonFiniteLossError(f"loss is {metrics['loss']} at step {step}: stopping the run "
                                 "(lower optim.lr or check the data)")
