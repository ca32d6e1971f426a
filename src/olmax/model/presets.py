"""Named model configurations.

The OLMo 3 sizes are OLMo-core's ``TransformerConfig.olmo3_*`` factories (dolma2 vocabulary padded to
a multiple of 128, window pattern [4096, 4096, 4096, full], QK-norm over the full q/k width,
reordered post-norm blocks, RMSNorm eps 1e-6, RoPE theta 5e5). ``tests/model/test_presets.py``
checks shapes and parameter counts against OLMo-core itself.
"""

from __future__ import annotations

from typing import Any, Mapping

from olmax.config import ModelConfig, from_dict, to_dict
from olmax.errors import ConfigError

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


def resolve_model(section: Mapping[str, Any] | None, path: str = "model") -> ModelConfig:
    """A recipe's model section, ``{"preset": "olmo3-7b", "n_layers": 4, ...}`` -> ModelConfig (the
    preset's fields overridden by the others); without ``preset``, every field is given."""
    if section is not None and not isinstance(section, Mapping):
        raise ConfigError(f"{path}: expected a mapping (a preset and fields), got "
                          f"{type(section).__name__} {section!r}")
    section = dict(section or {})
    preset = section.pop("preset", None)
    if preset is None:
        return from_dict(ModelConfig, section, path)
    if not isinstance(preset, str):
        raise ConfigError(f"{path}.preset: expected str, got {preset!r}")
    base = to_dict(get_preset(preset))
    base.update(section)
    return from_dict(ModelConfig, base, path)
