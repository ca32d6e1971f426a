import pytest

from olmax.config import (ConfigError, ModelConfig, apply_overrides, from_dict,
                          run_config_from_dict, to_dict)


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
