"""OLMo-core checkpoints <-> olmax checkpoints.

``olmo-core-to-olmax``: weights (every one of the padded vocabulary's rows; fp32), with Adam's
moments in olmax's layout (the weights' transforms) and OLMo-core's per-parameter ``step`` as
olmax's Adam count; ``param_groups`` checked against the optimizer settings the caller gives;
meta with the trainer's step, data position, seed, epoch and dataset fingerprint, and the model
from ``config.json``. The output is a ``checkpoints/``-style folder holding one step directory,
``<global step>/`` (``params``, ``opt_state``, ``meta``), which ``init.checkpoint`` and every
other command read; ``weights_only`` writes a parameters-only step directory.

``olmax-to-olmo-core``: the layout OLMo-core 3.0's own checkpointer writes, key for key:
``model_and_optim/`` (DCP: the model's keys and the optimizer state flattened, in its order, with
its ``planner_data`` and storage metadata, so that its ``load_keys``, its merge script, its HF
conversion and its Trainer read it; one chunk per tensor: OLMo-core reshards on load),
``train/rank0.pt`` (the trainer's state, with the dataset fingerprint OLMo-core computes for the
run's files and token ids), ``.metadata.json``, ``config.json`` (the one the checkpoint was
imported with, its model section checked; else the model section OLMo-core's ``TransformerConfig``
writes and the run's tokenizer as its ``TokenizerConfig``) and ``data_paths.txt`` (the run's
files). ``weights_only``: a bare DCP folder of ``model.*`` keys.

Both directions read and write one tensor at a time. :func:`merge_source` opens an OLMo-core
checkpoint as an input of ``olmax merge`` (:mod:`olmax.checkpoint.merge`).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np

from olmax.checkpoint.format import OPT_STATE_ITEM, resolve_step_dir
from olmax.checkpoint.merge import ADAM, Adam, Source
from olmax.checkpoint.weights import (StreamedArray, has_item, load_meta, save_params, save_train_state,
                                     stored_array, stored_arrays)
from olmax.config import ModelConfig, OptimConfig, from_dict, to_dict
from olmax.errors import OlmaxError
from olmax.interop import vocab_padding
from olmax.interop.olmo_core.checkpoint import (MODEL_AND_OPTIM, PIECE_BYTES, OLMoCoreCheckpoint,
                                                TrainerState,
                                                model_config_from_olmo_core)
from olmax.interop.olmo_core.dcp import write_dcp
from olmax.interop.olmo_core.torch_zip import PiecedArray, write_torch_save
from olmax.io import atomic_output_dir, check_output_dir
from olmax.model.params import OLMoCoreTensor, olmo_core_tensors

META_KEY = "olmo_core"
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "initial_lr")
# The version of OLMo-core's NumpyDatasetBase.fingerprint, which olmax's olmo_core_sha256 computes
# (a different version makes OLMo-core skip the fingerprint check with a warning).
OC_FINGERPRINT_VERSION = "v2.0"
OC_VERSION = "3.0.0"          # the ai2-olmo-core release whose layout the export is
DATA_PATHS = "data_paths.txt"


# ----------------------------------------------------------------------------------------------
# OLMo-core -> olmax


def streamed(tree: dict) -> dict:
    """A tree of :class:`~olmax.interop.olmo_core.checkpoint.LazyLeaf` as StreamedArray leaves."""
    return jax.tree.map(lambda leaf: StreamedArray(leaf.shape, leaf.dtype, leaf.read,
                                                   stacked=leaf.stacked),
                        tree, is_leaf=lambda x: hasattr(x, "tensors"))


def check_param_groups(ck: OLMoCoreCheckpoint, cfg: ModelConfig, optim: OptimConfig) -> None:
    """Betas, eps and weight decay of every parameter's group are the optimizer's (OLMo-core
    would keep the checkpoint's on load; olmax applies its own, so a difference is refused)."""
    no_decay = {t.name for t in olmo_core_tensors(cfg) if t.path[-1] in optim.no_decay}
    for name, group in ck.param_groups(cfg).items():
        want = {"betas": tuple(optim.betas), "eps": optim.eps,
                "weight_decay": 0.0 if name in no_decay else optim.weight_decay}
        for key, value in want.items():
            got = group.get(key)
            if got is None:
                raise OlmaxError(f"{ck.path}: no optimizer setting {key} for '{name}'")
            try:
                got = tuple(float(x) for x in got) if key == "betas" else float(got)
            except (TypeError, ValueError):
                raise OlmaxError(f"{ck.path}: optimizer setting {key} of '{name}' is {got!r}, "
                                 f"not {'two numbers' if key == 'betas' else 'a number'}") from None
            if got != value:
                raise OlmaxError(f"{ck.path}: '{name}' was trained with {key} {got}, the recipe "
                                 f"says {value} (optim.{'no_decay' if key == 'weight_decay' else key})")


def check_count_rule(ck: OLMoCoreCheckpoint, optim: OptimConfig) -> None:
    """A run continued from ``ck`` advances Adam's count as the checkpoint's run did (its
    ``config.json``'s ``step_increment_bugfix``, where recorded)."""
    theirs = ck.step_increment_bugfix()
    if theirs is not None and theirs != optim.step_increment_bugfix:
        raise OlmaxError(f"{ck.path}: its run had step_increment_bugfix {str(theirs).lower()}, the "
                         f"recipe says {str(optim.step_increment_bugfix).lower()}; continuing it "
                         f"needs optim.step_increment_bugfix={str(theirs).lower()}")


def source_meta(ck: OLMoCoreCheckpoint, trainer: TrainerState | None) -> dict:
    """What an imported checkpoint's meta records of its OLMo-core origin."""
    info: dict[str, Any] = {"path": ck.path, "version": ck.version(),
                            "checkpoint_id": ck.dcp.meta.checkpoint_id, "config": ck.config()}
    if trainer is not None:
        info.update(global_step=trainer.global_step, tokens_seen=trainer.tokens_seen,
                    epoch=trainer.epoch, data_loader=trainer.data_loader,
                    max_steps=trainer.max_steps, world_size=trainer.world_size)
    return info


def convert_olmo_core_to_olmax(src: str | os.PathLike, out: str | os.PathLike, *,
                               weights_only: bool = False, optim: OptimConfig | None = None,
                               model: ModelConfig | None = None,
                               optimizer: Callable[[OptimConfig], Any] | None = None) -> Path:
    """OLMo-core checkpoint ``src`` -> olmax checkpoint at ``out`` (see the module docstring).
    ``model``: the recipe's model, which must be ``config.json``'s (or stands for it where the
    checkpoint has none). ``optimizer``: olmax's optimizer of an ``optim`` section
    (:func:`olmax.train.optim.skip_step_adamw`, which the training layer above passes in), whose
    state the moments fill; needed unless ``weights_only``."""
    check_output_dir(out)
    ck = OLMoCoreCheckpoint(src)
    cfg = checked_model(ck, model)
    trainer = ck.trainer_state()
    meta = import_meta(ck, cfg, trainer)
    params = streamed(ck.tree(cfg))
    if weights_only:
        return save_params(out, params, cfg, extra_meta=meta)
    if not ck.has_optimizer:
        raise OlmaxError(f"{ck.path}: the checkpoint holds no optimizer state (use --weights-only)")
    if optimizer is None:
        raise ValueError("converting the optimizer state needs olmax's optimizer (optimizer=...)")
    optim = optim or OptimConfig()
    check_param_groups(ck, cfg, optim)
    if trainer is not None:
        check_count_rule(ck, optim)
    count = ck.adam_count(cfg)
    opt_state = olmax_opt_state(optimizer(optim), streamed(ck.tree(cfg, "exp_avg")),
                                streamed(ck.tree(cfg, "exp_avg_sq")), count)
    step = trainer_meta(ck, trainer, meta)
    meta["optim"] = to_dict(optim)
    return save_train_state(out, step, params, opt_state, cfg, extra_meta=meta)


def trainer_meta(ck: OLMoCoreCheckpoint, trainer: TrainerState | None, meta: dict) -> int:
    """The step of an import of ``ck`` and what its meta says of the run (into ``meta``): from its
    trainer state, the step, data position and seed; without one, step 0 and ``warm_start_only``
    (what cannot be known), which ``init.load_trainer_state`` refuses."""
    if trainer is None:
        meta.update(seed=None, warm_start_only=ck.no_trainer_state())
        return 0
    meta.update(seed=trainer.seed, olmo_core_data_position=dict(trainer.data_loader))
    if isinstance(trainer.data_loader.get("batches_processed"), int):
        meta["data_position"] = trainer.data_loader["batches_processed"]
    return trainer.global_step


def import_meta(ck: OLMoCoreCheckpoint, cfg: ModelConfig, trainer: TrainerState | None) -> dict:
    """The meta of an olmax checkpoint made from ``ck`` (before the optimizer's entries)."""
    return {"source": {"kind": "olmo-core", "path": ck.path},
            META_KEY: source_meta(ck, trainer),
            vocab_padding.META_KEY: vocab_padding.record(cfg, in_softmax=True,
                                                         init=vocab_padding.TRAINED)}


def merge_source(src: str | os.PathLike, *, with_optimizer: bool = True,
                 optim: OptimConfig | None = None) -> Source:
    """An OLMo-core checkpoint as an input of :func:`olmax.checkpoint.merge.merge`: its weights
    and (``with_optimizer``, where it has them) Adam's moments and count, read a block at a time;
    the meta and step an import of it gets (:func:`convert_olmo_core_to_olmax`). Its optimizer
    settings must be ``optim``'s (default: olmax's, OLMo 3's), as for an import."""
    ck = OLMoCoreCheckpoint(src)
    cfg = checked_model(ck, None)
    trainer = ck.trainer_state()
    optim = optim or OptimConfig()
    meta = import_meta(ck, cfg, trainer)
    adam = None
    if with_optimizer and ck.has_optimizer:
        check_param_groups(ck, cfg, optim)
        adam = Adam(ck.adam_count(cfg), ck.tree(cfg, "exp_avg"), ck.tree(cfg, "exp_avg_sq"))
    step = trainer_meta(ck, trainer, meta)
    meta["optim"] = to_dict(optim)
    return Source(ck.path, cfg, ck.tree(cfg), adam, meta, step, optim)


def checked_model(ck: OLMoCoreCheckpoint, model: ModelConfig | None) -> ModelConfig:
    """The checkpoint's model (``config.json``), which ``model`` (a recipe's) may not contradict;
    its tensors checked against it."""
    from olmax.model.presets import ModelSpec, WeightsConfig, resolve_model

    stored = ck.model_config()
    if stored is None and model is None:
        raise OlmaxError(f"{ck.path}: no config.json; the model cannot be known")
    cfg = stored or model
    if stored is not None and model is not None:
        weights = WeightsConfig(stored, "init.checkpoint", ck.files.path("config.json"))
        cfg = resolve_model(ModelSpec.of(model), weights)
    ck.check_model(cfg)
    return cfg


def olmax_opt_state(tx: Any, mu: Any, nu: Any, count: int) -> Any:
    """The state olmax's SkipStep AdamW ``tx`` keeps, with the given moments and count, and empty
    skip windows (OLMo-core never saves them)."""
    shapes = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, np.float32), mu)
    template = jax.eval_shape(tx.init, shapes)
    adam = template.inner[0]
    adam = adam._replace(count=np.asarray(count, np.int32), mu=mu, nu=nu)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template)
    return zeros._replace(inner=(adam,) + tuple(zeros.inner[1:]),
                          last_factor=np.ones((), np.float32))


