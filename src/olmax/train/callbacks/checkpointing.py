"""Checkpointing callback: resume, warm start, periodic async saves, NaN guard, SIGTERM save.

The trainer owns one :class:`CheckpointCallback` (built from ``cfg.checkpoint``/``cfg.init`` over
``RUN_DIR/checkpoints``) and uses it in three places:

1. **Start** — :meth:`CheckpointCallback.initial_state` decides where the state comes from, in this
   order: the newest readable checkpoint of the run itself (automatic resume; corrupt ones are
   reported and skipped), else ``init.checkpoint`` (warm start: params, plus with
   ``init.load_optimizer=true`` Adam's moments and step count; the trainer step, data position and
   LR schedule restart at 0 and the new recipe's settings apply; a parameters-only checkpoint such
   as ``olmax convert hf-to-olmax`` writes starts a fresh optimizer), else ``init.hf_dir`` (HF
   weights, fresh optimizer), else a fresh init. The run's model must be the one the weights were
   saved with (:mod:`olmax.interop.architecture`), and weights holding NaN/Inf are refused by name
   (:mod:`olmax.model.finite`). On resume, ``metrics.jsonl`` is rewound to the restored step
   (lines of later steps, which the resumed run will log again, are dropped), so the file always
   reads like one uninterrupted run.
2. **Each step** — :meth:`on_step_end`: a non-finite loss (or a non-finite gradient that was applied)
   stops the run with a one-line error and is never checkpointed, so the last checkpoint on disk is the
   last good one; every ``checkpoint.interval`` steps an async save starts; after SIGTERM (agreed
   across processes) a checkpoint is saved and committed and ``trainer.stop_requested`` is set, which
   the loop honours by ending the run cleanly.
3. **End** — :meth:`on_train_end`: the final step is saved (if not already), all saves committed.

Meta written with every checkpoint: ``model``, ``config`` (resolved RunConfig), ``seed``,
``data_position`` (= batches consumed = step; the next batch index is ``data_position``),
``data_fingerprint``, ``mesh``, ``process_count``, ``device_count``, ``init`` (where the run
started from) and ``vocab_padding`` (the padding rows are in the softmax: they were trained there),
plus ``format_version`` and ``step`` (added by the Checkpointer).

OLMo-core's counterparts: ``train/callbacks/checkpointer.py`` (periodic saves, ephemeral vs
permanent) and ``train/trainer.py`` (``maybe_load_checkpoint``: resume first, else the configured
load path). One deliberate difference from OLMo-core on warm start: the SkipStep rolling loss/grad-norm
windows restart empty (they describe the previous data mix); OLMo-core also starts them empty,
since it never saves them.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from olmax.config import ModelConfig, OlmaxError, RunConfig, to_dict
from olmax.checkpoint.checkpointer import Checkpointer, open_step_dir
from olmax.interop import vocab_padding
from olmax.model.finite import check_params
from olmax.train.metrics import rewind_jsonl


class NonFiniteLoss(OlmaxError):
    """The loss (or an applied gradient) became NaN/Inf; the run stops without saving that state."""


def _model_difference(saved: dict, current: ModelConfig) -> str | None:
    now = to_dict(current)
    names = tuple(sorted(set(saved) | set(now)))
    diffs = [f"{k} {saved.get(k)!r} vs {now.get(k)!r}" for k in names if saved.get(k) != now.get(k)]
    return ", ".join(diffs) or None


class CheckpointCallback:
    """See the module docstring. ``run_dir`` holds ``checkpoints/`` and ``metrics.jsonl``."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, model_cfg: ModelConfig | None = None,
                 metrics_file: str = "metrics.jsonl") -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg or cfg.model
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / metrics_file
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint)
        self.stop = StopSignal().__enter__()
        self.origin: dict[str, Any] = {"kind": "fresh"}
        self.resumed_step: int | None = None
        self.last_good: int | None = None  # newest step known finite and saved (or being saved)

    # -- start ----------------------------------------------------------------------------------

    def _check_resume_meta(self, meta: dict) -> None:
        where = self.ckpt.step_dir(meta.get("step", -1))
        diff = _model_difference(meta.get("model", {}), self.model_cfg)
        if diff:
            raise OlmaxError(f"checkpoint {where} was written for a different model ({diff}); use "
                             f"another --run-dir, or warm-start with init.checkpoint={where}")

    def initial_state(self, abstract_state: Any, init_state: Callable[[Any], Any],
                      train_data: Any = None) -> Any:
        """The state to train from; ``self.resumed_step`` says where the run continues.

        ``abstract_state``: a TrainState of ``jax.ShapeDtypeStruct`` with the target shardings.
        ``init_state(params)``: a fresh TrainState (step 0) around ``params`` (None: fresh params).
        ``train_data``: its ``check_fingerprint`` is called with the checkpoint's fingerprint.
        """
        got = self.ckpt.restore_latest(abstract_state, check_meta=self._check_resume_meta)
        if got is not None:
            step, state, meta = got
            if meta.get("data_position", step) != step:
                raise OlmaxError(f"checkpoint {self.ckpt.step_dir(step)}: data_position "
                                 f"{meta.get('data_position')} != step {step}")
            if train_data is not None and meta.get("data_fingerprint") is not None:
                train_data.check_fingerprint(meta["data_fingerprint"])
            if meta.get("seed") not in (None, self.cfg.seed):
                self.ckpt.report(f"note: seed {self.cfg.seed} differs from the checkpoint's "
                                 f"{meta['seed']}; the data order follows the new seed")
            check_params(state.params, f"checkpoint {self.ckpt.step_dir(step)}")
            self.origin = meta.get("init", {"kind": "fresh"})
            self.resumed_step = self.last_good = step
            if jax.process_index() == 0:
                rewind_jsonl(self.metrics_path, step)
            self.ckpt.report(f"resumed from {self.ckpt.step_dir(step)} (step {step})")
            return state
        self.resumed_step = 0
        if self.cfg.init.checkpoint:
            return self._warm_start(abstract_state, init_state)
        if self.cfg.init.hf_dir:
            return self._from_hf(abstract_state, init_state)
        return init_state(None)

    def _warm_start(self, abstract_state: Any, init_state: Callable[[Any], Any]) -> Any:
        from olmax.checkpoint.format import resolve_step_dir
        from olmax.checkpoint.params import load_model_config, load_params

        where = resolve_step_dir(self.cfg.init.checkpoint)
        self._check_architecture(load_model_config(where), "init.checkpoint", f"{where}/meta")
        load_opt = self.cfg.init.load_optimizer
        if load_opt and not (where / "opt_state").is_dir():
            raise OlmaxError(f"init.checkpoint {where} has no optimizer state "
                             "(set init.load_optimizer=false to start a fresh optimizer)")
        if not (where / "opt_state").is_dir():   # parameters only (olmax convert, save_params)
            target = abstract_state.params
            params, _ = load_params(where, dtype=jax.tree.leaves(target)[0].dtype,
                                    shardings=jax.tree.map(lambda t: t.sharding, target))
            self.origin = {"kind": "checkpoint", "path": str(where), "step": None,
                           "load_optimizer": False}
            self.ckpt.report(f"warm start from {where} (params, fresh optimizer)")
            return init_state(params)
        ro, step = open_step_dir(where, report=self.ckpt.report)
        items = ("params", "opt_state") if load_opt else ("params",)
        try:
            state, _ = ro.restore(step, abstract_state, items=items)
        except Exception as e:
            raise OlmaxError(f"cannot warm-start from {where}: {' '.join(str(e).split())[:300]}") from None
        ro.close()
        check_params(state.params, f"init.checkpoint {where}")
        if load_opt:
            state = state._replace(opt_state=_restart_skip_windows(state.opt_state),
                                   step=jnp.zeros_like(state.step))
        else:
            state = init_state(state.params)
        self.origin = {"kind": "checkpoint", "path": str(where), "step": step,
                       "load_optimizer": load_opt}
        self.ckpt.report(f"warm start from {where} (step {step}; "
                         f"{'params + optimizer state' if load_opt else 'params, fresh optimizer'})")
        return state

    def _check_architecture(self, source: ModelConfig, key: str, where: str) -> None:
        """The run's model must be the weights' model (olmax.interop.architecture)."""
        from olmax.interop.architecture import check_model, describe

        allow = self.cfg.init.allow_architecture_override
        overridden = check_model(self.model_cfg, source, allow_override=allow, key=key,
                                 where=where, hf_source=key == "init.hf_dir")
        if overridden:
            self.ckpt.report(f"note: {describe(source, self.model_cfg, overridden, where, 'this run')} "
                             f"(init.allow_architecture_override=true)")

    def _from_hf(self, abstract_state: Any, init_state: Callable[[Any], Any]) -> Any:
        from olmax.interop.hf import load_hf

        hf_dir = self.cfg.init.hf_dir
        params, hf_cfg, _ = load_hf(hf_dir, padded_vocab_size=self.model_cfg.padded_vocab_size)
        self._check_architecture(hf_cfg, "init.hf_dir", f"{hf_dir}/config.json")
        target = abstract_state.params
        params = jax.tree.map(
            lambda x, t: jax.make_array_from_callback(t.shape, t.sharding,
                                                      lambda idx: x[idx].astype(t.dtype)),
            params, target)
        self.origin = {"kind": "hf", "path": str(hf_dir)}
        self.ckpt.report(f"initialised from HF weights in {hf_dir} (fresh optimizer)")
        return init_state(params)

    # -- meta -----------------------------------------------------------------------------------

    def meta(self, trainer: Any, step: int) -> dict:
        mesh = getattr(trainer, "mesh", None)
        data = getattr(trainer, "data", None)
        return {
            "model": to_dict(self.model_cfg),
            "config": to_dict(self.cfg),
            "seed": self.cfg.seed,
            "data_position": int(step),
            "data_fingerprint": getattr(data, "fingerprint", None),
            "mesh": dict(mesh.shape) if mesh is not None else None,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "init": self.origin,
            vocab_padding.META_KEY: vocab_padding.record(self.model_cfg, in_softmax=True,
                                                         init=vocab_padding.TRAINED),
        }

    def save(self, trainer: Any, step: int, force: bool = False) -> bool:
        return self.ckpt.save(step, trainer.state, self.meta(trainer, step), force=force)

    # -- callback hooks -------------------------------------------------------------------------

    def on_step_end(self, trainer: Any, step: int, metrics: dict) -> dict | None:
        loss = float(metrics["loss"])
        grad_norm = float(metrics.get("grad_norm", 0.0))
        applied = float(metrics.get("skipped", 0.0)) == 0.0
        if not math.isfinite(loss) or (applied and not math.isfinite(grad_norm)):
            self.ckpt.wait()  # pending saves hold earlier, finite states
            what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
            last = (f"the last good checkpoint is {self.ckpt.step_dir(self.last_good)}"
                    if self.last_good else "no checkpoint was written")
            raise NonFiniteLoss(f"{what} at step {step}: stopping without saving this state; {last}")
        stop = self.stop.requested()
        if self.save(trainer, step, force=stop):
            self.last_good = step
        if stop:
            self.ckpt.wait()
            trainer.stop_requested = True
            self.ckpt.report(f"stopping after SIGTERM: checkpoint {self.ckpt.step_dir(step)} saved; "
                             "run the same command to resume")
        return None

    def on_train_end(self, trainer: Any) -> None:
        try:
            step = int(trainer.step)
            if step > 0 and self.save(trainer, step, force=True):
                self.last_good = step
            self.ckpt.wait()
        finally:
            self.close()

    def close(self) -> None:
        self.stop.__exit__(None, None, None)
        self.ckpt.close()


def _restart_skip_windows(opt_state: Any) -> Any:
    """Empty the SkipStep rolling windows of a restored optimizer state (Adam moments/count kept)."""
    if not (hasattr(opt_state, "window") and hasattr(opt_state, "_replace")):
        return opt_state
    window = jax.tree.map(jnp.zeros_like, opt_state.window)
    return opt_state._replace(window=window, last_factor=jnp.ones_like(opt_state.last_factor))


class StopSignal:
    """Turns SIGTERM (and optionally SIGINT) into a flag the training loop polls between steps.

    ``requested()`` is agreed across processes (any process signalled -> all stop at the same step),
    so every process takes part in the final checkpoint. Use as a context manager; the previous
    handlers are restored on exit.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signum

    def __enter__(self) -> "StopSignal":
        for s in self.signals:
            try:
                self._old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def requested(self) -> bool:
        local = self.received is not None
        if jax.process_count() == 1:
            return local
        flags = multihost_utils.process_allgather(np.int32(local))
        return bool(np.any(flags))
