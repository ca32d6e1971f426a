import typing

import pytest

from olmax.config import ConfigError, ModelConfig, apply_overrides, from_dict, to_dict
from olmax.train.recipes import run_config_from_dict


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.max_stepz'"):
        run_config_from_dict({"model": {"preset": "olmo3-tiny"}, "train": {"max_stepz": 3}})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"train\.max_steps: expected int"):
        run_config_from_dict({"model": {"preset": "olmo3-tiny"}, "train": {"max_steps": "x"}})


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown model preset 'olmo9'"):
        run_config_from_dict({"model": {"preset": "olmo9"}})


def test_overrides_and_preset_fields():
    data = apply_overrides({"model": {"preset": "olmo3-tiny"}},
                           ["model.n_layers=8", "train.max_steps=7", "optim.lr=1e-3",
                            "data.paths=[a.npy, b.npy]", "model.window_pattern=[8, null]"])
    cfg = run_config_from_dict(data)
    assert cfg.model.n_layers == 8 and cfg.model.window_pattern == (8, None)
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 1e-3
    assert cfg.data.paths == ("a.npy", "b.npy")


def test_round_trip_through_plain_data():
    cfg = run_config_from_dict({"model": {"preset": "olmo3-7b"}})
    again = run_config_from_dict(to_dict(cfg))
    assert again == cfg


def test_model_validation():
    with pytest.raises(ConfigError, match="multiple of n_kv_heads"):
        ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=3, head_dim=16, mlp_hidden=64)
    with pytest.raises(ConfigError, match="multiple of len"):
        from_dict(ModelConfig, dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, head_dim=16,
                                    mlp_hidden=64))


@pytest.mark.parametrize("section,message", [
    ({"train": {"compute_dtype": "fp8"}}, r"train\.compute_dtype: expected one of float32, bfloat16"),
    ({"train": {"attn_impl": "flash"}}, r"train\.attn_impl: expected one of"),
    ({"scheduler": {"name": "cosine"}}, r"scheduler\.name: expected one of"),
    ({"optim": {"name": "sgd"}}, r"optim\.name: expected one of"),
    ({"train": {"max_steps": 0}}, r"train\.max_steps must be positive"),
    ({"checkpoint": {"interval": 0}}, r"checkpoint\.interval must be positive"),
    ({"mesh": {"data": -1, "fsdp": -1}}, r"at most one of data/fsdp/tensor"),
    ({"data": {"paths": ["a.npy"], "embedded": True}}, r"exactly one of .*\(got data\.paths, data\.embedded\)"),
    ({"data": {"mixture": {"sources": [{"name": "a", "target_ratio": 0.5, "paths": ["a"]}],
                           "requested_tokens": 10}}}, r"target ratios must sum to 1\.0"),
])
def test_bad_values_fail_at_load_time(section, message):
    with pytest.raises(ConfigError, match=message) as e:
        run_config_from_dict({"model": {"preset": "olmo3-tiny"}, **section})
    assert "\n" not in str(e.value)


def test_runtime_choices_are_the_models():
    from olmax.config import AttnImpl, Remat
    from olmax.model.attention import IMPLEMENTATIONS
    from olmax.model.olmo3 import REMAT_POLICIES

    assert set(typing.get_args(AttnImpl)) == set(IMPLEMENTATIONS) | {"auto"}
    assert set(typing.get_args(Remat)) == set(REMAT_POLICIES)
