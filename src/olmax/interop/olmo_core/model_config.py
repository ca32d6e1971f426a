"""OLMo-core's model config (``config.json``) as an olmax ModelConfig: every field read, none guessed.

An OLMo-core checkpoint's ``config.json`` holds the experiment's ``model`` section, OLMo-core
3.0's ``TransformerConfig`` and the configs it nests (blocks, attention, RoPE and its scaling, layer
norms, feed-forward, LM head, sliding windows). Each of their fields is, here, one of:

- **mapped**: it becomes a :class:`~olmax.config.ModelConfig` field, computed as OLMo-core computes
  it (its defaults included: a ``bias`` left out is OLMo-core's ``True``, a norm's ``eps`` left
  out its ``1e-5``, ``force_full_attention_on_first_layer`` left out its ``True``);
- **inert**: it changes nothing olmax computes from the weights (a parameter's storage dtype, the
  attention or loss kernel, the initialisation of weights that are read, activation recompute);
- **refused** at any other value than the one olmax computes, naming the field, its value and what
  olmax supports: another activation, norm kind, block, attention or RoPE variant, biases, MoE, ...

A field OLMo-core 3.0 does not have is refused as well, unless it is null or false (a feature
left off). ``docs/olmo-core-import.md`` lists every field and its fate.

Layers are resolved as OLMo-core resolves them: ``block`` with ``block_overrides``, or named blocks
cycled by ``block_pattern``; each layer's attention window is its block's
``SlidingWindowAttentionConfig`` at that layer (forced full layers and the shift of the pattern
when the first layer is forced included), and the window pattern is the shortest period of the
per-layer list. Every layer must be the same block but for its window and its RoPE scaling, and
the scaling must be on every layer or on exactly the full-attention ones (OLMo 3's long-context
stage, as ``TransformerConfig.with_rope_scaling`` writes it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, NoReturn

from olmax.config import ModelConfig, YarnConfig, shown
from olmax.errors import ConfigError, OlmaxError
from olmax.interop.hf_config import json_number, minimal_period, whole_number

# The fields of OLMo-core 3.0's configs, by class.
TRANSFORMER = ("d_model", "vocab_size", "n_layers", "block", "lm_head", "embedding_norm", "name",
               "dtype", "init_method", "init_seed", "init_std", "embedding_init_std",
               "freeze_params", "block_pattern", "block_overrides", "embed_scale",
               "tie_word_embeddings")
BLOCK = ("sequence_mixer", "attention", "layer_norm", "feed_forward", "feed_forward_moe", "name",
         "dropout", "attention_residual_alpha", "feed_forward_residual_alpha")
ATTENTION = ("type", "name", "n_heads", "n_kv_heads", "head_dim", "bias", "gate", "rope",
             "clip_qkv", "qk_norm", "dropout", "use_flash", "backend", "dtype", "sliding_window",
             "use_head_qk_norm", "scalable_softmax", "qk_norm_per_head_gains", "attention_sinks",
             "mxfp8_projections", "mxfp8_qkv_projection", "mxfp8_out_projection",
             "use_recompute_qkv_prep", "mxfp8_save_qkv_for_backward")
ROPE = ("name", "theta", "full_precision", "no_global_rope", "scaling", "partial_rotary_factor")
YARN = ("factor", "beta_fast", "beta_slow", "old_context_len", "attention_rescale_factor")
LAYER_NORM = ("name", "eps", "elementwise_affine", "bias", "full_precision", "dtype")
FEED_FORWARD = ("hidden_size", "name", "bias", "dtype", "activation")
LM_HEAD = ("name", "layer_norm", "bias", "dtype", "loss_implementation")
SLIDING_WINDOW = ("pattern", "force_full_attention_on_first_layer",
                  "force_full_attention_on_last_layer")
# RMSNorm and the kernels OLMo-core computes it with (flash-attn's triton, quack's CuTe).
RMS_NAMES = ("rms", "fused_rms", "cute_rms")
OFF = (None, False)     # how a feature left off reads


class _Reader:
    """Reads one ``config.json``; every error is one line starting with its path."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, message: str) -> NoReturn:
        raise OlmaxError(f"{self.where}: {message}")

    def obj(self, parent: dict, key: str, path: str, required: bool = True) -> dict | None:
        value = parent.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, dict):
            what = "missing" if value is None else f"{shown(value)}, not an object"
            self.fail(f"{path}{key} is {what}")
        return value

    def fields(self, d: dict, path: str, cls: str, known: Iterable[str]) -> None:
        """``d`` is a ``cls`` (its ``_CLASS_``, when given) with no field OLMo-core 3.0's ``cls``
        lacks, unless that field is off (null or false)."""
        named = d.get("_CLASS_")
        if named is not None and str(named).rsplit(".", 1)[-1] != cls:
            self.fail(f"{path or 'model'} is {named}, not OLMo-core's {cls}: olmax reads {cls}")
        for key, value in d.items():
            if key != "_CLASS_" and key not in known and value not in OFF:
                self.fail(f"{path}{key} is {shown(value)}: OLMo-core 3.0's {cls} has no field "
                          f"{key!r}, so olmax cannot know what it computes")

    def choice(self, d: dict, key: str, path: str, default: Any, allowed: Iterable[Any],
               why: str) -> Any:
        value = d.get(key, default)
        value = default if value is None else value
        allowed = tuple(allowed)
        if isinstance(value, bool) or value not in allowed:
            self.fail(f"{path}{key} is {shown(value)}: {why} (olmax reads "
                      f"{' or '.join(map(repr, allowed))})")
        return value

    def off(self, d: dict, key: str, path: str, why: str, also: tuple = ()) -> None:
        """``key`` is off (absent, null, false, or one of ``also``)."""
        value = d.get(key)
        if value not in OFF and not any(value == a and not isinstance(value, bool) for a in also):
            self.fail(f"{path}{key} is {shown(value)}: {why}")

    def flag(self, d: dict, key: str, path: str, default: bool) -> bool:
        value = d.get(key, default)
        if value is None:
            return False           # OLMo-core reads a null flag as false
        if not isinstance(value, bool):
            self.fail(f"{path}{key} must be true or false (got {shown(value)})")
        return value

    def whole(self, d: dict, key: str, path: str, default: Any = None) -> int:
        value = d.get(key)
        if value is None:
            if default is None:
                self.fail(f"{path}{key} is missing")
            return default
        return whole_number(value, f"{path}{key}", self.where)

    def number(self, d: dict, key: str, path: str, default: float) -> float:
        value = d.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(f"{path}{key} must be a finite number (got {shown(value)})")
        return float(value)

    def bias(self, d: dict, path: str) -> None:
        """OLMo-core's modules have biases unless ``bias`` is false (null is its default: true)."""
        if d.get("bias") is not False:
            value = d.get("bias")
            read = " (OLMo-core's default: biases)" if value is None else ""
            self.fail(f"{path}bias is {shown(value)}{read}: olmax's layers have no biases "
                      f"(olmax reads false)")


