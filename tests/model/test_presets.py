"""Preset shapes and parameter counts against ai2-olmo-core's ``TransformerConfig.olmo3_*``.

Each OLMo-core model is built on the meta device (no memory) with the padded dolma2 vocabulary
(100352 rows), and every parameter shape, per-layer window, head layout, RoPE theta and norm eps
is compared with the olmax preset (OLMo-core weights are [out, in], olmax [in, out]).
"""

import pytest

from olmax.model import count_params, get_preset, param_shapes
from olmax.model.params import olmo_core_tensors
from helpers.reference import require

torch = require("torch")
olmo_core_config = require("olmo_core.nn.transformer")
from olmo_core.nn.attention import AttentionBackendName  # noqa: E402

PADDED_VOCAB = 100352

# olmax preset -> OLMo-core factory
PAIRS = {
    "olmo3-1m": "olmo3_1M", "olmo3-14m": "olmo3_14M", "olmo3-30m": "olmo3_30M",
    "olmo3-60m": "olmo3_60M", "olmo3-100m": "olmo3_100M", "olmo3-190m": "olmo3_190M",
    "olmo3-370m": "olmo3_370M", "olmo3-600m": "olmo3_600M", "olmo3-760m": "olmo3_760M",
    "olmo3-1b": "olmo3_1B", "olmo3-3b": "olmo3_3B", "olmo3-7b": "olmo3_7B",
    "olmo3-13b": "olmo3_13B", "olmo3-32b": "olmo3_32B",
}

def _olmo_core_model(factory: str):
    cfg = getattr(olmo_core_config.TransformerConfig, factory)(
        vocab_size=PADDED_VOCAB, attn_backend=AttentionBackendName.torch)
    return cfg, cfg.build(init_device="meta")


@pytest.mark.parametrize("preset,factory", sorted(PAIRS.items()))
def test_preset_matches_olmo_core(preset, factory):
    cfg = get_preset(preset)
    oc_cfg, model = _olmo_core_model(factory)
    assert cfg.padded_vocab_size == PADDED_VOCAB and cfg.vocab_size == 100278
    assert count_params(cfg) == oc_cfg.num_params

    # every OLMo-core parameter by the name and shape the parameter table gives it
    ours = {t.name: t.shape for t in olmo_core_tensors(cfg)}
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == ours

    windows = cfg.layer_windows()
    for i in range(cfg.n_layers):
        att = model.blocks[str(i)].attention
        assert (att.n_heads, att.n_kv_heads, att.head_dim) == (cfg.n_heads, cfg.n_kv_heads,
                                                               cfg.head_dim)
        assert att.window_size == windows[i], f"layer {i}"
        assert att.rope.theta == cfg.rope_theta
        assert not att.use_head_qk_norm and cfg.qk_norm == "full"
        assert att.q_norm.eps == model.blocks[str(i)].attention_norm.eps == cfg.norm_eps
    assert type(model.blocks["0"]).__name__ == "ReorderedNormTransformerBlock"
    assert cfg.block_type == "reordered_norm"


def test_7b_and_32b_counts():
    """The headline numbers (OLMo 3 7B: 7,298,617,344 with the 100352-row vocabulary)."""
    assert count_params(get_preset("olmo3-7b")) == 7_298_617_344
    assert count_params(get_preset("olmo3-32b")) == 32_234_279_936


def test_16x256_variant_has_the_7b_parameter_count():
    base, variant = get_preset("olmo3-7b"), get_preset("olmo3-7b-16x256")
    assert (variant.n_heads, variant.head_dim) == (16, 256)
    assert variant.q_dim == base.q_dim == 4096
    assert count_params(variant) == count_params(base) == 7_298_617_344
    assert param_shapes(variant) == param_shapes(base)
