import typing

import pytest

from olmax.config import ONE_OF, ModelConfig, apply_overrides, from_dict, to_dict
from olmax.errors import ConfigError
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
                           ["model.n_layers=8", "train.max_steps=7", "train.seq_len=256", "optim.lr=1e-3",
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
                           "requested_tokens": 10}}}, r"target_ratio values must sum to 1\.0"),
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
    assert set(typing.get_args(Remat)) == set(REMAT_POLICIES) | {"auto"}   # auto: olmax.train.fit


def test_platform_profiles_are_the_platforms():
    from olmax.config import PlatformProfile
    from olmax.hardware import VENDORS
    from olmax.platforms import PROFILE_NAMES, PROFILES

    assert typing.get_args(PlatformProfile) == PROFILE_NAMES
    assert set(PROFILE_NAMES) == set(PROFILES) | {"auto"}
    assert {v.profile for v in VENDORS.values()} <= set(PROFILES)     # every vendor's default


# ----------------------------------------------------------------------------------------------
# Strict YAML


def _bomb(levels: int, width: int = 9, flow: bool = False) -> str:
    """A YAML alias bomb: ``width ** levels`` leaves from a few hundred bytes."""
    names = [f"l{i}" for i in range(levels + 1)]
    items = [f"{names[0]}: &{names[0]} [{', '.join(['x'] * width)}]"]
    for prev, name in zip(names, names[1:]):
        items.append(f"{name}: &{name} [{', '.join(['*' + prev] * width)}]")
    return ("{" + ", ".join(items) + "}") if flow else "\n".join(items) + "\n"


def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    import time

    from olmax.config import MAX_YAML_VALUES, load_yaml, parse_override

    assert 9 ** 9 > 300 * MAX_YAML_VALUES
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(_bomb(9))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"bomb\.yaml: more than 1,000,000 values once its YAML "
                                          r"aliases are expanded"):
        load_yaml(recipe)
    with pytest.raises(ConfigError, match=r"override 'data\.paths': more than 1,000,000 values"):
        parse_override("data.paths=" + _bomb(9, flow=True))
    (tmp_path / "self.yaml").write_text("data: &d {paths: *d}\n")      # refers to itself
    with pytest.raises(ConfigError, match=r"self\.yaml: more than"):
        load_yaml(tmp_path / "self.yaml")
    assert time.perf_counter() - t0 < 10
    # Below the limit an alias expands as YAML says.
    (tmp_path / "ok.yaml").write_text(_bomb(2, width=3))
    assert load_yaml(tmp_path / "ok.yaml")["l2"] == [[["x"] * 3] * 3] * 3


def test_yaml_duplicate_keys_are_refused(tmp_path):
    from olmax.config import load_yaml, parse_override

    recipe = tmp_path / "dup.yaml"
    recipe.write_text("train:\n  seq_len: 32\nmodel: {preset: olmo3-tiny}\ntrain:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml line 4: invalid YAML \(duplicate key 'train' "
                                          r"\(first given at line 1\)\)"):
        load_yaml(recipe)
    with pytest.raises(ConfigError, match=r"override 'train': duplicate key 'seq_len'"):
        parse_override("train={seq_len: 32, seq_len: 64}")
    # A merge key's entries may be overridden by the mapping's own (that is what merging means).
    (tmp_path / "merge.yaml").write_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n")
    assert load_yaml(tmp_path / "merge.yaml")["other"] == {"x": 3, "y": 2}


def test_yaml_size_and_encoding_are_checked_before_parsing(tmp_path):
    from olmax.config import MAX_YAML_BYTES, load_yaml, parse_override

    big = tmp_path / "big.yaml"
    big.write_text("a: " + "x" * MAX_YAML_BYTES + "\n")
    with pytest.raises(ConfigError, match=r"big\.yaml: 4,194,308 bytes, more than a recipe may hold"):
        load_yaml(big)
    with pytest.raises(ConfigError, match=r"override 'data\.root': the value is 4194305 characters"):
        parse_override("data.root=" + "y" * (MAX_YAML_BYTES + 1))
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("data: {root: caf\xe9}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin\.yaml: not UTF-8 text \(invalid continuation byte "
                                          r"at byte 16\)"):
        load_yaml(latin)


