"""Paths with spaces work wherever a command takes one (a run directory's checkpoints, ``convert``
both ways, ``eval``, ``curves``, ``data inspect``), and a name that is not UTF-8 works where nothing
needs UTF-8 (``curves``, its plot included). Where a library takes UTF-8 names only (TensorStore,
OLMo-core's data fingerprint) such a name is refused in one line naming it: the cases of
tests/cli/bad_inputs.py."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from olmax.checkpoint.checkpointer import Checkpointer
from olmax.cli import main
from olmax.config import CheckpointConfig, OptimConfig, to_dict
from olmax.interop import hf as hfio
from olmax.model.params import init_params
from olmax.train.optim import build_optimizer
from olmax.train.state import init_train_state
from helpers.tiny import narrow_cfg

CFG = narrow_cfg(vocab_size=100278, padded_vocab_size=100352, window_pattern=(8, None),
                 max_seq_len=64)
EOS = 100257


@pytest.fixture()
def spaced(tmp_path, monkeypatch):
    """A folder with a space in its name, and the inputs in folders with spaces."""
    root = tmp_path / "my work"
    root.mkdir()
    params = jax.tree.map(np.asarray, init_params(CFG, jax.random.key(0)))
    (root / "hf in").mkdir()
    hfio.write_hf_dir(root / "hf in", params, CFG, dtype="float32")
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, EOS, 30), EOS) for _ in range(4)]
    (root / "held out").mkdir()
    np.concatenate(docs).astype("<u4").tofile(root / "held out" / "part 0.npy")
    monkeypatch.chdir(root)
    return root, params


def test_a_run_directory_with_a_space_saves_and_evaluates(spaced):
    root, params = spaced
    state = init_train_state(params, build_optimizer(OptimConfig()))
    ck = Checkpointer(root / "my run" / "checkpoints", CheckpointConfig(interval=1, async_save=False),
                      report=lambda m: None)
    ck.save(3, state, {"model": to_dict(CFG), "data_position": 3, "seed": 1}, force=True)
    ck.close()
    assert (root / "my run" / "checkpoints" / "3").is_dir()
    assert main(["eval", "my run", "--heldout", "held out/part 0.npy", "--json", "my result.json",
                 "--no-progress"]) == 0
    assert json.loads((root / "my result.json").read_text())["heldout"]


def test_convert_both_ways_with_spaces(spaced):
    root, _ = spaced
    assert main(["convert", "hf-to-olmax", "hf in", "ckpt out"]) == 0
    assert main(["convert", "olmax-to-hf", "ckpt out", "hf out"]) == 0
    assert (root / "hf out" / "model.safetensors").read_bytes() == (
        root / "hf in" / "model.safetensors").read_bytes()


def test_curves_and_inspect_with_spaces(spaced, capsys):
    root, _ = spaced
    (root / "a run").mkdir()
    (root / "a run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    assert main(["curves", "a run", "--json", "the summary.json"]) == 0
    assert json.loads((root / "the summary.json").read_text())["runs"][0]["source"].endswith("a run")
    assert main(["data", "inspect", "--paths", "held out/part 0.npy", "--seq-len", "8",
                 "--global-batch-size", "2", "--seed", "1", "--batches", "0:1"]) == 0
    assert "1 files" in capsys.readouterr().out


def test_curves_plots_a_run_whose_name_is_not_utf8(tmp_path, monkeypatch, capsys):
    """Nothing in ``curves`` needs UTF-8 names: the plot shows the byte as U+FFFD."""
    monkeypatch.chdir(tmp_path)
    name = os.fsdecode(b"caf\xe9")
    os.mkdir(name)
    with open(os.path.join(name, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    assert main(["curves", name, "--out", "plot.png"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("caf\ufffd: 2 points")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
