"""The in-loop evaluator callback on a stand-in trainer: interval, final eval, log keys, and the
contamination guard (refuse / drop / allow)."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from olmax.config import to_dict
from olmax.errors import OlmaxError
from olmax.model.params import init_params
from olmax.train.callbacks import RunView
from olmax.train.callbacks.evaluator import EvaluatorCallback
from olmax.train.recipes import run_config_from_dict

from helpers.tiny import tiny_cfg

EOS, PAD = 100257, 100277


def _write(path, docs):
    np.concatenate([np.append(d, EOS) for d in docs]).astype("<u4").tofile(path)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cb")
    rng = np.random.default_rng(1)
    docs = lambda n: [rng.integers(0, 5000, rng.integers(20, 40)) for _ in range(n)]  # noqa: E731
    held = docs(6)
    train = docs(40) + [held[3]]                      # one held-out document leaked into training
    files = dict(train=_write(tmp / "train.bin", train), held=_write(tmp / "held.bin", held),
                 clean=_write(tmp / "clean.bin", docs(5)))
    cfg = tiny_cfg(vocab_size=100278, padded_vocab_size=100352, d_model=16, head_dim=4, mlp_hidden=32)
    return files, cfg, init_params(cfg, jax.random.key(0))


def _trainer(files, cfg, params, **eval_cfg):
    run = run_config_from_dict({"model": to_dict(cfg), "data": {"paths": [files["train"]]},
                                "train": {"seq_len": 64}, "eval": eval_cfg})
    logged = []
    t = RunView(run, run_dir=None, is_main=True, state=SimpleNamespace(params=params),
            log_fn=lambda step, m: logged.append((step, m)))
    return t, logged


def test_guard_refuses_leaked_heldout(setup):
    files, cfg, params = setup
    t, _ = _trainer(files, cfg, params, interval=2, heldout=[f"held={files['held']}"])
    cb = EvaluatorCallback.from_config(t.cfg)
    with pytest.raises(OlmaxError, match=r"held-out set 'held' overlaps the training data: 1 of 6 .*"
                                         r"eval\.drop_overlapping=true"):
        cb.on_train_start(t)


def test_interval_final_eval_and_drop(setup):
    files, cfg, params = setup
    t, logged = _trainer(files, cfg, params, interval=2, drop_overlapping=True,
                         heldout=[f"held={files['held']}", f"clean={files['clean']}"])
    cb = EvaluatorCallback.from_config(t.cfg)
    cb.on_train_start(t)
    assert len(cb.suite.heldout["held"][0]) == 5 and len(cb.suite.heldout["clean"][0]) == 5
    assert cb.on_step_end(t, 1, {}) is None
    t.step = 2
    m = cb.on_step_end(t, 2, {})
    assert set(m) == {"eval/lm/held/CE loss", "eval/lm/held/PPL", "eval/lm/clean/CE loss",
                      "eval/lm/clean/PPL", "eval/seconds"}
    assert 9 < m["eval/lm/clean/CE loss"] < 13                  # random init: about ln(100352)
    t.step = 3
    cb.on_train_end(t)                                          # step 3 was not an eval step
    assert [s for s, _ in logged] == [3]
    t.step = 4
    assert cb.on_step_end(t, 4, {}) is not None
    cb.on_train_end(t)                                          # already evaluated at step 4
    assert [s for s, _ in logged] == [3]


@pytest.mark.reference
def test_downstream_in_loop(setup):
    from helpers.evref import olmes_wheel

    olmes_wheel()
    files, cfg, params = setup
    t, logged = _trainer(files, cfg, params, tasks=["copycolors_10way_fast"], limit=3, on_start=True,
                         interval=None, heldout=[f"clean={files['clean']}"])
    cb = EvaluatorCallback.from_config(t.cfg)
    cb.on_train_start(t)
    (step, m), = logged
    assert step == 0 and "eval/downstream/copycolors_10way_fast (accuracy)" in m
    assert m["eval/downstream/copycolors_10way_fast (accuracy)"] in (0.0, 1 / 3, 2 / 3, 1.0)