def model_config_from_olmo_core(cfg: dict, where: str) -> ModelConfig:
    """The olmax ModelConfig of an OLMo-core experiment config (``config.json``): its ``model``
    section (OLMo-core 2.x ``attention`` or 3.x ``sequence_mixer``) and the tokenizer's vocabulary
    size from ``dataset.tokenizer``. Anything olmax would compute differently is an OlmaxError
    naming the field (see the module notes)."""
    r = _Reader(where)
    if not isinstance(cfg, dict):
        r.fail("the top level is not an object")
    model = r.obj(cfg, "model", "")
    assert model is not None
    try:
        return _model_config(r, model, cfg)
    except ConfigError as e:
        raise OlmaxError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class _Layer:
    """What one layer computes, as olmax's fields: its block's and its own window and RoPE."""

    block: dict          # the block's fields, the same for every layer
    window: int | None
    theta: float
    yarn: YarnConfig | None
    path: str            # where its block is in config.json


def _model_config(r: _Reader, model: dict, cfg: dict) -> ModelConfig:
    m = "model."
    r.fields(model, m, "TransformerConfig", TRANSFORMER)
    r.choice(model, "name", m, "default", ("default",),
             "olmax computes OLMo-core's default Transformer (not nGPT or MoE)")
    r.off(model, "embedding_norm", m, "olmax has no norm after the embedding")
    r.off(model, "embed_scale", m, "olmax does not scale the embedding", also=(1, 1.0))
    if model.get("freeze_params"):
        r.fail(f"{m}freeze_params is {shown(model['freeze_params'])}: olmax trains every "
               f"parameter")
    d_model = r.whole(model, "d_model", m)
    n_layers = r.whole(model, "n_layers", m)
    padded = r.whole(model, "vocab_size", m)
    if n_layers <= 0 or d_model <= 0:
        r.fail(f"{m}n_layers and {m}d_model must be positive (got {n_layers}, {d_model})")
    layers = _layers(r, model, d_model, n_layers)
    first = layers[0]
    for layer in layers[1:]:
        for key, value in layer.block.items():
            if value != first.block[key]:
                r.fail(f"{layer.path} gives {key} {shown(value)}, {first.path} "
                       f"{shown(first.block[key])}: olmax's layers are one block repeated")
        if layer.theta != first.theta:
            r.fail(f"{layer.path} has RoPE theta {layer.theta:g}, {first.path} {first.theta:g}: "
                   f"olmax has one theta")
    windows = [layer.window for layer in layers]
    yarn = _yarn_of_layers(r, layers)
    lm_head = r.obj(model, "lm_head", m)
    assert lm_head is not None
    r.fields(lm_head, f"{m}lm_head.", "LMHeadConfig", LM_HEAD)
    r.choice(lm_head, "name", f"{m}lm_head.", "default", ("default",),
             "olmax's LM head is OLMo-core's default one")
    r.bias(lm_head, f"{m}lm_head.")
    final_eps = _rms_norm(r, r.obj(lm_head, "layer_norm", f"{m}lm_head.", required=False),
                          f"{m}lm_head.layer_norm", "olmax normalises before the LM head")
    if final_eps != first.block["norm_eps"]:
        r.fail(f"{m}lm_head.layer_norm.eps is {final_eps:g}, the blocks' layer_norm.eps "
               f"{first.block['norm_eps']:g}: olmax has one norm epsilon")
    dataset = r.obj(cfg, "dataset", "", required=False) or {}
    tokenizer = r.obj(dataset, "tokenizer", "dataset.", required=False) or {}
    b = first.block
    return ModelConfig(
        d_model=d_model, n_layers=n_layers, n_heads=b["n_heads"], n_kv_heads=b["n_kv_heads"],
        head_dim=b["head_dim"], mlp_hidden=b["mlp_hidden"],
        vocab_size=r.whole(tokenizer, "vocab_size", "dataset.tokenizer.", padded),
        padded_vocab_size=padded, rope_theta=first.theta, rope_scaling=yarn,
        norm_eps=b["norm_eps"], qk_norm=b["qk_norm"], block_type=b["block_type"],
        window_pattern=minimal_period(windows),
        tie_embeddings=r.flag(model, "tie_word_embeddings", m, False),
        init_std=json_number(model.get("init_std", 0.02)))


