"""HF config.json <-> ModelConfig mapping (no torch needed)."""

import pytest

from olmax.config import YarnConfig
from olmax.errors import OlmaxError
from olmax.interop.hf_config import hf_config_from_model, model_config_from_hf
from olmax.model import get_preset

S, F = "sliding_attention", "full_attention"


def hf(**kw):
    base = dict(architectures=["Olmo3ForCausalLM"], model_type="olmo3", vocab_size=100278,
                hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                rms_norm_eps=1e-6, max_position_embeddings=256)
    base.update(kw)
    return base


@pytest.mark.parametrize("types,pattern", [
    ([S, S, S, F] * 2, (16, 16, 16, None)),
    ([F, S, S, F, S, S, F, S], (None, 16, 16, None, 16, 16, None, 16)),  # no shorter period
    ([S, F] * 4, (16, None)),
    ([F] * 8, (None,)),
    (None, (16, 16, 16, None)),  # transformers' default: every 4th layer full
])
def test_layer_types_become_the_minimal_window_pattern(types, pattern):
    cfg = model_config_from_hf(hf(layer_types=types))
    assert cfg.window_pattern == pattern
    expected = types or [S, S, S, F] * 2
    assert cfg.layer_windows() == tuple(16 if t == S else None for t in expected)


def test_fields_and_vocab_padding():
    cfg = model_config_from_hf(hf(head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-5))
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (64, 8, 4, 2, 32)
    assert cfg.vocab_size == 100278 and cfg.padded_vocab_size == 100352
    assert cfg.tie_embeddings and cfg.norm_eps == 1e-5 and cfg.max_seq_len == 256
    assert cfg.qk_norm == "full" and cfg.block_type == "reordered_norm"
    assert model_config_from_hf(hf(vocab_size=300)).padded_vocab_size == 384