def test_values_in_messages_are_shortened():
    from olmax.config import shown

    with pytest.raises(ConfigError) as e:
        run_config_from_dict({"model": {"preset": "olmo3-tiny"}, "train": {"max_steps": ["x"] * 10**6}})
    assert len(str(e.value)) < 200 and str(e.value).startswith("train.max_steps: expected int, got list ['x'")
    assert shown("tokens.npy") == "'tokens.npy'" and shown([16, None]) == "[16, None]"


def test_the_run_length_is_one_of_steps_epochs_tokens():
    """``train.max_steps`` | ``max_epochs`` | ``max_tokens`` (OLMo-core's max_duration), resolved
    to steps on the data's epoch size; ``hard_stop`` ends the run earlier, the horizon unchanged."""
    from olmax.config import TrainConfig

    assert TrainConfig().max_steps == 100                     # none given: 100 steps, as before
    t = TrainConfig(seq_len=32, global_batch_size=8, max_tokens=1000)
    assert t.max_steps is None and t.last_step is None and t.length == "train.max_tokens=1000"
    assert t.steps_for(batches_per_epoch=20) == 4             # ceil(1000 / (8 x 32)) = ceil(3.9)
    assert TrainConfig(seq_len=32, global_batch_size=8, max_tokens=1024).steps_for(20) == 4
    assert TrainConfig(seq_len=32, global_batch_size=8, max_tokens=1025).steps_for(20) == 5
    e = TrainConfig(max_epochs=2, hard_stop=30)
    assert e.steps_for(batches_per_epoch=20) == 40            # epochs 1 and 2
    assert e.steps_for(batches_per_epoch=20, first_epoch=2) == 20   # data.epoch=2: epoch 2 only
    r = e.resolved(batches_per_epoch=20)
    assert (r.max_steps, r.max_epochs, r.max_tokens, r.hard_stop, r.last_step) == (40, None, None, 30, 30)
    assert TrainConfig(max_steps=10, hard_stop=30).last_step == 10

    for given, shown in ((dict(max_steps=5, max_epochs=1), "train.max_steps=5, train.max_epochs=1"),
                         (dict(max_epochs=1, max_tokens=9), "train.max_epochs=1, train.max_tokens=9")):
        with pytest.raises(ConfigError) as e_info:
            TrainConfig(**given)
        assert str(e_info.value) == ("set one of train.max_steps, train.max_epochs, "
                                     f"train.max_tokens (got {shown})")
    for key in ("max_epochs", "max_tokens", "hard_stop"):
        with pytest.raises(ConfigError, match=f"^train.{key} must be positive"):
            TrainConfig(**{key: 0})
    with pytest.raises(ConfigError, match=r"^train.max_epochs \(1\) is before data.epoch \(2\)"):
        run_config_from_dict({"model": {"preset": "olmo3-tiny"}, "train": {"max_epochs": 1, "seq_len": 64},
                              "data": {"epoch": 2}})


def test_an_override_of_the_run_length_replaces_the_recipe_s():
    raw = {"model": {"preset": "olmo3-tiny"}, "train": {"max_epochs": 1, "seq_len": 64}}
    cfg = run_config_from_dict(apply_overrides(raw, ["train.max_steps=7"], one_of=ONE_OF))
    assert (cfg.train.max_steps, cfg.train.max_epochs, cfg.train.seq_len) == (7, None, 64)
    with pytest.raises(ConfigError, match="set one of train.max_steps"):
        run_config_from_dict(apply_overrides(raw, ["train.max_steps=7", "train.max_tokens=9"],
                                             one_of=ONE_OF))
