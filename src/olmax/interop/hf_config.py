"""Hugging Face ``Olmo3Config`` (``config.json``) <-> :class:`olmax.config.ModelConfig`.

- ``layer_types`` (``sliding_attention`` | ``full_attention`` per layer; default: every 4th layer
  full) with ``sliding_window`` -> ``window_pattern``, the shortest period that repeats to the
  layer list (HF's sliding mask ``kv_idx > q_idx - sliding_window`` is olmax's window W).
- RoPE: v5 ``rope_parameters`` keyed by layer type, or v4.57 ``rope_theta`` + ``rope_scaling``
  (scaling on full-attention layers only). Default and YaRN types; one theta for all layers.
  Where a type entry has no ``rope_theta`` the top-level ``rope_theta`` applies to every layer (the
  v4.57 meaning; transformers 5.24 silently gives sliding layers 500000 in that case).
- ``rms_norm_eps``, ``tie_word_embeddings``, GQA (``num_key_value_heads``), ``head_dim``.
- QK-norm is full-width and blocks are reordered post-norm (the only Olmo3 form).
- The HF vocabulary (``vocab_size`` rows, e.g. dolma2's 100278) is padded to a multiple of 128
  (OLMo-core's ``padded_vocab_size``, 100352).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from olmax.config import ModelConfig, YarnConfig, shown
from olmax.config.load import INT_LIMIT
from olmax.errors import ConfigError, OlmaxError
from olmax.io import read_text
from olmax.transport import url_scheme

HF_ARCHITECTURE = "Olmo3ForCausalLM"
HF_MODEL_TYPE = "olmo3"
VOCAB_MULTIPLE = 128
DEFAULT_ROPE_THETA = 500_000.0      # transformers Olmo3Config.default_theta
SILU = ("silu", "swish")            # the names transformers' ACT2FN computes F.silu for


def read_hf_config(hf_dir: str | os.PathLike, what: str = "") -> dict:
    """``config.json`` of an HF directory, as a dict (its weights are not looked at here: see
    :func:`check_safetensors_dir`)."""
    if url_scheme(hf_dir) is not None:     # a configuration error, whatever the recipe gives
        raise ConfigError(f"{what + ' ' if what else ''}{hf_dir}: a URL; olmax reads Hugging "
                          f"Face directories from local disk (download it first)")
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        if Path(hf_dir).exists():
            raise OlmaxError(f"{hf_dir} is a file, not a Hugging Face model directory")
        raise OlmaxError(f"Hugging Face model directory not found: {hf_dir}")
    if not path.is_file():
        raise OlmaxError(f"{path}: missing (not a Hugging Face model directory)")
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise OlmaxError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise OlmaxError(f"{path}: top level must be an object")
    return data


def minimal_period(seq: list) -> tuple:
    """The shortest prefix of ``seq`` that repeats to it (``seq`` itself at worst)."""
    n = len(seq)
    for p in range(1, n + 1):
        if n % p == 0 and all(seq[i] == seq[i % p] for i in range(n)):
            return tuple(seq[:p])
    return tuple(seq)


def _given(params: Mapping[str, Any], key: str, default: Any) -> Any:
    value = params.get(key)
    return default if value is None else value


def whole_number(value: Any, key: str, where: str) -> int:
    """A JSON whole number as an int; anything else (0.5, "8", true, NaN, 1e400) is an OlmaxError
    naming ``key`` (``int()`` truncated some and raised an internal error for others)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))
            or not -INT_LIMIT <= value < INT_LIMIT):
        raise OlmaxError(f"{where}: {key} must be a whole number (got {shown(value)})")
    return int(value)


