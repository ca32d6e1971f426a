"""A model loaded from weights takes its architecture from the weights' own config.

Training that starts from ``init.hf_dir`` (the HF ``config.json``) or ``init.checkpoint`` (the
olmax checkpoint's ``meta``) builds the model from that config: the recipe's ``model`` section
may be left out entirely (``model=null`` on the command line drops a packaged recipe's), and a
field it does give must agree with the checkpoint. A disagreement is refused in one line naming
each field and both values: rope theta, norm epsilon or a window pattern other than the one the
weights were trained with change every logit silently, and only shapes would otherwise be
checked. ``init.allow_architecture_override=true`` is the explicit ask to train with the recipe's
values instead (fields that change parameter shapes can never differ: the weights would not fit).

*Architectural* fields, compared: :data:`ARCH_FIELDS` (windows compared per layer). Not compared,
taken from the recipe when it gives them, else from the checkpoint: ``init_std`` (unused when the
weights are loaded), ``max_seq_len`` (a limit on sequence length) and, for an HF source, which
stores no padding, ``padded_vocab_size`` (the recipe's, else the vocabulary rounded up to a
multiple of 128 as OLMo-core pads it). ``olmax parity --checkpoint`` checks its checkpoint against
the HF config the same way; ``olmax eval`` uses the checkpoint's own config.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from olmax.checkpoint.format import resolve_step_dir
from olmax.checkpoint.weights import load_model_config
from olmax.config import ModelConfig, from_dict, to_dict
from olmax.errors import ConfigError, OlmaxError
from olmax.interop.hf_config import model_config_from_hf, read_hf_config
from olmax.interop.safetensors import check_safetensors_dir
from olmax.model.presets import get_preset

# Every field of ModelConfig but the three that do not change what a model computes.
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                    if f.name not in ("init_std", "max_seq_len", "padded_vocab_size"))
# Fields that decide parameter shapes (with padded_vocab_size for olmax checkpoints).
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
                "vocab_size", "qk_norm", "tie_embeddings")
OVERRIDE_KEY = "init.allow_architecture_override"
LEAVE_OUT = ("leave these fields out (or drop the recipe's model section: model=null) to take the "
             "checkpoint's")


def _value(cfg: ModelConfig, name: str) -> Any:
    if name == "window_pattern":
        return cfg.layer_windows()
    return getattr(cfg, name)


def _shown(cfg: ModelConfig, name: str) -> Any:
    value = getattr(cfg, name)
    if name == "window_pattern":
        return list(value)
    if name == "rope_scaling":
        return to_dict(value)
    return value


def differences(source: ModelConfig, model: ModelConfig, fields=ARCH_FIELDS) -> list[str]:
    """The fields (of ``fields``) on which ``model`` computes something other than ``source``."""
    return [f for f in fields if _value(source, f) != _value(model, f)]


def describe(source: ModelConfig, model: ModelConfig, fields: list[str], source_label: str,
             model_label: str) -> str:
    return "; ".join(f"model.{f} is {_shown(model, f)!r} in {model_label} but "
                     f"{_shown(source, f)!r} in {source_label}" for f in fields)


# ----------------------------------------------------------------------------------------------
# The source config


def source_config(hf_dir: str | None, checkpoint: str | None, *,
                  padded_vocab_size: int | None = None) -> tuple[ModelConfig, str, str] | None:
    """``(ModelConfig, which key, where it was read)`` of ``init.checkpoint`` or ``init.hf_dir``
    (the trainer's order), or None when neither is set."""
    if checkpoint:
        step = resolve_step_dir(checkpoint)
        return load_model_config(step), "init.checkpoint", f"{step}/meta"
    if hf_dir:
        where = os.path.join(str(hf_dir), "config.json")
        cfg = model_config_from_hf(read_hf_config(hf_dir), where=where,
                                   padded_vocab_size=padded_vocab_size)
        check_safetensors_dir(hf_dir)
        return cfg, "init.hf_dir", where
    return None


def reconcile(source: ModelConfig, given: Mapping[str, Any], *, allow_override: bool,
              key: str, where: str, hf_source: bool) -> ModelConfig:
    """The model to train: ``source`` with the recipe's ``given`` fields (plain data, presets
    already expanded); a given architectural field that differs is an OlmaxError unless
    ``allow_override`` (and it does not change a shape)."""
    merged = {**to_dict(source), **dict(given)}
    try:
        model = from_dict(ModelConfig, merged, "model")
    except ConfigError as e:
        raise ConfigError(f"{key} {where}: {e}") from None
    shape_fields = SHAPE_FIELDS if hf_source else SHAPE_FIELDS + ("padded_vocab_size",)
    fields = ARCH_FIELDS if hf_source else ARCH_FIELDS + ("padded_vocab_size",)
    diff = differences(source, model, fields)
    shapes = [f for f in diff if f in shape_fields]
    if shapes:
        raise OlmaxError(f"{key}: {describe(source, model, shapes, where, 'the recipe')} (the "
                         f"weights have other shapes; {LEAVE_OUT})")
    if diff and not allow_override:
        raise OlmaxError(f"{key}: {describe(source, model, diff, where, 'the recipe')}; the "
                         f"architecture comes from the checkpoint: {LEAVE_OUT}, or set "
                         f"{OVERRIDE_KEY}=true to train with the recipe's values")
    return model


def _given_fields(section: Any) -> dict:
    """The model fields a recipe section gives (a preset counts as giving all of its fields)."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"model: expected a mapping, got {type(section).__name__} {section!r}")
    section = dict(section)
    preset = section.pop("preset", None)
    if preset is None:
        return section
    if not isinstance(preset, str):
        raise ConfigError(f"model.preset: expected str, got {preset!r}")
    return {**to_dict(get_preset(preset)), **section}


def model_from_init(data: Mapping[str, Any]) -> dict:
    """A recipe's plain data (overrides applied) with the ``model`` section taken from
    ``init.checkpoint`` / ``init.hf_dir`` when one is set (see the module docstring)."""
    init = data.get("init") or {}
    if not isinstance(init, Mapping) or not (init.get("hf_dir") or init.get("checkpoint")):
        return dict(data)
    allow = init.get("allow_architecture_override", False)
    if not isinstance(allow, bool):
        raise ConfigError(f"{OVERRIDE_KEY}: expected bool, got {type(allow).__name__} {allow!r}")
    given = _given_fields(data.get("model"))
    padded = given.get("padded_vocab_size")
    try:
        got = source_config(init.get("hf_dir"), init.get("checkpoint"),
                            padded_vocab_size=padded if isinstance(padded, int) else None)
    except OlmaxError:
        if data.get("model") is not None:
            return dict(data)   # a resumed run may not need it: the trainer reports it if it does
        raise
    source, key, where = got
    model = reconcile(source, given, allow_override=allow, key=key, where=where,
                      hf_source=key == "init.hf_dir")
    return {**data, "model": to_dict(model)}


def check_model(model: ModelConfig, source: ModelConfig, *, allow_override: bool, key: str,
                where: str, hf_source: bool) -> list[str]:
    """At the start of training: ``model`` against the weights' config (what :func:`reconcile`
    decided for a recipe; this also covers a RunConfig built in code). Returns the fields the
    run overrides (allowed), raises OlmaxError otherwise."""
    reconcile(source, {f: to_dict(getattr(model, f)) for f in ARCH_FIELDS + ("padded_vocab_size",)},
              allow_override=allow_override, key=key, where=where, hf_source=hf_source)
    return differences(source, model)


__all__ = ["ARCH_FIELDS", "SHAPE_FIELDS", "differences", "describe", "source_config", "reconcile",
           "model_from_init", "check_model"]
