"""Named model configurations, and the one rule that resolves a run's model.

The OLMo 3 sizes are OLMo-core's ``TransformerConfig.olmo3_*`` factories (dolma2 vocabulary padded to
a multiple of 128, window pattern [4096, 4096, 4096, full], QK-norm over the full q/k width,
reordered post-norm blocks, RMSNorm eps 1e-6, RoPE theta 5e5). ``tests/model/test_presets.py``
checks shapes and parameter counts against OLMo-core itself.

:func:`resolve_model` is the only place a model is resolved: a preset's fields, then the fields
the recipe gives, then, when training starts from weights (``init.hf_dir``, ``init.checkpoint``),
agreement with the weights' own config (:class:`WeightsConfig`, read by
:func:`olmax.interop.architecture.read_weights_config`). The weights' config fills what the recipe
leaves out; a field the recipe gives must agree with it. A disagreement is refused in one line
naming each field and both values: rope theta, norm epsilon or a window pattern other than the one
the weights were trained with change every logit silently, and only shapes would otherwise be
checked. ``init.allow_architecture_override=true`` is the explicit ask to train with the recipe's
values instead; fields that change parameter shapes can never differ.

*Architectural* fields, compared: :data:`ARCH_FIELDS` (windows compared per layer). Not compared,
taken from the recipe when it gives them, else from the weights: ``init_std`` (unused when the
weights are loaded), ``max_seq_len`` (a limit on sequence length) and, for an HF source, which
stores no padding, ``padded_vocab_size``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

from olmax.config import ModelConfig, ModelSpec, build, to_dict
from olmax.errors import ConfigError, OlmaxError

_OLMO3 = dict(vocab_size=100278, padded_vocab_size=100352, rope_theta=500_000.0, norm_eps=1e-6,
              qk_norm="full", block_type="reordered_norm", window_pattern=(4096, 4096, 4096, None),
              tie_embeddings=False, max_seq_len=8192)


def _olmo3(d_model: int, n_layers: int, n_heads: int, mlp_hidden: int, *, n_kv_heads: int | None = None,
           head_dim: int | None = None, **kw) -> ModelConfig:
    fields = dict(_OLMO3)
    fields.update(kw)
    return ModelConfig(d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads or n_heads, head_dim=head_dim or d_model // n_heads,
                       mlp_hidden=mlp_hidden, **fields)


PRESETS: dict[str, ModelConfig] = {
    "olmo3-1m": _olmo3(12, 4, 4, 256, head_dim=4),
    "olmo3-14m": _olmo3(128, 4, 8, 512),
    "olmo3-30m": _olmo3(256, 4, 8, 768),
    "olmo3-60m": _olmo3(384, 8, 8, 1536),
    "olmo3-100m": _olmo3(512, 12, 8, 2048),
    "olmo3-190m": _olmo3(768, 12, 12, 3072),
    "olmo3-370m": _olmo3(1024, 16, 16, 4096),
    "olmo3-600m": _olmo3(1280, 16, 16, 5120),
    "olmo3-760m": _olmo3(1536, 16, 16, 6144),
    "olmo3-1b": _olmo3(2048, 16, 16, 8192),
    "olmo3-3b": _olmo3(3328, 16, 16, 13312),
    "olmo3-7b": _olmo3(4096, 32, 32, 11008),
    # The 7B with heads reshaped 32x128 -> 16x256: same parameter count and matmul FLOPs, a
    # different (not numerically equivalent) attention. A benchmark variant, never a parity target.
    "olmo3-7b-16x256": _olmo3(4096, 32, 16, 11008, head_dim=256),
    "olmo3-13b": _olmo3(5120, 40, 40, 13824),
    "olmo3-32b": _olmo3(5120, 64, 40, 27648, n_kv_heads=8),
    # CPU-sized OLMo 3 for the quickstart and tests: GQA, windows shorter than the sequence.
    "olmo3-tiny": _olmo3(64, 4, 4, 256, n_kv_heads=2, window_pattern=(64, 64, 64, None),
                         max_seq_len=256),
}


def get_preset(name: str) -> ModelConfig:
    key = name.lower().replace("_", "-")
    if key not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}' (known: {', '.join(PRESETS)})")
    return PRESETS[key]


# Every field of ModelConfig but the three that do not change what a model computes.
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                    if f.name not in ("init_std", "max_seq_len", "padded_vocab_size"))
# Fields that decide parameter shapes (with padded_vocab_size for olmax checkpoints).
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
                "vocab_size", "qk_norm", "tie_embeddings")
OVERRIDE_KEY = "init.allow_architecture_override"
LEAVE_OUT = ("leave these fields out (or drop the recipe's model section: model=null) to take the "
             "checkpoint's")


class WeightsConfig(NamedTuple):
    """The model config stored with a run's starting weights, and where it was read."""

    model: ModelConfig
    key: str         # "init.checkpoint" | "init.hf_dir"
    where: str       # the file it was read from, for messages

    @property
    def hf_source(self) -> bool:
        """HF stores no vocabulary padding: ``padded_vocab_size`` is the run's to choose."""
        return self.key == "init.hf_dir"


def _value(cfg: ModelConfig, name: str) -> Any:
    return cfg.layer_windows() if name == "window_pattern" else getattr(cfg, name)


def _shown(cfg: ModelConfig, name: str) -> Any:
    value = getattr(cfg, name)
    if name == "window_pattern":
        return list(value)
    return to_dict(value) if name == "rope_scaling" else value


def differences(source: ModelConfig, model: ModelConfig, fields=ARCH_FIELDS) -> list[str]:
    """The fields (of ``fields``) on which ``model`` computes something other than ``source``."""
    return [f for f in fields if _value(source, f) != _value(model, f)]


def describe_differences(source: ModelConfig, model: ModelConfig, fields: list[str],
                         source_label: str, model_label: str) -> str:
    return "; ".join(f"model.{f} is {_shown(model, f)!r} in {model_label} but "
                     f"{_shown(source, f)!r} in {source_label}" for f in fields)


def resolve_model(spec: ModelSpec | Mapping[str, Any] | None, weights: WeightsConfig | None = None,
                  *, allow_override: bool = False, path: str = "model") -> ModelConfig:
    """The model of a run (see the module docstring): ``spec`` (a ModelSpec, or a section as plain
    data, ``{"preset": "olmo3-7b", "n_layers": 4}``) over ``weights``' config when given."""
    if not isinstance(spec, ModelSpec):
        spec = ModelSpec.parse(spec, path)
    given = dict(spec.fields)
    if spec.preset is not None:
        given = {**ModelSpec.of(get_preset(spec.preset)).fields, **given}
    if weights is None:
        return build(ModelConfig, given, path)
    source = weights.model
    try:
        model = build(ModelConfig, {**ModelSpec.of(source).fields, **given}, path)
    except ConfigError as e:
        raise ConfigError(f"{weights.key} {weights.where}: {e}") from None
    extra = () if weights.hf_source else ("padded_vocab_size",)
    diff = differences(source, model, ARCH_FIELDS + extra)
    shapes = [f for f in diff if f in SHAPE_FIELDS + extra]
    if shapes:
        raise OlmaxError(f"{weights.key}: {describe_differences(source, model, shapes, weights.where, 'the recipe')}"
                         f" (the weights have other shapes; {LEAVE_OUT})")
    if diff and not allow_override:
        raise OlmaxError(f"{weights.key}: {describe_differences(source, model, diff, weights.where, 'the recipe')}; "
                         f"the architecture comes from the checkpoint: {LEAVE_OUT}, or set "
                         f"{OVERRIDE_KEY}=true to train with the recipe's values")
    return model
