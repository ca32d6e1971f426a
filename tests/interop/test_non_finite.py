"""Weights holding NaN/Inf are refused by name wherever they are loaded for use (olmax.model.finite):
``olmax eval`` (olmax checkpoint or HF directory), ``olmax convert`` both ways (nothing written),
``olmax parity --checkpoint``, and training's ``init.hf_dir``, ``init.checkpoint`` and resume."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from olmax.cli import main
from olmax.config import CheckpointConfig, OptimConfig, to_dict
from olmax.errors import OlmaxError
from olmax.interop import hf as hfio
from olmax.model.finite import check_params, params_problems
from olmax.model.params import init_params
from olmax.checkpoint.weights import save_params
from olmax.checkpoint.checkpointer import Checkpointer
from olmax.train.optim import build_optimizer
from olmax.train.state import init_train_state
from helpers.tiny import narrow_cfg

CFG = narrow_cfg(vocab_size=120, padded_vocab_size=128, window_pattern=(8, None), max_seq_len=64)


def _one_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    d = tmp_path_factory.mktemp("nan")
    params = jax.tree.map(np.array, init_params(CFG, jax.random.key(0)))
    params["layers"]["down_proj"][1, 3, 4] = np.nan
    params["layers"]["down_proj"][1, 0, 0] = np.nan
    params["lm_head"][2, 5] = -np.inf
    save_params(d / "ckpt", params, CFG)
    (d / "hf").mkdir()
    hfio.write_hf_dir(d / "hf", params, CFG, dtype="float32")
    ck = Checkpointer(d / "run" / "checkpoints", CheckpointConfig(interval=1, async_save=False),
                      report=lambda m: None)
    ck.save(3, init_train_state(params, build_optimizer(OptimConfig())),
            {"model": to_dict(CFG), "data_position": 3, "seed": 34521}, force=True)
    ck.close()
    np.random.default_rng(0).integers(0, 100, 4096).astype("<u4").tofile(d / "tokens.npy")
    return d, params


def test_names_per_layer():
    p = jax.tree.map(np.array, init_params(CFG, jax.random.key(1)))
    assert params_problems(p) == []
    p["layers"]["q_norm"][0, 2] = np.inf
    p["embed"][7] = np.nan
    assert params_problems(p) == ["embed (16 NaN)", "layers.q_norm[0] (1 Inf)"]
    with pytest.raises(OlmaxError, match=r"^here: non-finite weights in 2 tensor\(s\): embed \(16 NaN\), "
                                         r"layers.q_norm\[0\] \(1 Inf\)$"):
        check_params(jax.tree.map(jax.numpy.asarray, p), "here")


def test_eval_refuses_by_name(broken, capsys, tmp_path):
    d, _ = broken
    for src in ("ckpt", "hf"):
        out = tmp_path / f"{src}.json"
        assert main(["eval", str(d / src), "--heldout", str(d / "tokens.npy"), "--json", str(out)]) == 2
        line = _one_line(capsys)
        assert "non-finite weights" in line and "down_proj" in line, line
        assert not out.exists()
    assert main(["eval", str(d / "ckpt"), "--heldout", str(d / "tokens.npy"), "--json",
                 str(tmp_path / "x.json")]) == 2
    assert "2 tensor(s): layers.down_proj[1] (2 NaN), lm_head (1 Inf)" in _one_line(capsys)


def test_convert_refuses_by_name_and_writes_nothing(broken, capsys, tmp_path):
    d, _ = broken
    assert main(["convert", "hf-to-olmax", str(d / "hf"), str(tmp_path / "a")]) == 2
    line = _one_line(capsys)
    assert "non-finite weights" in line and ("model.layers.1.mlp.down_proj.weight" in line
                                             or "lm_head.weight" in line), line
    assert main(["convert", "olmax-to-hf", str(d / "ckpt"), str(tmp_path / "b")]) == 2
    line = _one_line(capsys)
    assert "non-finite weights" in line and ("layers.down_proj[1]" in line or "lm_head" in line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == []      # no output, no temporary left


def test_training_refuses_nan_starting_points(broken, tmp_path):
    import yaml

    from olmax.train.recipes import load_recipe
    from olmax.train.trainer import Trainer

    d, _ = broken
    recipe = {"data": {"paths": [str(d / "tokens.npy")]},
              "train": {"seq_len": 16, "global_batch_size": 2, "max_steps": 1},
              "logging": {"tensorboard": False, "progress": False}}
    (tmp_path / "from_init.yaml").write_text(yaml.safe_dump(recipe))     # no model section
    (tmp_path / "own.yaml").write_text(yaml.safe_dump({**recipe, "model": to_dict(CFG)}))
    for init, pattern in ((f"init.hf_dir={d / 'hf'}", "down_proj"),
                          (f"init.checkpoint={d / 'ckpt'}", r"layers.down_proj\[1\] \(2 NaN\)"),
                          (f"init.checkpoint={d / 'run'}", r"layers.down_proj\[1\] \(2 NaN\)")):
        cfg = load_recipe(str(tmp_path / "from_init.yaml"), [init])
        with pytest.raises(OlmaxError, match=f"non-finite weights.*{pattern}"):
            Trainer(cfg, tmp_path / init.split("=")[0], quiet=True).run()
    # resuming a run whose own newest checkpoint holds NaN
    cfg = load_recipe(str(tmp_path / "own.yaml"))
    with pytest.raises(OlmaxError, match=r"checkpoint .*run/checkpoints/3: non-finite weights"):
        Trainer(cfg, d / "run", quiet=True).run()


def test_eval_results_are_strict_json():
    from olmax.commands.eval import _strict_json

    report, bad = _strict_json({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2}})
    assert report == {"a": None, "b": [1.0, None], "c": {"d": 2}} and bad == 2