# ----------------------------------------------------------------------------------------------
# olmax -> OLMo-core


def _olmax_arrays(step_dir: Path, with_optimizer: bool) -> tuple[Any, Any]:
    """The params of an olmax step dir and (``with_optimizer``) Adam's ``(count, mu, nu)``, as
    stored arrays read slice by slice (a layer of a tensor at a time)."""
    params, _ = stored_arrays(step_dir)
    if not with_optimizer:
        return params, None
    mu, _ = stored_arrays(step_dir, OPT_STATE_ITEM, ADAM + "mu.")
    nu, _ = stored_arrays(step_dir, OPT_STATE_ITEM, ADAM + "nu.")
    count = stored_array(step_dir, OPT_STATE_ITEM, ADAM + "count")[()]
    return params, (int(count), mu, nu)


def run_optim(meta: dict) -> OptimConfig:
    """The optimizer a checkpoint was written with: its run's, else the one an import recorded."""
    saved = (meta.get("config") or {}).get("optim") or meta.get("optim") or {}
    return from_dict(OptimConfig, saved, "meta.optim")


def _oc_value(tree: Any, t: OLMoCoreTensor) -> np.ndarray | PiecedArray:
    """OLMo-core tensor ``t`` out of an olmax tree of arrays or stored arrays: a layer's tensor
    read whole; an unstacked leaf (the embedding, the LM head) in pieces of rows as it is written."""
    node = tree
    for part in t.path:
        node = node[part]
    if t.layer is not None:
        a = np.asarray(node[t.layer], np.float32)
        return np.ascontiguousarray(a.T) if t.transposed else np.ascontiguousarray(a)
    rows = t.shape[0]
    step = max(1, PIECE_BYTES // max(4 * int(np.prod(t.shape[1:], dtype=np.int64)), 1))

    def pieces() -> Iterator[np.ndarray]:
        for a in range(0, rows, step):
            b = min(a + step, rows)
            block = node[:, a:b] if t.transposed else node[a:b]
            block = np.asarray(block, np.float32)
            yield block.T if t.transposed else block

    return PiecedArray(t.shape, np.float32, pieces)


# The tensors of a block in the order OLMo-core's modules register them (its state dicts' order)
BLOCK_ORDER = ("attention.w_q.weight", "attention.w_k.weight", "attention.w_v.weight",
               "attention.w_out.weight", "attention.q_norm.weight", "attention.k_norm.weight",
               "attention_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
               "feed_forward.w3.weight", "feed_forward_norm.weight")


def module_order(tensors: list[OLMoCoreTensor]) -> list[OLMoCoreTensor]:
    """``tensors`` in OLMo-core's model order: the embedding, the blocks (each in
    :data:`BLOCK_ORDER`), the LM head: the order its checkpointer writes the keys in."""
    def key(t: OLMoCoreTensor) -> tuple:
        head, _, rest = t.name.partition(".")
        if head == "blocks":
            layer, _, name = rest.partition(".")
            within = BLOCK_ORDER.index(name) if name in BLOCK_ORDER else len(BLOCK_ORDER)
            return (1, int(layer), within)
        return (0 if head == "embeddings" else 2, 0, 0)
    return sorted(tensors, key=key)


def _dcp_items(cfg: ModelConfig, params: Any, opt_state: Any, optim: OptimConfig | None,
               lr: float | None) -> Iterator[tuple[str, Any]]:
    """The export's keys with their values, in the order OLMo-core's checkpointer writes them:
    the model, then each parameter's ``step``, ``exp_avg`` and ``exp_avg_sq``, then each one's
    param-group settings."""
    tensors = module_order(olmo_core_tensors(cfg))
    for t in tensors:
        yield f"model.{t.name}", _oc_value(params, t)
    if opt_state is None:
        return
    count, mu, nu = opt_state
    for t in tensors:
        yield f"optim.state.{t.name}.step", np.asarray(float(count), np.float32)
        yield f"optim.state.{t.name}.exp_avg", _oc_value(mu, t)
        yield f"optim.state.{t.name}.exp_avg_sq", _oc_value(nu, t)
    assert optim is not None
    for t in tensors:
        no_decay = t.path[-1] in optim.no_decay
        group = {"lr": float(lr if lr is not None else optim.lr), "betas": tuple(optim.betas),
                 "eps": float(optim.eps), "weight_decay": 0.0 if no_decay else optim.weight_decay,
                 "initial_lr": float(optim.lr)}
        # A group OLMo-core's OptimGroupOverride made (no decay) holds its override first
        order = ("weight_decay",) + tuple(k for k in GROUP_KEYS if k != "weight_decay") \
            if no_decay else GROUP_KEYS
        for key in order:
            yield f"optim.param_groups.{t.name}.{key}", group[key]


def olmo_core_config(cfg: ModelConfig, base: dict | None, dataset: dict | None = None) -> dict:
    """``config.json`` for the export: the imported one (its model checked against ``cfg``), else
    the model section OLMo-core's ``TransformerConfig.as_config_dict()`` writes for ``cfg`` (what
    its ``TransformerConfig.from_dict`` builds the model from: OLMo-core's HF conversion, its
    merge script) and ``dataset`` (default: the tokenizer's vocabulary size alone)."""
    if base is not None:
        got = model_config_from_olmo_core(base, "the imported config.json")
        if got.replace(init_std=cfg.init_std, max_seq_len=cfg.max_seq_len) != cfg:
            raise OlmaxError("the checkpoint's model differs from the config.json it was imported "
                             "with; cannot export that config")
        return copy.deepcopy(base)
    return {"model": transformer_config_dict(cfg),
            "dataset": dataset or {"tokenizer": {"vocab_size": cfg.vocab_size}}}


def _oc(name: str, fields: dict[str, Any]) -> dict[str, Any]:
    """An OLMo-core config object as ``as_config_dict`` writes it: its fields (None left out),
    then its class."""
    return {**{k: v for k, v in fields.items() if v is not None}, "_CLASS_": name}


def _whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def transformer_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """OLMo-core's ``TransformerConfig.as_config_dict()`` for the OLMo 3 model ``cfg``, key for
    key (the attention backend left to OLMo-core's default: flash where it has it, else torch).
    YaRN on the full-attention layers only is OLMo-core's ``with_rope_scaling``: those layers'
    blocks as ``block_overrides``."""
    if cfg.rope_scaling is not None and cfg.rope_scaling.attention_factor is not None:
        raise OlmaxError("model.rope_scaling.attention_factor: OLMo-core's YaRN computes it, a "
                         "config.json cannot set it")
    f32 = "float32"
    norm = _oc("olmo_core.nn.layer_norm.LayerNormConfig",
               {"name": "rms", "eps": cfg.norm_eps, "bias": False, "dtype": f32})
    theta = _whole(cfg.rope_theta)   # an int in OLMo-core's RoPEConfig

    def block(scaling: dict | None) -> dict[str, Any]:
        rope = _oc("olmo_core.nn.rope.RoPEConfig", {
            "name": "default", "theta": theta, "full_precision": True, "no_global_rope": False,
            "scaling": scaling, "partial_rotary_factor": 1.0})
        window = _oc("olmo_core.nn.attention.SlidingWindowAttentionConfig", {
            "pattern": [-1 if w is None else int(w) for w in cfg.window_pattern],
            "force_full_attention_on_first_layer": False,
            "force_full_attention_on_last_layer": cfg.layer_windows()[-1] is None})
        attention = {**_oc("olmo_core.nn.attention.AttentionConfig", {
            "name": "default", "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "bias": False, "rope": rope,
            "qk_norm": None if cfg.qk_norm == "none" else norm, "dtype": f32,
            "sliding_window": window, "use_head_qk_norm": cfg.qk_norm == "head",
            "scalable_softmax": False, "attention_sinks": False}), "type": "attention"}
        feed_forward = _oc("olmo_core.nn.feed_forward.FeedForwardConfig", {
            "hidden_size": cfg.mlp_hidden, "name": "default", "bias": False, "dtype": f32,
            "activation": "silu"})
        return _oc("olmo_core.nn.transformer.config.TransformerBlockConfig", {
            "sequence_mixer": attention, "layer_norm": norm, "feed_forward": feed_forward,
            "name": "reordered_norm" if cfg.block_type == "reordered_norm" else "default"})

    yarn = None
    if cfg.rope_scaling is not None:
        y = cfg.rope_scaling
        yarn = _oc("olmo_core.nn.rope.YaRNRoPEScalingConfig", {   # its betas are ints
            "factor": y.factor, "beta_fast": _whole(y.beta_fast), "beta_slow": _whole(y.beta_slow),
            "old_context_len": y.original_max_position_embeddings})
    scaled_layers = yarn is not None and cfg.rope_scaling.full_attention_only  # type: ignore[union-attr]
    overrides = None
    if scaled_layers:
        overrides = {str(i): block(yarn) for i, w in enumerate(cfg.layer_windows()) if w is None}
    lm_head = _oc("olmo_core.nn.lm_head.LMHeadConfig", {
        "name": "default", "layer_norm": norm, "bias": False, "dtype": f32,
        "loss_implementation": "default"})
    return _oc("olmo_core.nn.transformer.config.TransformerConfig", {
        "d_model": cfg.d_model, "vocab_size": cfg.padded_vocab_size, "n_layers": cfg.n_layers,
        "block": block(None if scaled_layers else yarn), "lm_head": lm_head, "name": "default",
        "dtype": f32, "init_method": "normal", "init_seed": 0, "init_std": cfg.init_std,
        "block_overrides": overrides, "tie_word_embeddings": cfg.tie_embeddings})


def tokenizer_config_dict(tokenizer: dict[str, Any]) -> dict[str, Any]:
    """OLMo-core's ``TokenizerConfig.as_config_dict()`` of a tokenizer's ids and identifier."""
    return _oc("olmo_core.data.tokenizer.TokenizerConfig", {
        k: tokenizer.get(k) for k in ("vocab_size", "eos_token_id", "pad_token_id",
                                      "bos_token_id", "identifier")})


def trainer_state_dict(meta: dict, cfg: ModelConfig) -> dict:
    """OLMo-core's ``Trainer.state_dict()`` for an olmax checkpoint's meta: the step, tokens seen
    and the data loader's position (its fingerprint: the run's own, which is OLMo-core's for the
    same files and token ids, else the imported one's). Where the meta is still at the imported
    trainer state's position (an import, a soup whose first input is one), its token counts are
    kept as they were; at step 0 nothing needs a batch size."""
    step = int(meta.get("step", 0))
    train = (meta.get("config") or {}).get("train") or {}
    imported = meta.get(META_KEY) or {}
    loader = dict(imported.get("data_loader") or {})
    position = int(meta.get("data_position", step))
    tokens = (lambda n: n * _tokens_per_batch(train, imported)) if (step or position) else \
        (lambda n: 0)
    processed = int(loader["tokens_processed"]) if (
        not train and loader.get("batches_processed") == position
        and "tokens_processed" in loader) else tokens(position)
    seen = int(imported["tokens_seen"]) if (
        not train and imported.get("global_step") == step and "tokens_seen" in imported) \
        else tokens(step)
    fingerprint = (meta.get("data_fingerprint") or {}).get("olmo_core_sha256") \
        or loader.get("dataset_fingerprint")
    loader.update({"dataset_fingerprint_version": loader.get("dataset_fingerprint_version",
                                                             OC_FINGERPRINT_VERSION),
                   "dataset_fingerprint": fingerprint or "",
                   "batches_processed": position,
                   "tokens_processed": processed,
                   "seed": int(meta.get("seed") or loader.get("seed") or 0),
                   "epoch": int(loader.get("epoch", 1)), "dataset_type": "fsl",
                   "sequence_length": int(train.get("seq_len", loader.get("sequence_length", 0))),
                   "max_target_sequence_length": _max_target(meta, loader)})
    return {"global_step": step, "global_train_tokens_seen": seen,
            "global_train_petaflops": 0.0,
            "max_steps": train.get("max_steps", imported.get("max_steps")),
            "data_loader": loader, "epoch": loader["epoch"], "world_size": 1,
            "rng": _NO_RNG, "callbacks": {}}


# RNG states no library version matches: OLMo-core restores none of them (a warning; OLMo 3 has
# no dropout, so nothing depends on them).
_NO_RNG = {lib: {"version": (0, 0), "state": None} for lib in ("python", "numpy", "torch")}


def _max_target(meta: dict, loader: dict) -> int | None:
    """OLMo-core's ``max_target_sequence_length`` (its loader refuses any other): the run's
    ``data.max_target_seq_len``, else the imported trainer state's."""
    if meta.get("config"):
        return ((meta["config"].get("data") or {}).get("max_target_seq_len"))
    return loader.get("max_target_sequence_length")


def _tokens_per_batch(train: dict, imported: dict) -> int:
    """Tokens of one global batch: the run's, else the imported trainer state's."""
    if train.get("global_batch_size") and train.get("seq_len"):
        return int(train["global_batch_size"]) * int(train["seq_len"])
    loader = imported.get("data_loader") or {}
    if loader.get("batches_processed"):
        return int(loader["tokens_processed"]) // int(loader["batches_processed"])
    if imported.get("global_step"):
        return int(imported["tokens_seen"]) // int(imported["global_step"])
    raise OlmaxError("the checkpoint does not say how many tokens a batch holds (no run config, "
                     "no OLMo-core trainer state)")


def convert_olmax_to_olmo_core(ckpt: str | os.PathLike, out: str | os.PathLike, *,
                               weights_only: bool = False) -> Path:
    """olmax checkpoint -> OLMo-core checkpoint folder (see the module docstring)."""
    check_output_dir(out)
    step_dir = resolve_step_dir(ckpt)
    meta = load_meta(step_dir)
    cfg = from_dict(ModelConfig, meta["model"], "meta.model")
    has_opt = has_item(step_dir, OPT_STATE_ITEM)
    if not weights_only and not has_opt:
        raise OlmaxError(f"{step_dir}: no optimizer state (a parameters-only checkpoint); use "
                         "--weights-only")
    base = (meta.get(META_KEY) or {}).get("config")
    config = olmo_core_config(cfg, base, _dataset_section(meta, cfg))
    params, opt_state = _olmax_arrays(step_dir, not weights_only)
    optim = None if weights_only else run_optim(meta)
    if optim is not None:   # how the run counted Adam's steps, as OLMo-core's config records it
        section = config.setdefault("train_module", {}).setdefault("optim", {})
        section["step_increment_bugfix"] = optim.step_increment_bugfix
    items = _dcp_items(cfg, params, opt_state, optim, meta.get("lr"))
    with atomic_output_dir(out) as tmp:
        if weights_only:
            write_dcp(tmp, items, checkpoint_id=str(out))
            return Path(out)
        (tmp / MODEL_AND_OPTIM).mkdir()
        write_dcp(tmp / MODEL_AND_OPTIM, items, checkpoint_id=f"{out}/{MODEL_AND_OPTIM}")
        (tmp / "train").mkdir()
        with open(tmp / "train" / "rank0.pt", "wb") as f:
            write_torch_save(f, trainer_state_dict(meta, cfg))
        (tmp / ".metadata.json").write_text(json.dumps({"ephemeral": False,
                                                         "version": OC_VERSION}))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        files = (meta.get("data_fingerprint") or {}).get("files")
        if files:     # OLMo-core's ConfigSaverCallback: the dataset's files, in order
            (tmp / DATA_PATHS).write_text("\n".join(str(f["path"]) for f in files))
    return Path(out)


def read_weights(src: str | os.PathLike) -> tuple[dict, ModelConfig, dict]:
    """An OLMo-core checkpoint's weights read in place for use (``olmax eval``, ``olmax
    parity``): ``(params as numpy, its model, the meta an import of it gets)``, every tensor
    checked (CRC-32s, NaN/Inf) as it is read."""
    ck = OLMoCoreCheckpoint(src)
    cfg = checked_model(ck, None)
    params = jax.tree.map(lambda leaf: leaf.read(), ck.tree(cfg),
                          is_leaf=lambda x: hasattr(x, "tensors"))
    return params, cfg, import_meta(ck, cfg, None)


def _dataset_section(meta: dict, cfg: ModelConfig) -> dict:
    """``config.json``'s ``dataset`` for an olmax run's checkpoint: its tokenizer as OLMo-core's
    ``TokenizerConfig`` (the ids its data was read with) and its sequence length. A tokenizer
    whose vocabulary is not the model's (a toy model under dolma2's ids) has no OLMo-core
    config, whose ``vocab_size`` is the model's too: the model's vocabulary alone, then."""
    tokenizer = (meta.get("data_fingerprint") or {}).get("tokenizer") or {}
    fits = tokenizer.get("vocab_size") == cfg.vocab_size
    dataset: dict[str, Any] = {"tokenizer": tokenizer_config_dict(tokenizer) if fits
                               else {"vocab_size": cfg.vocab_size}}
    data = (meta.get("config") or {}).get("data") or {}
    seq_len = ((meta.get("config") or {}).get("train") or {}).get("seq_len")
    if seq_len:
        dataset["sequence_length"] = int(seq_len)
    if data.get("max_target_seq_len"):
        dataset["max_target_sequence_length"] = int(data["max_target_seq_len"])
    return dataset


__all__ = ["convert_olmo_core_to_olmax", "read_weights", "convert_olmax_to_olmo_core", "olmax_opt_state",
           "check_param_groups", "merge_source", "META_KEY"]
