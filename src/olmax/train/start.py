"""Where a run's training state comes from: one function, :func:`start_state`.

In this order:

1. **Resume**: the newest readable checkpoint of the run itself (``RUN_DIR/checkpoints``; corrupt ones
   are reported, moved aside and skipped). It must have been written for the same model, and its
   data fingerprint must match the run's data. The step, data position and LR schedule continue.
2. **Warm start** from ``init.checkpoint``: its parameters, plus with ``init.load_optimizer=true``
   Adam's moments and step count; the trainer step, data position and LR schedule restart at 0
   and the new recipe's settings apply. The SkipStep rolling loss/grad-norm windows restart empty
   (they describe the previous data mix), as in OLMo-core, which never saves them. A
   parameters-only checkpoint (``olmax convert hf-to-olmax`` writes them) starts a fresh optimizer.
3. **Hugging Face** weights from ``init.hf_dir``, with a fresh optimizer.
4. **Fresh**: parameters initialised from ``init.seed``.

The run's model must be the one the weights were saved with: the weights' config is read by
:func:`olmax.interop.architecture.read_weights_config` and checked by
:func:`olmax.model.presets.resolve_model`, the functions that resolved the recipe. Weights holding
NaN/Inf are refused by name (:mod:`olmax.model.finite`).

On every start ``metrics.jsonl`` is rewound to the start step (lines of later steps, which the
run will log again, are dropped), so the file always reads like one uninterrupted run.

OLMo-core's counterpart is ``Trainer.maybe_load_checkpoint`` (resume first, else the configured
load path).
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from olmax.checkpoint.checkpointer import Checkpointer, open_step_dir
from olmax.checkpoint.format import OPT_STATE_ITEM, resolve_step_dir
from olmax.checkpoint.weights import load_params
from olmax.config import ModelConfig, ModelSpec, RunConfig, to_dict
from olmax.errors import OlmaxError
from olmax.interop.architecture import read_weights_config
from olmax.interop.hf import load_hf
from olmax.model.finite import check_params
from olmax.model.presets import WeightsConfig, describe_differences, differences, resolve_model
from olmax.train.run_log import rewind_jsonl


class Start(NamedTuple):
    state: Any      # the TrainState to train from
    step: int       # the last completed step (0 unless resumed)
    origin: dict    # where the weights came from: {"kind": "fresh" | "checkpoint" | "hf", ...}


def start_state(cfg: RunConfig, ckpt: Checkpointer, abstract_state: Any,
                fresh_state: Callable[[Any], Any], data: Any = None, *,
                metrics_path: str | os.PathLike | None = None) -> Start:
    """The state to train from (see the module docstring).

    ``ckpt``: the run's own checkpoints. ``abstract_state``: a TrainState of
    ``jax.ShapeDtypeStruct`` with the target shardings. ``fresh_state(params)``: a fresh TrainState
    (step 0) around ``params`` (None: fresh params). ``data``: its ``check_fingerprint`` is called
    with a resumed checkpoint's fingerprint. ``metrics_path``: rewound to the start step.
    """
    start = (_resume(cfg, ckpt, abstract_state, data)
             or _warm_start(cfg, abstract_state, fresh_state, ckpt)
             or _from_hf(cfg, abstract_state, fresh_state, ckpt)
             or Start(fresh_state(None), 0, {"kind": "fresh"}))
    if metrics_path is not None and jax.process_index() == 0:
        rewind_jsonl(metrics_path, start.step)
    return start


def _resume(cfg: RunConfig, ckpt: Checkpointer, abstract_state: Any, data: Any) -> Start | None:
    def same_model(meta: dict) -> None:
        diff = _field_difference(meta.get("model", {}), cfg.model)
        if diff:
            where = ckpt.step_dir(meta.get("step", -1))
            raise OlmaxError(f"checkpoint {where} was written for a different model ({diff}); use "
                             f"another --run-dir, or warm-start with init.checkpoint={where}")

    got = ckpt.restore_latest(abstract_state, check_meta=same_model)
    if got is None:
        return None
    step, state, meta = got
    if meta.get("data_position", step) != step:
        raise OlmaxError(f"checkpoint {ckpt.step_dir(step)}: data_position "
                         f"{meta.get('data_position')} != step {step}")
    if data is not None and meta.get("data_fingerprint") is not None:
        data.check_fingerprint(meta["data_fingerprint"])
    if meta.get("seed") not in (None, cfg.seed):
        ckpt.report(f"note: seed {cfg.seed} differs from the checkpoint's {meta['seed']}; the data "
                    "order follows the new seed")
    check_params(state.params, f"checkpoint {ckpt.step_dir(step)}")
    ckpt.report(f"resumed from {ckpt.step_dir(step)} (step {step})")
    return Start(state, step, meta.get("init", {"kind": "fresh"}))


def _warm_start(cfg: RunConfig, abstract_state: Any, fresh_state: Callable[[Any], Any],
                ckpt: Checkpointer) -> Start | None:
    if not cfg.init.checkpoint:
        return None
    where = resolve_step_dir(cfg.init.checkpoint)
    _check_architecture(cfg, read_weights_config(cfg.init), ckpt)
    load_opt = cfg.init.load_optimizer
    if load_opt and not (where / OPT_STATE_ITEM).is_dir():
        raise OlmaxError(f"init.checkpoint {where} has no optimizer state "
                         "(set init.load_optimizer=false to start a fresh optimizer)")
    if not (where / OPT_STATE_ITEM).is_dir():   # parameters only (olmax convert, save_params)
        target = abstract_state.params
        params, _ = load_params(where, dtype=jax.tree.leaves(target)[0].dtype,
                                shardings=jax.tree.map(lambda t: t.sharding, target))
        ckpt.report(f"warm start from {where} (params, fresh optimizer)")
        return Start(fresh_state(params), 0, {"kind": "checkpoint", "path": str(where), "step": None,
                                             "load_optimizer": False})
    ro, step = open_step_dir(where, report=ckpt.report)
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
        state = fresh_state(state.params)
    ckpt.report(f"warm start from {where} (step {step}; "
                f"{'params + optimizer state' if load_opt else 'params, fresh optimizer'})")
    return Start(state, 0, {"kind": "checkpoint", "path": str(where), "step": step,
                            "load_optimizer": load_opt})


def _from_hf(cfg: RunConfig, abstract_state: Any, fresh_state: Callable[[Any], Any],
             ckpt: Checkpointer) -> Start | None:
    hf_dir = cfg.init.hf_dir
    if not hf_dir:
        return None
    params, hf_cfg, _ = load_hf(hf_dir, padded_vocab_size=cfg.model.padded_vocab_size)
    _check_architecture(cfg, WeightsConfig(hf_cfg, "init.hf_dir", f"{hf_dir}/config.json"), ckpt)
    params = jax.tree.map(
        lambda x, t: jax.make_array_from_callback(t.shape, t.sharding,
                                                  lambda idx: x[idx].astype(t.dtype)),
        params, abstract_state.params)
    ckpt.report(f"initialised from HF weights in {hf_dir} (fresh optimizer)")
    return Start(fresh_state(params), 0, {"kind": "hf", "path": str(hf_dir)})


def _check_architecture(cfg: RunConfig, weights: WeightsConfig, ckpt: Checkpointer) -> None:
    """The run's model must be the weights' model, by the rule that resolved the recipe
    (every field of the run's model counts as given)."""
    resolve_model(ModelSpec.of(cfg.model), weights,
                  allow_override=cfg.init.allow_architecture_override)
    overridden = differences(weights.model, cfg.model)
    if overridden:
        said = describe_differences(weights.model, cfg.model, overridden, weights.where, "this run")
        ckpt.report(f"note: {said} (init.allow_architecture_override=true)")


def _field_difference(saved: dict, current: ModelConfig) -> str | None:
    """The model config fields on which a saved config (plain data) and ``current`` differ."""
    now = to_dict(current)
    diffs = [f"{k} {saved.get(k)!r} vs {now.get(k)!r}" for k in sorted(set(saved) | set(now))
             if saved.get(k) != now.get(k)]
    return ", ".join(diffs) or None


def _restart_skip_windows(opt_state: Any) -> Any:
    """Empty the SkipStep rolling windows of a restored optimizer state (Adam moments/count kept)."""
    if not (hasattr(opt_state, "window") and hasattr(opt_state, "_replace")):
        return opt_state
    window = jax.tree.map(jnp.zeros_like, opt_state.window)
    return opt_state._replace(window=window, last_factor=jnp.ones_like(opt_state.last_factor))
