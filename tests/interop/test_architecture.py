"""A model loaded from weights takes its architecture from the weights' config
(olmax.interop.architecture): ``init.hf_dir`` (config.json) and ``init.checkpoint`` (the olmax meta).

A recipe may leave its model section out; one that disagrees is refused, naming every field and
both values, unless ``init.allow_architecture_override=true``; shapes can never differ. Relative
paths work throughout.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import yaml

from olmax.config import RunConfig
from olmax.errors import OlmaxError
from olmax.interop import hf as hfio
from olmax.model.params import init_params
from olmax.train.recipes import load_recipe
from helpers.tiny import small_cfg

SOURCE = small_cfg(vocab_size=120, padded_vocab_size=128, rope_theta=10_000.0, norm_eps=1e-5,
                   window_pattern=(6, None), max_seq_len=64)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("arch")
    params = jax.tree.map(np.asarray, init_params(SOURCE, jax.random.key(0)))
    (d / "hf").mkdir()
    hfio.write_hf_dir(d / "hf", params, SOURCE, dtype="float32")
    hfio.convert_hf_to_olmax(d / "hf", d / "imported")
    np.random.default_rng(0).integers(0, 120, 4096).astype("<u4").tofile(d / "tokens.npy")
    recipe = {"data": {"paths": [str(d / "tokens.npy")]},
              "train": {"seq_len": 16, "global_batch_size": 2, "max_steps": 1},
              "checkpoint": {"interval": 100}, "logging": {"tensorboard": False, "progress": False}}
    (d / "bare.yaml").write_text(yaml.safe_dump(recipe))
    (d / "preset.yaml").write_text(yaml.safe_dump({**recipe, "model": {"preset": "olmo3-tiny"}}))
    return d


def test_the_model_comes_from_the_checkpoint(sources):
    for init in (f"init.hf_dir={sources / 'hf'}", f"init.checkpoint={sources / 'imported'}"):
        cfg = load_recipe(str(sources / "bare.yaml"), [init])
        assert cfg.model == SOURCE
        # a packaged recipe's model section can be dropped on the command line
        assert load_recipe(str(sources / "preset.yaml"), [init, "model=null"]).model == SOURCE
    # fields that do not change what the weights compute come from the recipe when it gives them
    cfg = load_recipe(str(sources / "bare.yaml"), [f"init.hf_dir={sources / 'hf'}",
                                                   "model.max_seq_len=32", "model.init_std=0.01",
                                                   "model.padded_vocab_size=256"])
    assert (cfg.model.max_seq_len, cfg.model.init_std, cfg.model.padded_vocab_size) == (32, 0.01, 256)
    assert cfg.model.replace(max_seq_len=64, init_std=0.02, padded_vocab_size=128) == SOURCE


def test_a_recipe_that_disagrees_is_refused_naming_each_field(sources):
    with pytest.raises(OlmaxError) as e:
        load_recipe(str(sources / "bare.yaml"), [f"init.hf_dir={sources / 'hf'}",
                                                 "model.rope_theta=500000", "model.norm_eps=1e-6",
                                                 "model.window_pattern=[8,null]"])
    msg = str(e.value)
    assert msg.startswith("init.hf_dir: ") and "\n" not in msg
    for text in ("model.rope_theta is 500000.0 in the recipe but 10000.0 in ",
                 "model.norm_eps is 1e-06 in the recipe but 1e-05 in ",
                 "model.window_pattern is [8, None] in the recipe but [6, None] in ",
                 "init.allow_architecture_override=true"):
        assert text in msg, msg
    with pytest.raises(OlmaxError, match=r"model.rope_scaling is .*factor.* in the recipe but None"):
        load_recipe(str(sources / "bare.yaml"), [f"init.checkpoint={sources / 'imported'}",
                                                 "model.rope_scaling={factor: 4.0}"])
    # the same window per layer written as another pattern is the same architecture
    cfg = load_recipe(str(sources / "bare.yaml"), [f"init.hf_dir={sources / 'hf'}",
                                                   "model.window_pattern=[6,null,6,null]"])
    assert cfg.model.layer_windows() == SOURCE.layer_windows()


def test_override_only_when_asked_and_never_for_shapes(sources):
    hf = f"init.hf_dir={sources / 'hf'}"
    cfg = load_recipe(str(sources / "bare.yaml"), [hf, "model.rope_theta=500000",
                                                   "init.allow_architecture_override=true"])
    assert cfg.model.rope_theta == 500_000.0 and cfg.model.norm_eps == SOURCE.norm_eps
    for field in ("model.d_model=64", "model.n_layers=2", "model.vocab_size=100"):
        with pytest.raises(OlmaxError, match=r"other shapes; leave these fields out \(or drop the "
                                             r"recipe's model section: model=null\) to take the "
                                             r"checkpoint's\)$"):
            load_recipe(str(sources / "bare.yaml"), [hf, field, "init.allow_architecture_override=true"])
    with pytest.raises(OlmaxError, match="model.padded_vocab_size is 256 .* but 128"):
        load_recipe(str(sources / "bare.yaml"), [f"init.checkpoint={sources / 'imported'}",
                                                 "model.padded_vocab_size=256",
                                                 "init.allow_architecture_override=true"])


def test_a_run_config_built_in_code_is_checked_at_the_start(sources, tmp_path):
    from olmax.config import DataConfig, InitConfig, LoggingConfig, TrainConfig
    from olmax.train.trainer import Trainer

    cfg = RunConfig(model=SOURCE.replace(rope_theta=500_000.0),
                    data=DataConfig(paths=(str(sources / "tokens.npy"),)),
                    train=TrainConfig(seq_len=16, global_batch_size=2, max_steps=1),
                    init=InitConfig(hf_dir=str(sources / "hf")),
                    logging=LoggingConfig(tensorboard=False, progress=False))
    with pytest.raises(OlmaxError, match="model.rope_theta is 500000.0 in the recipe but 10000.0"):
        Trainer(cfg, tmp_path / "run", quiet=True).run()


def test_hf_dir_and_its_import_start_the_same_run_relative_paths_included(sources, tmp_path,
                                                                       monkeypatch):
    """``init.hf_dir=DIR`` and ``init.checkpoint=<DIR imported>`` (a parameters-only checkpoint)
    train from identical weights: the same first losses, bit for bit. Paths are relative."""
    from olmax.cli import main

    monkeypatch.chdir(sources)
    losses = {}
    for name, init in (("hf", "init.hf_dir=hf"), ("ckpt", "init.checkpoint=imported")):
        run = tmp_path / name
        assert main(["train", "bare.yaml", "--run-dir", str(run), "--quiet", init,
                     "train.max_steps=2"]) == 0
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows if "loss" in r]
        meta_init = json.loads((run / "checkpoints" / "2" / "meta" / "metadata").read_text())["init"]
        assert meta_init["kind"] == ("hf" if name == "hf" else "checkpoint")
    assert losses["hf"] == losses["ckpt"] and len(losses["hf"]) == 2
