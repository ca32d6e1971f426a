"""Relative checkpoint paths work everywhere a checkpoint is named (orbax itself refuses them):
``convert`` both ways, ``eval``, ``parity --checkpoint``, and a training run's own step dirs
(``init.hf_dir`` / ``init.checkpoint``: tests/interop/test_architecture.py)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from olmax.cli import main
from olmax.config import CheckpointConfig, OptimConfig, to_dict
from olmax.interop import hf as hfio
from olmax.model.params import init_params
from olmax.checkpoint.checkpointer import Checkpointer
from olmax.train.optim import build_optimizer
from olmax.train.state import init_train_state
from helpers.reference import require
from helpers.tiny import narrow_cfg

CFG = narrow_cfg(vocab_size=100278, padded_vocab_size=100352, window_pattern=(8, None),
                 max_seq_len=64)


@pytest.fixture()
def here(tmp_path, monkeypatch):
    params = jax.tree.map(np.asarray, init_params(CFG, jax.random.key(0)))
    (tmp_path / "hf").mkdir()
    hfio.write_hf_dir(tmp_path / "hf", params, CFG, dtype="float32")
    ck = Checkpointer(tmp_path / "runs" / "x" / "checkpoints",
                      CheckpointConfig(interval=1, async_save=False), report=lambda m: None)
    ck.save(40, init_train_state(params, build_optimizer(OptimConfig())),
            {"model": to_dict(CFG), "data_position": 40, "seed": 1}, force=True)
    ck.close()
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 100257, 30), 100257) for _ in range(4)]
    np.concatenate(docs).astype("<u4").tofile(tmp_path / "held.npy")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_convert_and_eval_take_relative_paths(here):
    assert main(["convert", "hf-to-olmax", "hf", "imported"]) == 0
    assert main(["convert", "olmax-to-hf", "runs/x/checkpoints/40", "exported"]) == 0
    assert (here / "exported" / "model.safetensors").is_file()
    for ckpt, name in (("runs/x/checkpoints/40", "a"), ("runs/x", "b"), ("imported", "c")):
        assert main(["eval", ckpt, "--heldout", "held.npy", "--json", f"{name}.json",
                     "--no-progress"]) == 0
        assert json.loads((here / f"{name}.json").read_text())["heldout"]


@pytest.mark.reference
def test_parity_takes_a_relative_checkpoint(here, capsys):
    require("torch")
    require("transformers")
    assert main(["convert", "hf-to-olmax", "hf", "imported"]) == 0
    assert main(["parity", "hf", "--checkpoint", "imported", "--seq-len", "16"]) == 0
    assert "KL(HF||olmax)" in capsys.readouterr().out
