"""FLOPs accounting against hand-computed numbers and OLMo-core's own ``num_flops_per_token``."""

from __future__ import annotations

import pytest

from olmax.errors import ConfigError
from olmax.model.flops import (
    attention_flops_per_token, causal_attention_pairs, flops_per_token, matmul_params, mfu,
    peak_flops,
)
from olmax.model.presets import get_preset
from helpers.reference import require

# OLMo 3 7B by hand: D=4096, L=32, 32 heads x 128, F=11008, padded vocab 100352.
_ATTN = 4 * 4096 * 4096 + 2 * 4096          # q, k, v, o projections + full-width QK-norm weights
_MLP = 3 * 4096 * 11008
_HEAD = 100352 * 4096 + 4096                # LM head + final norm
N_7B = 32 * (_ATTN + _MLP) + _HEAD          # 6,887,313,408


def test_matmul_params_7b_by_hand():
    assert matmul_params(get_preset("olmo3-7b")) == N_7B == 6_887_313_408


def test_olmo3_7b_olmo_core_convention_is_49_4_gflop():
    cfg = get_preset("olmo3-7b")
    # 8 full layers charged T=8192 keys, 24 sliding layers charged W=4096 keys, 12*H*hd each.
    attn = 8 * 12 * 4096 * 8192 + 24 * 12 * 4096 * 4096
    assert attention_flops_per_token(cfg, 8192, "olmo_core") == attn
    f = flops_per_token(cfg, 8192, "olmo_core")
    assert f == 6 * N_7B + attn
    assert round(f / 1e9, 1) == 49.4


def test_olmo3_7b_causal_convention_by_hand():
    cfg = get_preset("olmo3-7b")
    full_pairs = 8192 * 8193 // 2
    slide_pairs = 4096 * 4097 // 2 + 4096 * 4096
    attn = 8 * (12 * 4096 * full_pairs // 8192) + 24 * (12 * 4096 * slide_pairs // 8192)
    f = flops_per_token(cfg, 8192, "causal")
    assert f == 6 * N_7B + attn
    assert round(f / 1e9, 2) == 46.56
    # The window matters: counting sliding layers as full causal attention overstates the total.
    no_window = flops_per_token(cfg.replace(window_pattern=(None,)), 8192, "causal")
    assert no_window > f


def test_window_longer_than_sequence_is_full_attention():
    cfg = get_preset("olmo3-7b")
    full = cfg.replace(window_pattern=(None,))
    for conv in ("olmo_core", "causal"):
        assert flops_per_token(cfg, 2048, conv) == flops_per_token(full, 2048, conv)
    assert causal_attention_pairs(5, 2) == 1 + 2 + 2 + 2 + 2
    assert causal_attention_pairs(5, 9) == causal_attention_pairs(5, None) == 15


def test_bad_convention_and_seq_len():
    cfg = get_preset("olmo3-tiny")
    with pytest.raises(ConfigError, match="convention"):
        flops_per_token(cfg, 128, "palm")
    with pytest.raises(ConfigError, match="seq_len"):
        flops_per_token(cfg, 0)


def test_peak_flops_table():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("TPU v5 lite") == 197e12
    assert peak_flops("TPU v5p") == 459e12
    assert peak_flops("TPU v6 lite") == 918e12
    assert peak_flops("some new chip") is None
    import jax
    assert peak_flops(jax.devices("cpu")[0]) is None
    cfg = get_preset("olmo3-7b")
    # AI2's 7,700 tokens/s/GPU on H100 is 38.4 % MFU once the sliding windows are counted.
    assert mfu(7700, cfg, 8192, 989e12) == pytest.approx(0.3844, abs=1e-3)
    assert mfu(7700, cfg, 8192, None) is None


@pytest.mark.reference
@pytest.mark.parametrize("factory,seq_len", [("olmo3_7B", 8192), ("olmo3_7B", 2048),
                                             ("olmo3_190M", 8192), ("olmo3_7B", 65536)])
def test_causal_convention_equals_olmo_core(factory, seq_len):
    torch = require("torch")
    require("olmo_core")
    import warnings

    from olmo_core.nn.transformer import TransformerConfig

    preset = {"olmo3_7B": "olmo3-7b", "olmo3_190M": "olmo3-190m"}[factory]
    oc_cfg = getattr(TransformerConfig, factory)(vocab_size=100352)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = oc_cfg.build(init_device="meta")
    assert flops_per_token(get_preset(preset), seq_len, "causal") == model.num_flops_per_token(seq_len)
