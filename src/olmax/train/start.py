"""Where a run's training state comes from: one function, :func:`start_state`.

In this order:

1. **Resume**: the newest readable checkpoint of the run itself (``RUN_DIR/checkpoints``; corrupt ones
   are reported, moved aside and skipped). It must have been written for the same model, and its
   data fingerprint must match the run's data. The step, data position and LR schedule continue.
2. **Warm start** from ``init.checkpoint`` (an olmax checkpoint, or an OLMo-core one read in place,
   local or a URL): its parameters, plus with ``init.load_optimizer=true`` Adam's moments and step
   count; the trainer step, data position and LR schedule restart at 0 and the new recipe's
   settings apply. The SkipStep rolling loss/grad-norm windows restart empty (they describe the
   previous data mix), as in OLMo-core, which never saves them. A parameters-only checkpoint
   (``olmax convert hf-to-olmax`` writes them) starts a fresh optimizer. With
   ``init.load_trainer_state=true`` (OLMo-core's flag) the checkpoint's run goes on instead: the
   next step is its step + 1, with its data position, seed and schedule (the data position must be
   the step, the seed and the dataset fingerprint the run's).
3. **Hugging Face** weights from ``init.hf_dir``, with a fresh optimizer.
4. **Fresh**: parameters initialised from ``init.seed``.

The trainer runs 2 to 4 (:func:`initial_state`) for a run directory without checkpoints before it
creates the directory, so a start refused there leaves nothing behind; a resume reads the
directory's checkpoints under its lock and writes nothing before one is accepted.

The data's tokenizer is settled before any of this (:func:`run_tokenizer`): the one
``data.tokenizer`` names, else the one ``init.checkpoint`` was trained with (said in a line); a
run that names other token ids than the checkpoint's is refused.

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

import dataclasses
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from olmax.checkpoint.checkpointer import Checkpointer, log_report, open_step_dir
from olmax.checkpoint.format import OPT_STATE_ITEM, resolve_step_dir
from olmax.checkpoint.weights import has_item, load_meta, load_params, stored_array
from olmax.config import TOKEN_ID_FIELDS, ModelConfig, ModelSpec, RunConfig, to_dict
from olmax.data.tokenizer import tokenizer_config
from olmax.errors import OlmaxError
from olmax.interop.architecture import read_weights_config
from olmax.data.fingerprint import mismatch_message, olmo_core_difference
from olmax.interop.hf import load_hf
from olmax.interop.olmo_core.checkpoint import OLMoCoreCheckpoint, TrainerState, is_olmo_core_checkpoint
from olmax.interop.olmo_core.convert import check_count_rule, check_param_groups
from olmax.interop.weights_tokenizer import read_weights_tokenizer, tokenizer_from_section
from olmax.model.finite import check_params
from olmax.model.presets import WeightsConfig, describe_differences, differences, resolve_model
from olmax.train.run_log import rewind_jsonl


Report = Callable[[str], None]
DATA_PATHS = "data_paths.txt"     # OLMo-core's ConfigSaverCallback: the dataset's files, in order


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
             or initial_state(cfg, abstract_state, fresh_state, data, report=ckpt.report))
    if metrics_path is not None and jax.process_index() == 0:
        rewind_jsonl(metrics_path, start.step)
    return start


def initial_state(cfg: RunConfig, abstract_state: Any, fresh_state: Callable[[Any], Any],
                  data: Any = None, *, report: Callable[[str], None] = log_report) -> Start:
    """The start of a run that has no checkpoint of its own: a warm start, HF weights or fresh
    (the module docstring's 2 to 4). It reads nothing of the run directory, so the trainer runs
    it, with every check that can refuse the start, before the run directory is created."""
    return (_warm_start(cfg, abstract_state, fresh_state, report, data)
            or _from_hf(cfg, abstract_state, fresh_state, report)
            or Start(fresh_state(None), 0, {"kind": "fresh"}))


def run_tokenizer(cfg: RunConfig, report: Report = log_report) -> RunConfig:
    """``cfg`` with the tokenizer its data is read with: the one ``data.tokenizer`` names, or,
    where it names none, the one ``init.checkpoint`` was trained on (its ``config.json``, its
    meta), which is reported. A run that names other token ids than the checkpoint's is refused
    in one line naming the fields and both values."""
    stored = read_weights_tokenizer(cfg.init)
    named = cfg.data.tokenizer
    if stored is None:      # nothing recorded: the tokenizer named, else dolma2 (as config.yaml says)
        return cfg if named is not None else \
            dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer="dolma2"))
    theirs = stored.cfg.ids()
    if named is None:
        report(f"data.tokenizer is not set: the tokenizer of init.checkpoint, {_ids_text(theirs)} "
               f"({stored.where})")
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=stored.cfg))
    ours = tokenizer_config(named).ids()
    differ = [k for k in TOKEN_ID_FIELDS if ours[k] != theirs[k]]
    if differ:
        shown_name = named if isinstance(named, str) else "fields"
        raise OlmaxError(
            f"data.tokenizer ({shown_name}) has {_ids_text(ours, differ)}, but init.checkpoint "
            f"was trained with {_ids_text(theirs, differ)} ({stored.where}); leave "
            "data.tokenizer unset to read the data with the checkpoint's ids, or name those")
    return cfg


def _ids_text(ids: dict, only: Any = TOKEN_ID_FIELDS) -> str:
    return ", ".join(f"{k} {'none' if ids[k] is None else ids[k]}" for k in only)


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
                report: Report, data: Any = None) -> Start | None:
    if not cfg.init.checkpoint:
        return None
    if is_olmo_core_checkpoint(cfg.init.checkpoint):
        return _from_olmo_core(cfg, abstract_state, fresh_state, report, data)
    where = resolve_step_dir(cfg.init.checkpoint)
    _check_architecture(cfg, read_weights_config(cfg.init), report)
    load_opt = cfg.init.load_optimizer
    has_opt = has_item(where, OPT_STATE_ITEM)
    if load_opt and not has_opt:
        raise OlmaxError(f"init.checkpoint {where} has no optimizer state "
                         "(set init.load_optimizer=false to start a fresh optimizer)")
    if cfg.init.load_trainer_state and not has_opt:
        raise OlmaxError(f"init.checkpoint {where} holds parameters only: there is no trainer state "
                         "to continue (set init.load_trainer_state=false)")
    if not has_opt:   # parameters only (olmax convert, save_params)
        target = abstract_state.params
        params, _ = load_params(where, dtype=jax.tree.leaves(target)[0].dtype,
                                shardings=jax.tree.map(lambda t: t.sharding, target))
        report(f"warm start from {where} (params, fresh optimizer)")
        return Start(fresh_state(params), 0, {"kind": "checkpoint", "path": str(where), "step": None,
                                             "load_optimizer": False})
    if cfg.init.load_trainer_state:
        _check_continued_run(cfg, where, data)
    ro, step = open_step_dir(where, report=report)
    items = ("params", "opt_state") if load_opt else ("params",)
    stored_window = _stored_window(where) if load_opt else None
    target = _with_window(abstract_state, stored_window)
    try:
        state, _ = ro.restore(step, target, items=items)
    except Exception as e:
        raise OlmaxError(f"cannot warm-start from {where}: {' '.join(str(e).split())[:300]}") from None
    ro.close()
    check_params(state.params, f"init.checkpoint {where}")
    if target is not abstract_state:   # windows of another length: restarted, as OLMo-core's
        state = state._replace(opt_state=_restart_skip_windows(state.opt_state,
                                                               abstract_state.opt_state))
        report(f"note: init.checkpoint {where} holds skip windows of {stored_window} entries, "
               f"this run's optim.rolling_interval_length makes "
               f"{abstract_state.opt_state.window.losses.shape[0]}: they restart empty")
    if cfg.init.load_trainer_state:
        return _continue_olmax_run(cfg, state, step, where, load_opt, fresh_state, report)
    if load_opt:
        state = state._replace(opt_state=_restart_skip_windows(state.opt_state),
                               step=jnp.zeros_like(state.step))
    else:
        state = fresh_state(state.params)
    report(f"warm start from {where} (step {step}; "
           f"{'params + optimizer state' if load_opt else 'params, fresh optimizer'})")
    return Start(state, 0, {"kind": "checkpoint", "path": str(where), "step": step,
                            "load_optimizer": load_opt})


def _check_continued_run(cfg: RunConfig, where: Any, data: Any) -> None:
    """``init.load_trainer_state=true`` on an olmax checkpoint: its data position is its step,
    its data is the run's, its seed the run's (checked from its meta, before any array is read)."""
    meta = load_meta(where)
    step = meta.get("step")
    if meta.get("data_position", step) != step:
        raise OlmaxError(f"init.checkpoint {where}: data_position {meta.get('data_position')} != "
                         f"step {step}")
    if data is not None and meta.get("data_fingerprint") is not None:
        data.check_fingerprint(meta["data_fingerprint"])
    _same_seed(cfg, meta.get("seed"), where)


def _continue_olmax_run(cfg: RunConfig, state: Any, step: int, where: Any, load_opt: bool,
                        fresh_state: Callable[[Any], Any], report: Report) -> Start:
    """``init.load_trainer_state=true`` on an olmax checkpoint (checked by
    :func:`_check_continued_run`): its step, data position and schedule go on (as a resume of
    that run would), in this run directory."""
    if not load_opt:
        state = fresh_state(state.params)._replace(step=state.step)
    report(f"continuing the run of {where} from step {step}"
           f"{'' if load_opt else ' (fresh optimizer)'}")
    return Start(state, step, {"kind": "checkpoint", "path": str(where), "step": step,
                               "load_optimizer": load_opt, "load_trainer_state": True})


def _same_seed(cfg: RunConfig, seed: Any, where: Any) -> None:
    """The data order of a continued run is its seed's: the run must have it."""
    if seed is not None and seed != cfg.seed:
        raise OlmaxError(f"init.checkpoint {where}: its run has seed {seed}, this run {cfg.seed}; "
                         f"continuing it (init.load_trainer_state=true) needs seed={seed}")


def _from_olmo_core(cfg: RunConfig, abstract_state: Any, fresh_state: Callable[[Any], Any],
                    report: Report, data: Any) -> Start:
    """An OLMo-core checkpoint, read in place (no conversion): weights, with
    ``init.load_optimizer`` Adam's moments and count, with ``init.load_trainer_state`` its step and
    data position. SkipStep's windows start empty (OLMo-core never saves them)."""
    init = cfg.init
    ck = OLMoCoreCheckpoint(init.checkpoint)
    if ck.model_config() is not None:   # a bare DCP folder has none: the recipe's model, checked
        _check_architecture(cfg, read_weights_config(init), report)
    ck.check_model(cfg.model)
    if init.load_optimizer and not ck.has_optimizer:
        raise OlmaxError(f"init.checkpoint {ck.path} has no optimizer state "
                         "(set init.load_optimizer=false to start a fresh optimizer)")
    trainer = _olmo_core_position(cfg, ck, data) if init.load_trainer_state else None
    params = _placed(ck.tree(cfg.model), abstract_state.params)
    check_params(params, f"init.checkpoint {ck.path}")
    state = fresh_state(params)
    if init.load_optimizer:
        check_param_groups(ck, cfg.model, cfg.optim)
        if trainer is not None:
            check_count_rule(ck, cfg.optim)
        state = state._replace(opt_state=_olmo_core_adam(ck, cfg, state.opt_state,
                                                         abstract_state.opt_state))
    step = trainer.global_step if trainer is not None else 0
    if trainer is not None:
        state = state._replace(step=jax.device_put(np.asarray(step, np.int32),
                                                   abstract_state.step.sharding))
    what = "params + optimizer state" if init.load_optimizer else "params, fresh optimizer"
    report(f"{'continuing' if trainer else 'warm start from'} OLMo-core checkpoint {ck.path} "
           f"({what}{f'; from step {step}' if trainer else ''})")
    return Start(state, step, {"kind": "olmo-core", "path": ck.path, "load_optimizer":
                               init.load_optimizer, "load_trainer_state": init.load_trainer_state})


def _olmo_core_position(cfg: RunConfig, ck: OLMoCoreCheckpoint, data: Any) -> TrainerState:
    """The OLMo-core trainer state a continued run starts from, checked against this run: the data
    position is the step, the seed and the dataset fingerprint are the run's."""
    trainer = ck.trainer_state()
    if trainer is None:
        raise OlmaxError(f"init.checkpoint {ck.path} has no trainer state (train/rank0.pt); set "
                         "init.load_trainer_state=false for a warm start")
    t = cfg.train
    if trainer.data_loader.get("epoch", trainer.epoch) != 1:
        raise OlmaxError(f"init.checkpoint {ck.path}: its data loader is in epoch "
                         f"{trainer.epoch}; olmax continues OLMo-core runs in their first epoch")
    length = trainer.data_loader.get("sequence_length")
    if length is not None and length != t.seq_len:
        raise OlmaxError(f"init.checkpoint {ck.path}: its data loader's sequence_length is "
                         f"{length}, this run's train.seq_len {t.seq_len}; continuing it needs "
                         f"train.seq_len={length}")
    position = trainer.data_position(t.global_batch_size * t.seq_len)
    if position != trainer.global_step:
        raise OlmaxError(f"init.checkpoint {ck.path}: {trainer.data_loader.get('tokens_processed')} "
                         f"tokens processed make {position} batches of {t.global_batch_size}x"
                         f"{t.seq_len}, not its step {trainer.global_step}")
    _same_seed(cfg, trainer.seed, ck.path)
    if data is not None and trainer.fingerprint:
        current = getattr(data, "fingerprint", None) or {}
        if current.get("olmo_core_sha256") != trainer.fingerprint \
                and not cfg.data.ignore_fingerprint_mismatch:
            why = olmo_core_difference(
                trainer.fingerprint, current, tokenizer=_config_ids(ck),
                paths=_data_paths(ck),
                max_target_seq_len=trainer.data_loader.get("max_target_sequence_length", "unknown"))
            raise OlmaxError(f"init.checkpoint {ck.path}: {mismatch_message(*why)}")
    return trainer


def _config_ids(ck: OLMoCoreCheckpoint) -> dict | None:
    """The tokenizer ids of the checkpoint's ``config.json`` (None where it names none)."""
    tok = tokenizer_from_section(((ck.config() or {}).get("dataset") or {}).get("tokenizer"),
                                 ck.files.path("config.json"))
    return None if tok is None else tok.ids()


def _data_paths(ck: OLMoCoreCheckpoint) -> list[str] | None:
    """The files of the checkpoint's dataset, in order, from its ``data_paths.txt`` (OLMo-core's
    ``ConfigSaverCallback`` writes it), or None."""
    if not ck.files.exists(DATA_PATHS):
        return None
    text = ck.files.read_all(DATA_PATHS).decode("utf-8", errors="replace")
    return [line.strip() for line in text.splitlines() if line.strip()]


def _placed(tree: Any, abstract: Any) -> Any:
    """A tree of OLMo-core lazy leaves as arrays with the abstract tree's shardings and dtypes."""
    return jax.tree.map(
        lambda leaf, t: jax.make_array_from_callback(
            t.shape, t.sharding, lambda idx: leaf.read(idx).astype(t.dtype)),
        tree, abstract, is_leaf=lambda x: hasattr(x, "tensors"))


def _olmo_core_adam(ck: OLMoCoreCheckpoint, cfg: RunConfig, opt_state: Any, abstract: Any) -> Any:
    """``opt_state`` (fresh) with OLMo-core's moments and count; skip windows empty."""
    adam = opt_state.inner[0]
    count = jax.device_put(np.asarray(ck.adam_count(cfg.model), adam.count.dtype),
                           abstract.inner[0].count.sharding)
    adam = adam._replace(count=count, mu=_placed(ck.tree(cfg.model, "exp_avg"), abstract.inner[0].mu),
                         nu=_placed(ck.tree(cfg.model, "exp_avg_sq"), abstract.inner[0].nu))
    return opt_state._replace(inner=(adam,) + tuple(opt_state.inner[1:]))


def _from_hf(cfg: RunConfig, abstract_state: Any, fresh_state: Callable[[Any], Any],
             report: Report) -> Start | None:
    hf_dir = cfg.init.hf_dir
    if not hf_dir:
        return None
    params, hf_cfg, _ = load_hf(hf_dir, padded_vocab_size=cfg.model.padded_vocab_size)
    _check_architecture(cfg, WeightsConfig(hf_cfg, "init.hf_dir", f"{hf_dir}/config.json"), report)
    params = jax.tree.map(
        lambda x, t: jax.make_array_from_callback(t.shape, t.sharding,
                                                  lambda idx: x[idx].astype(t.dtype)),
        params, abstract_state.params)
    report(f"initialised from HF weights in {hf_dir} (fresh optimizer)")
    return Start(fresh_state(params), 0, {"kind": "hf", "path": str(hf_dir)})


def _check_architecture(cfg: RunConfig, weights: WeightsConfig, report: Report) -> None:
    """The run's model must be the weights' model, by the rule that resolved the recipe
    (every field of the run's model counts as given)."""
    resolve_model(ModelSpec.of(cfg.model), weights,
                  allow_override=cfg.init.allow_architecture_override)
    overridden = differences(weights.model, cfg.model)
    if overridden:
        said = describe_differences(weights.model, cfg.model, overridden, weights.where, "this run")
        report(f"note: {said} (init.allow_architecture_override=true)")


def _field_difference(saved: dict, current: ModelConfig) -> str | None:
    """The model config fields on which a saved config (plain data) and ``current`` differ."""
    now = to_dict(current)
    diffs = [f"{k} {saved.get(k)!r} vs {now.get(k)!r}" for k in sorted(set(saved) | set(now))
             if saved.get(k) != now.get(k)]
    return ", ".join(diffs) or None


def _restart_skip_windows(opt_state: Any, like: Any = None) -> Any:
    """Empty the SkipStep rolling windows of a restored optimizer state (Adam moments/count kept);
    ``like``: an abstract optimizer state whose windows (their length, their sharding) to make."""
    if not (hasattr(opt_state, "window") and hasattr(opt_state, "_replace")):
        return opt_state
    if like is None:
        window = jax.tree.map(jnp.zeros_like, opt_state.window)
    else:
        window = jax.tree.map(lambda t: jax.device_put(np.zeros(t.shape, t.dtype), t.sharding),
                              like.window)
    return opt_state._replace(window=window, last_factor=jnp.ones_like(opt_state.last_factor))


def _stored_window(where: Any) -> int | None:
    """The length of the SkipStep windows a step dir's optimizer state holds (None: none)."""
    try:
        return int(stored_array(where, OPT_STATE_ITEM, "window.losses").shape[0])
    except OlmaxError:
        return None


def _with_window(abstract_state: Any, length: int | None) -> Any:
    """``abstract_state`` with skip windows of ``length`` entries (the stored ones, to restore
    them); itself where the lengths agree or nothing is known."""
    opt = abstract_state.opt_state
    if length is None or not hasattr(opt, "window") or opt.window.losses.shape[0] == length:
        return abstract_state
    window = opt.window._replace(**{
        name: jax.ShapeDtypeStruct((length,), leaf.dtype, sharding=leaf.sharding)
        for name, leaf in (("losses", opt.window.losses), ("grad_norms", opt.window.grad_norms))})
    return abstract_state._replace(opt_state=opt._replace(window=window))