def _layers(r: _Reader, model: dict, d_model: int, n_layers: int) -> list[_Layer]:
    """Every layer's block, as OLMo-core's ``resolve_block_configs`` picks it, read."""
    m = "model."
    block = r.obj(model, "block", m)
    assert block is not None
    pattern = model.get("block_pattern")
    overrides = model.get("block_overrides")
    chosen: list[tuple[dict, str]]
    if pattern is not None:     # named blocks, cycled over the layers
        if not isinstance(pattern, list) or not pattern or not all(isinstance(n, str) for n in pattern):
            r.fail(f"{m}block_pattern must be a non-empty list of block names (got {shown(pattern)})")
        if overrides:
            r.fail(f"{m}block_overrides cannot go with {m}block_pattern (OLMo-core refuses it)")
        for name in pattern:
            r.obj(block, name, f"{m}block.")
        chosen = [(block[pattern[i % len(pattern)]], f"{m}block.{pattern[i % len(pattern)]}")
                  for i in range(n_layers)]
    else:
        chosen = [(block, f"{m}block")] * n_layers
        if overrides is not None:
            if not isinstance(overrides, dict):
                r.fail(f"{m}block_overrides must be an object of layer: block (got {shown(overrides)})")
            for key, value in overrides.items():
                try:
                    i = int(key)
                except (TypeError, ValueError):
                    i = -1
                if not 0 <= i < n_layers or str(i) != str(key).strip():
                    r.fail(f"{m}block_overrides has layer {shown(key)}, not one of 0..{n_layers - 1}")
                r.obj(overrides, key, f"{m}block_overrides.")
                chosen[i] = (value, f"{m}block_overrides.{key}")
    read: dict[int, tuple[dict, dict, dict | None, str]] = {}
    out = []
    for i, (cfg, path) in enumerate(chosen):
        if id(cfg) not in read:
            read[id(cfg)] = _block(r, cfg, f"{path}.", d_model)
        facts, rope, window, mixer = read[id(cfg)]
        w = _window(r, window, i, n_layers, f"{path}.{mixer}")
        if w is None and rope["no_global_rope"]:
            r.fail(f"{path}.{mixer}rope.no_global_rope is true: olmax applies RoPE on every layer")
        out.append(_Layer(facts, w, rope["theta"], rope["yarn"], path))
    return out