def test_v457_rope_theta_and_scaling_apply_yarn_to_full_layers_only():
    cfg = model_config_from_hf(hf(rope_theta=10_000.0, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
        "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.2079441541679836}))
    assert cfg.rope_theta == 10_000.0
    assert cfg.rope_scaling == YarnConfig(factor=8.0, original_max_position_embeddings=8192,
                                          attention_factor=1.2079441541679836,
                                          full_attention_only=True)


def test_v5_rope_parameters_per_layer_type():
    rp = {F: {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
              "original_max_position_embeddings": 64},
          S: {"rope_type": "default", "rope_theta": 5e5}}
    cfg = model_config_from_hf(hf(rope_parameters=rp))
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == YarnConfig(factor=4.0, original_max_position_embeddings=64)
    plain = model_config_from_hf(hf(rope_parameters={F: {"rope_type": "default", "rope_theta": 1e4},
                                                     S: {"rope_type": "default", "rope_theta": 1e4}}))
    assert plain.rope_theta == 1e4 and plain.rope_scaling is None


@pytest.mark.parametrize("change,message", [
    (dict(model_type="llama", architectures=["LlamaForCausalLM"]), "model_type 'llama'"),
    (dict(architectures=["Olmo2ForCausalLM"]), "Olmo3ForCausalLM only"),
    (dict(rope_parameters={F: {"rope_type": "default", "rope_theta": 1e4},
                           S: {"rope_type": "default", "rope_theta": 5e5}}), "rope_theta"),
    (dict(rope_parameters={F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                           S: {"rope_type": "default", "rope_theta": 1e4}}), "rope_type 'linear'"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(layer_types=[S, F]), "layer_types has 2 entries"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(hidden_act="gelu_pytorch_tanh"), r"hidden_act='gelu_pytorch_tanh' is not supported \(olmax's MLP is SwiGLU"),
    (dict(attention_bias=True), r"attention_bias=True is not supported"),
    (dict(attention_bias=1), r"attention_bias=1 is not supported"),
    (dict(attention_dropout=0.1), r"attention_dropout=0.1 is not supported \(olmax has no dropout"),
    (dict(tie_word_embeddings="false"), r"tie_word_embeddings must be true or false \(got 'false'\)"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "multiple of n_kv_heads"),
    (dict(hidden_size="wide"), "hidden_size must be a whole number"),
    (dict(num_hidden_layers=None), "missing 'num_hidden_layers'"),
])
def test_bad_configs_are_one_line_errors(change, message):
    with pytest.raises(OlmaxError, match=message) as e:
        model_config_from_hf(hf(**change))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["olmo3-7b", "olmo3-32b", "olmo3-tiny", "olmo3-7b-16x256"])
def test_presets_survive_export_and_import(name):
    cfg = get_preset(name)
    back = model_config_from_hf(hf_config_from_model(cfg))
    assert back == cfg


def test_yarn_config_survives_export_and_import():
    cfg = get_preset("olmo3-7b").replace(rope_scaling=YarnConfig(attention_factor=1.2079441541679836),
                                         max_seq_len=65536)
    out = hf_config_from_model(cfg)
    assert out["rope_parameters"][S] == {"rope_type": "default", "rope_theta": 500000.0}
    assert out["rope_parameters"][F]["rope_type"] == "yarn"
    assert model_config_from_hf(out) == cfg


def test_export_rejects_what_olmo3_cannot_express():
    cfg = get_preset("olmo3-tiny")
    with pytest.raises(OlmaxError, match="one sliding_window"):
        hf_config_from_model(cfg.replace(window_pattern=(8, 16, None, None)))
    with pytest.raises(OlmaxError, match="reordered_norm"):
        hf_config_from_model(cfg.replace(block_type="prenorm"))


def test_parity_without_torch_is_a_clear_error(monkeypatch):
    import sys

    from olmax.interop.parity import run_parity

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(OlmaxError, match="needs torch and transformers"):
        run_parity("/nonexistent")


@pytest.mark.parametrize("entry,expect", [
    ({"factor": 0}, r"rope_scaling\.factor must be >= 1 \(got 0\.0\)"),
    ({"beta_fast": 0}, r"rope_scaling\.beta_fast must be positive \(got 0\.0\)"),
    ({"beta_slow": 0}, r"rope_scaling\.beta_slow must be positive"),
    ({"original_max_position_embeddings": 0}, r"rope_scaling\.original_max_position_embeddings must be >= 1"),
    ({"factor": float("nan")}, r"rope_scaling\.factor must be >= 1 \(got nan\)"),
    ({"attention_factor": -1}, r"rope_scaling\.attention_factor must be positive or null"),
    ({"beta_fast": 0.5}, r"rope_scaling\.beta_fast \(0\.5\) must be >= beta_slow \(1\.0\)"),
])
def test_yarn_values_are_checked_not_replaced_by_defaults(entry, expect):
    """0 used to become the default (``value or default``) or end in ``math domain error``."""
    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, **entry}
    with pytest.raises(OlmaxError, match=r"^config\.json: model\." + expect):
        model_config_from_hf(hf(rope_scaling=rope))


@pytest.mark.parametrize("fields,expect", [
    ({"rope_theta": 0}, r"model\.rope_theta must be > 1 \(got 0\.0\)"),
    ({"rms_norm_eps": float("nan")}, r"model\.norm_eps must be positive \(got nan\)"),
    ({"rope_theta": 1e39}, r"model\.rope_theta must be within float32's range"),
])
def test_model_values_are_checked_on_import(fields, expect):
    with pytest.raises(OlmaxError, match=r"^config\.json: " + expect):
        model_config_from_hf(hf(**fields))


HF_BOUNDARY = [0, -1, 0.5, float("nan"), float("inf"), 10**30, "", "8", None, True, [], {}]
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64, "attention_factor": 1.2}


@pytest.mark.parametrize("key", sorted(hf()) + ["head_dim", "rope_theta", "tie_word_embeddings",
                                                "layer_types"] + [f"yarn.{k}" for k in YARN])
def test_every_hf_key_imports_cleanly_or_is_refused_in_one_line(key):
    """The HF config is checked by the config's own rules: a boundary value either imports into a
    ModelConfig that passed them or is one OlmaxError line, never another exception."""
    for value in HF_BOUNDARY:
        cfg = hf(rope_scaling=dict(YARN))
        if key.startswith("yarn."):
            cfg["rope_scaling"][key.split(".", 1)[1]] = value
        else:
            cfg[key] = value
        try:
            model_config_from_hf(cfg)
        except OlmaxError as e:
            assert "\n" not in str(e) and str(e).startswith("config.json: "), (key, value, e)


def test_swish_is_silu():
    """transformers' ACT2FN computes ``F.silu`` for both names: the same model."""
    assert model_config_from_hf(hf(hidden_act="swish")) == model_config_from_hf(hf())