def json_number(value: Any) -> Any:
    """A JSON number as a float; anything else as it is, for the config's check to name."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _rope_type(params: Mapping[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def _rope_from_hf(hf: Mapping[str, Any], used_types: set[str], where: str
                  ) -> tuple[float, YarnConfig | None]:
    """(theta, YaRN or None) from v5 ``rope_parameters`` or v4.57 ``rope_theta``/``rope_scaling``."""
    top_theta = json_number(_given(hf, "rope_theta", DEFAULT_ROPE_THETA))
    rp = hf.get("rope_parameters")
    legacy_scaling = hf.get("rope_scaling")
    if rp is not None and not isinstance(rp, Mapping):
        raise OlmaxError(f"{where}: rope_parameters must be an object")
    if rp and ("sliding_attention" in rp or "full_attention" in rp):
        per = {t: dict(rp.get(t) or {}) for t in ("sliding_attention", "full_attention")}
    elif rp:  # one flat entry for every layer type
        per = {t: dict(rp) for t in ("sliding_attention", "full_attention")}
    else:
        per = {t: {} for t in ("sliding_attention", "full_attention")}
    if legacy_scaling:  # merged into the full-attention layers, as transformers does
        if not isinstance(legacy_scaling, Mapping):
            raise OlmaxError(f"{where}: rope_scaling must be an object or null")
        per["full_attention"].update(legacy_scaling)

    thetas = {t: json_number(_given(per[t], "rope_theta", top_theta)) for t in used_types}
    if len(set(thetas.values())) > 1:
        raise OlmaxError(f"{where}: different rope_theta per layer type ({thetas}) is not supported")
    theta = next(iter(thetas.values())) if thetas else top_theta

    yarns = {}
    for t in used_types:
        kind = _rope_type(per[t])
        if kind == "default":
            continue
        if kind != "yarn":
            raise OlmaxError(f"{where}: rope_type '{kind}' on {t} layers is not supported "
                             f"(OLMo 3 uses default RoPE and YaRN)")
        p = per[t]
        if p.get("mscale") or p.get("mscale_all_dim"):
            raise OlmaxError(f"{where}: YaRN mscale/mscale_all_dim is not supported")
        if p.get("truncate", True) is not True:
            raise OlmaxError(f"{where}: YaRN truncate=false is not supported")
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise OlmaxError(f"{where}: partial_rotary_factor != 1 is not supported")
        # A value that is there is taken as it is (0 included) and checked by YarnConfig's rules;
        # only a missing one falls back.
        orig = whole_number(_given(p, "original_max_position_embeddings", hf.get("max_position_embeddings")),
                      "original_max_position_embeddings", where)
        factor = p.get("factor")
        if factor is None:
            factor = hf["max_position_embeddings"] / orig if orig else 0.0
        yarns[t] = YarnConfig(factor=json_number(factor), beta_fast=json_number(_given(p, "beta_fast", 32.0)),
                              beta_slow=json_number(_given(p, "beta_slow", 1.0)),
                              original_max_position_embeddings=orig,
                              attention_factor=(None if p.get("attention_factor") is None
                                                else float(p["attention_factor"])))
    if not yarns:
        return theta, None
    if "sliding_attention" in yarns:
        full = yarns.get("full_attention")
        if "full_attention" in used_types and full != yarns["sliding_attention"]:
            raise OlmaxError(f"{where}: YaRN on sliding-window layers only is not supported")
        return theta, dataclasses.replace(yarns["sliding_attention"], full_attention_only=False)
    return theta, yarns["full_attention"]


def model_config_from_hf(hf: Mapping[str, Any], *, where: str = "config.json",
                         padded_vocab_size: int | None = None) -> ModelConfig:
    """An HF ``Olmo3ForCausalLM`` config dict -> ModelConfig (other architectures: OlmaxError)."""
    try:
        return _model_config_from_hf(hf, where, padded_vocab_size)
    except ConfigError as e:
        raise OlmaxError(f"{where}: {e}") from None
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        raise OlmaxError(f"{where}: malformed Olmo3 config ({type(e).__name__}: {e})") from None


def _model_config_from_hf(hf: Mapping[str, Any], where: str,
                          padded_vocab_size: int | None) -> ModelConfig:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type != HF_MODEL_TYPE or (archs and HF_ARCHITECTURE not in archs):
        found = f"model_type '{model_type}'" + (f" ({', '.join(archs)})" if archs else "")
        raise OlmaxError(f"{where}: {found} is not supported; olmax imports {HF_ARCHITECTURE} only")

    def req(key: str) -> Any:
        if hf.get(key) is None:
            raise OlmaxError(f"{where}: missing '{key}'")
        return hf[key]

    if hf.get("hidden_act", "silu") not in SILU:   # transformers' ACT2FN: both are F.silu
        raise OlmaxError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (olmax's MLP "
                         f"is SwiGLU: 'silu')")
    if hf.get("attention_bias", False) is not False:
        raise OlmaxError(f"{where}: attention_bias={hf['attention_bias']!r} is not supported "
                         f"(olmax's projections have no bias: false)")
    dropout = hf.get("attention_dropout")
    if dropout not in (None, 0, 0.0) or isinstance(dropout, bool):
        raise OlmaxError(f"{where}: attention_dropout={dropout!r} is not supported (olmax has no "
                         f"dropout: 0.0)")
    tie = hf.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise OlmaxError(f"{where}: tie_word_embeddings must be true or false (got {tie!r})")
    def whole(key: str, default: Any = None) -> int:
        return whole_number(req(key) if default is None else _given(hf, key, default), key, where)

    d_model, n_layers = whole("hidden_size"), whole("num_hidden_layers")
    n_heads = whole("num_attention_heads")
    if n_heads <= 0:
        raise OlmaxError(f"{where}: num_attention_heads must be positive (got {n_heads})")
    n_kv = whole("num_key_value_heads", n_heads)
    head_dim = whole("head_dim", d_model // n_heads)
    vocab = whole("vocab_size")
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise OlmaxError(f"{where}: layer_types has {len(layer_types)} entries for "
                         f"{n_layers} layers")
    bad_types = set(layer_types) - {"sliding_attention", "full_attention"}
    if bad_types:
        raise OlmaxError(f"{where}: unknown layer type(s) {sorted(bad_types)}")
    window = hf.get("sliding_window")
    if "sliding_attention" in layer_types:
        window = whole_number(window, "sliding_window", where) if window is not None else 0
        if window <= 0:
            raise OlmaxError(f"{where}: sliding_attention layers need a positive sliding_window")
    windows = [window if t == "sliding_attention" else None for t in layer_types]
    theta, yarn = _rope_from_hf(hf, set(layer_types), where)
    return ModelConfig(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, mlp_hidden=whole("intermediate_size"), vocab_size=vocab,
        padded_vocab_size=padded_vocab_size or VOCAB_MULTIPLE * math.ceil(vocab / VOCAB_MULTIPLE),
        rope_theta=theta, rope_scaling=yarn, norm_eps=json_number(hf.get("rms_norm_eps", 1e-5)),
        qk_norm="full", block_type="reordered_norm", window_pattern=minimal_period(windows),
        tie_embeddings=tie,
        max_seq_len=whole("max_position_embeddings", 8192))


def _rope_entry(cfg: ModelConfig, yarn: YarnConfig | None) -> dict:
    if yarn is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    entry = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": yarn.factor,
             "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
             "original_max_position_embeddings": yarn.original_max_position_embeddings}
    if yarn.attention_factor is not None:
        entry["attention_factor"] = yarn.attention_factor
    return entry


def _same_rope(base: Mapping[str, Any] | None, cfg: ModelConfig) -> bool:
    if not base:
        return False
    try:
        other = model_config_from_hf(base)
    except OlmaxError:
        return False
    return (other.rope_theta, other.rope_scaling, other.layer_windows()) == (
        cfg.rope_theta, cfg.rope_scaling, cfg.layer_windows())


def hf_config_from_model(cfg: ModelConfig, *, dtype: str = "float32",
                         base: Mapping[str, Any] | None = None) -> dict:
    """ModelConfig -> an ``Olmo3ForCausalLM`` config dict (v5 ``rope_parameters`` plus the v4.57
    ``rope_theta``/``rope_scaling`` keys). Fields the model does not determine (token ids,
    ...) come from ``base`` (the imported config) when given, else dolma2's."""
    if cfg.qk_norm != "full" or cfg.block_type != "reordered_norm":
        raise OlmaxError(f"cannot export to {HF_ARCHITECTURE}: it needs qk_norm='full' and "
                         f"block_type='reordered_norm' (got {cfg.qk_norm!r}, {cfg.block_type!r})")
    windows = cfg.layer_windows()
    sliding = sorted({w for w in windows if w is not None})
    if len(sliding) > 1:
        raise OlmaxError(f"cannot export to {HF_ARCHITECTURE}: it has one sliding_window, "
                         f"the model uses {sliding}")
    yarn = cfg.rope_scaling
    out = dict(base or {})
    rope_keys = ("rope_scaling", "rope_parameters", "rope_theta")
    kept_rope = {k: out[k] for k in rope_keys if k in out} if _same_rope(base, cfg) else None
    for k in rope_keys + ("torch_dtype", "head_dim", "transformers_version"):
        out.pop(k, None)
    if base is None:
        dolma2 = cfg.vocab_size > 100277
        out.update(pad_token_id=100277 if dolma2 else None, eos_token_id=100257 if dolma2 else None,
                   bos_token_id=None)
    out.update(
        architectures=[HF_ARCHITECTURE], model_type=HF_MODEL_TYPE, vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
        attention_dropout=out.get("attention_dropout", 0.0),
        sliding_window=sliding[0] if sliding else None,
        layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
        rope_parameters={
            "full_attention": _rope_entry(cfg, yarn),
            "sliding_attention": _rope_entry(
                cfg, yarn if yarn is not None and not yarn.full_attention_only else None)},
        rope_theta=cfg.rope_theta,
        rope_scaling=({k: v for k, v in _rope_entry(cfg, yarn).items() if k != "rope_theta"}
                      if yarn is not None else None),
        dtype=dtype)
    if kept_rope is not None:  # the imported spelling, when it means the same RoPE
        for k in rope_keys:
            out.pop(k)
        out.update(kept_rope)
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        out["head_dim"] = cfg.head_dim
    return out