def _block(r: _Reader, block: dict, p: str, d_model: int) -> tuple[dict, dict, dict | None, str]:
    """A block's fields (what every layer must share), its RoPE, its sliding-window config and
    the key of its sequence mixer (``sequence_mixer.``, or OLMo-core 2.x's ``attention.``)."""
    r.fields(block, p, "TransformerBlockConfig", BLOCK)
    kind = r.choice(block, "name", p, "default", ("default", "reordered_norm"),
                    "olmax computes OLMo-core's pre-norm block (default) and OLMo 3's "
                    "reordered_norm")
    r.off(block, "feed_forward_moe", p, "olmax has no mixture of experts")
    r.off(block, "dropout", p, "olmax has no dropout", also=(0, 0.0))
    for key in ("attention_residual_alpha", "feed_forward_residual_alpha"):
        r.off(block, key, p, "olmax adds the sub-layers' outputs unscaled", also=(1, 1.0))
    if "sequence_mixer" in block and block.get("attention") is not None:
        r.fail(f"{p}attention and {p}sequence_mixer are both given (OLMo-core refuses it)")
    mixer = "sequence_mixer" if block.get("sequence_mixer") is not None else "attention"
    a = f"{p}{mixer}."
    attn = r.obj(block, mixer, p)
    assert attn is not None
    if attn.get("type", "attention") != "attention":
        r.fail(f"{a}type is {shown(attn.get('type'))}: olmax's sequence mixer is attention")
    r.fields(attn, a, "AttentionConfig", ATTENTION)
    r.choice(attn, "name", a, "default", ("default",),
             "olmax computes OLMo-core's default attention (separate q, k, v projections)")
    r.bias(attn, a)
    r.off(attn, "gate", a, "olmax's attention has no output gate")
    r.off(attn, "clip_qkv", a, "olmax does not clip q, k, v")
    r.off(attn, "dropout", a, "olmax has no dropout", also=(0, 0.0))
    r.off(attn, "scalable_softmax", a, "olmax's softmax is the plain one")
    r.off(attn, "attention_sinks", a, "olmax's attention has no sinks")
    r.off(attn, "qk_norm_per_head_gains", a, "olmax's head-wise QK norm shares its gains")
    for key in ("mxfp8_projections", "mxfp8_qkv_projection", "mxfp8_out_projection",
                "mxfp8_save_qkv_for_backward"):
        r.off(attn, key, a, "olmax computes q, k, v in the run's dtype, not MXFP8")
    n_heads = r.whole(attn, "n_heads", a, 16)       # AttentionConfig's default
    if n_heads <= 0:
        r.fail(f"{a}n_heads must be positive (got {n_heads})")
    qk = r.obj(attn, "qk_norm", a, required=False)
    head_wise = r.flag(attn, "use_head_qk_norm", a, False)
    qk_norm, qk_eps = "none", None
    if qk is not None:
        qk_eps = _rms_norm(r, qk, f"{a}qk_norm", "")
        qk_norm = "head" if head_wise else "full"
    norm_eps = _rms_norm(r, r.obj(block, "layer_norm", p, required=False), f"{p}layer_norm",
                         "olmax's blocks normalise their sub-layers")
    if qk_eps is not None and qk_eps != norm_eps:
        r.fail(f"{a}qk_norm.eps is {qk_eps:g}, {p}layer_norm.eps {norm_eps:g}: olmax has one norm "
               f"epsilon")
    ff = r.obj(block, "feed_forward", p)
    assert ff is not None
    f = f"{p}feed_forward."
    r.fields(ff, f, "FeedForwardConfig", FEED_FORWARD)
    r.choice(ff, "name", f, "default", ("default",), "olmax's MLP is OLMo-core's default one")
    r.choice(ff, "activation", f, "silu", ("silu",), "olmax's MLP is SwiGLU")
    r.bias(ff, f)
    facts = {"block_type": "prenorm" if kind == "default" else "reordered_norm",
             "n_heads": n_heads, "n_kv_heads": r.whole(attn, "n_kv_heads", a, n_heads),
             "head_dim": r.whole(attn, "head_dim", a, d_model // n_heads),
             "qk_norm": qk_norm, "norm_eps": norm_eps,
             "mlp_hidden": r.whole(ff, "hidden_size", f)}
    rope = _rope(r, r.obj(attn, "rope", a, required=False), f"{a}rope.")
    return facts, rope, r.obj(attn, "sliding_window", a, required=False), mixer + "."


def _rms_norm(r: _Reader, norm: dict | None, path: str, needed: str) -> float:
    """An RMSNorm's epsilon (OLMo-core's default 1e-5); another norm is refused."""
    if norm is None:
        r.fail(f"{path} is null: {needed}" if needed else f"{path} is null")
    assert norm is not None
    p = f"{path}."
    r.fields(norm, p, "LayerNormConfig", LAYER_NORM)
    r.choice(norm, "name", p, "default", RMS_NAMES,
             "olmax's norms are RMSNorm" + ("" if norm.get("name") not in (None, "default")
                                            else " (OLMo-core's default is LayerNorm)"))
    r.bias(norm, p)
    if norm.get("elementwise_affine") not in (None, True):
        r.fail(f"{p}elementwise_affine is {shown(norm.get('elementwise_affine'))}: olmax's norms "
               f"have a weight (olmax reads true)")
    if norm.get("full_precision") is False:
        r.fail(f"{p}full_precision is false: olmax computes norms in float32")
    eps = r.number(norm, "eps", p, 1e-5)
    if not eps > 0:
        r.fail(f"{p}eps must be positive (got {eps:g})")
    return eps


def _rope(r: _Reader, rope: dict | None, p: str) -> dict:
    """``{"theta", "yarn", "no_global_rope"}`` of a RoPE config."""
    if rope is None:
        r.fail(f"{p[:-1]} is null: olmax applies RoPE (OLMo-core's attention without rope has "
               f"no positions)")
    assert rope is not None
    r.fields(rope, p, "RoPEConfig", ROPE)
    r.choice(rope, "name", p, "default", ("default",),
             "olmax computes OLMo-core's default RoPE (rotating halves; complex pairs neighbours)")
    if rope.get("full_precision") is False:
        r.fail(f"{p}full_precision is false: olmax computes RoPE in float32")
    partial = r.number(rope, "partial_rotary_factor", p, 1.0)
    if partial != 1.0:
        r.fail(f"{p}partial_rotary_factor is {partial:g}: olmax rotates the whole head (1.0)")
    theta = r.number(rope, "theta", p, 500_000.0)
    scaling = rope.get("scaling")
    return {"theta": theta, "yarn": None if scaling is None else _yarn(r, scaling, f"{p}scaling."),
            "no_global_rope": r.flag(rope, "no_global_rope", p, False)}


def _yarn(r: _Reader, scaling: Any, p: str) -> YarnConfig:
    """OLMo-core's ``YaRNRoPEScalingConfig`` (its defaults for what is left out; its
    ``attention_rescale_factor`` is ignored, as OLMo-core ignores it: YaRN computes its own)."""
    if not isinstance(scaling, dict):
        r.fail(f"{p[:-1]} is {shown(scaling)}, not an object")
    cls = str(scaling.get("_CLASS_") or "").rsplit(".", 1)[-1]
    unknown = sorted(k for k in scaling if k not in YARN + ("_CLASS_",))
    if cls not in ("", "YaRNRoPEScalingConfig") or unknown or (
            not cls and not {"factor", "old_context_len"} <= set(scaling)):
        what = scaling.get("_CLASS_") or f"a scaling with {', '.join(unknown or sorted(scaling))}"
        r.fail(f"{p[:-1]} is {what}: olmax's RoPE scaling is YaRN (YaRNRoPEScalingConfig)")
    return YarnConfig(factor=r.number(scaling, "factor", p, 8.0),
                      beta_fast=r.number(scaling, "beta_fast", p, 32.0),
                      beta_slow=r.number(scaling, "beta_slow", p, 1.0),
                      original_max_position_embeddings=r.whole(scaling, "old_context_len", p, 8192))


def _window(r: _Reader, sw: dict | None, layer: int, n_layers: int, p: str) -> int | None:
    """Layer ``layer``'s window as OLMo-core's ``SlidingWindowAttentionConfig`` computes it."""
    if sw is None:
        return None
    s = f"{p}sliding_window."
    r.fields(sw, s, "SlidingWindowAttentionConfig", SLIDING_WINDOW)
    pattern = sw.get("pattern")
    if not isinstance(pattern, list) or not pattern:
        r.fail(f"{s}pattern must be a non-empty list (got {shown(pattern)})")
    first = sw.get("force_full_attention_on_first_layer", True)    # a null reads as false
    last = sw.get("force_full_attention_on_last_layer", True)
    for key, value in (("force_full_attention_on_first_layer", first),
                       ("force_full_attention_on_last_layer", last)):
        if value is not None and not isinstance(value, bool):
            r.fail(f"{s}{key} must be true or false (got {shown(value)})")
    if (first and layer == 0) or (last and layer == n_layers - 1):
        return None
    k = (layer - 1 if first else layer) % len(pattern)
    w = whole_number(pattern[k], f"{s}pattern[{k}]", r.where)
    if w == -1:
        return None
    if w <= 0:
        r.fail(f"{s}pattern[{k}] is {w}: a window is positive, or -1 for full attention")
    return w


def _yarn_of_layers(r: _Reader, layers: list[_Layer]) -> YarnConfig | None:
    """One YaRN for the model: on every layer, or on exactly the full-attention layers."""
    scaled = [layer for layer in layers if layer.yarn is not None]
    if not scaled:
        return None
    for layer in scaled[1:]:
        if layer.yarn != scaled[0].yarn:
            r.fail(f"{layer.path} and {scaled[0].path} scale RoPE differently: olmax has one YaRN")
    full = [i for i, layer in enumerate(layers) if layer.window is None]
    on = [i for i, layer in enumerate(layers) if layer.yarn is not None]
    if on == full:
        return scaled[0].yarn
    if len(on) == len(layers):
        assert scaled[0].yarn is not None
        return dataclasses.replace(scaled[0].yarn, full_attention_only=False)
    r.fail(f"RoPE scaling on layers {on}, full attention on layers {full}: olmax scales every "
           f"layer or exactly the full-attention ones")


__all__ = ["model_config_from_olmo_core", "TRANSFORMER", "BLOCK", "ATTENTION", "ROPE", "YARN",
           "LAYER_NORM", "FEED_FORWARD", "LM_HEAD", "SLIDING_WINDOW", "RMS_NAMES"]
