"""The trainer end to end through ``olmax train`` on raw uint32 token files."""

import hashlib
import json
import logging
import os

import numpy as np
import pytest
import yaml

from olmax.cli import main
from olmax.config import DataConfig
from olmax.train.recipes import load_recipe
from olmax.train.schedules import build_schedule

KEYS = {"step", "loss", "z_loss", "lr", "grad_norm", "skipped", "tokens", "tokens_per_sec", "mfu",
        "batch_hash"}


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_cli_writes_a_complete_run_dir(token_files, tmp_path, capsys, caplog):
    """The run's length is one epoch (``train.max_epochs=1``) over 3000 + 2200 tokens: 93 + 68 =
    161 instances of 32 tokens, 161 // 8 = 20 steps (the last instance dropped, as OLMo-core's
    loader drops it), the cosine's horizon; ``train.hard_stop=6`` ends the run at step 6."""
    paths, recipe = token_files
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="olmax.train.trainer"):
        rc = main(["train", str(recipe), "--run-dir", str(run_dir), "train.max_epochs=1",
                   "train.hard_stop=6"])
    assert rc == 0
    announced = [r.getMessage() for r in caplog.records if "olmax train:" in r.getMessage()]
    assert len(announced) == 1 and ("train.max_epochs=1 = 20 steps (20 batches of 8 x 32 per epoch), "
                                    "hard stop at step 6, steps 1..6") in announced[0], announced
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for r in recs:
        assert KEYS <= set(r), KEYS - set(r)
        assert np.isfinite(r["loss"]) and r["z_loss"] > 0 and r["skipped"] is False
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert [r["tokens"] for r in recs] == [8 * 32 * s for s in range(1, 7)]

    # lr: the OLMo-core schedule at step s (counted from 1), over the epoch's 20 steps
    cfg = load_recipe(str(recipe))
    sched = build_schedule(cfg.scheduler, cfg.optim.lr, 20)
    assert [r["lr"] for r in recs] == [sched(s) for s in range(1, 7)]
    # by hand (warmup 2, alpha_f 0.1): peak * (0.1 + 0.9 * (1 + cos(pi * (6 - 2) / 18)) / 2)
    assert recs[5]["lr"] == pytest.approx(3e-3 * (0.1 + 0.45 * (1 + np.cos(4 * np.pi / 18))), rel=1e-12)

    # batch_hash: sha256 of the global batch b = step - 1 as uint32 little-endian
    from olmax.data.loader import build_train_data

    data = build_train_data(DataConfig(paths=tuple(paths)), seq_len=32, global_batch_size=8, seed=11)
    for r in recs:
        toks = data.global_batch(r["step"] - 1)["tokens"]
        assert r["batch_hash"] == hashlib.sha256(toks.astype("<u4").tobytes()).hexdigest()

    # config.yaml: the length as a step count (a config that runs the same schedule again)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    assert (saved["max_steps"], saved["max_epochs"], saved["hard_stop"]) == (20, None, 6)
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["max_steps"] == 20 and info["length"].startswith("train.max_epochs=1 = 20 steps")
    assert info["olmax_version"] and "git_revision" in info
    assert info["attn_impl"] == "xla"   # the implementation the step ran (``auto`` resolved)
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tb").iterdir())
    assert "loss" in capsys.readouterr().out


@pytest.mark.parametrize("override,needle", [
    ("train.max_stepz=3", "train.max_stepz"),
    ("train.max_steps=three", "train.max_steps"),
    ("optim.lr=fast", "optim.lr"),
    ("model.preset=olmo3-nope", "olmo3-nope"),
])
def test_bad_overrides_are_one_line(token_files, tmp_path, capsys, override, needle):
    _, recipe = token_files
    rc = main(["train", str(recipe), "--run-dir", str(tmp_path / "r"), override])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_unknown_recipe_is_one_line(capsys):
    assert main(["train", "no_such_recipe"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no_such_recipe" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_nan_loss_stops_the_run(token_files, tmp_path, capsys):
    _, recipe = token_files
    rc = main(["train", str(recipe), "--run-dir", str(tmp_path / "nan"), "--quiet",
               "optim.lr=1e38", "optim.max_grad_norm=0", "scheduler.warmup_steps=0",
               "train.max_steps=6"])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and "nan" in err.lower() and "step" in err, err   # 3: the run needs a person
    recs = _records(tmp_path / "nan")
    assert not np.isfinite(float(recs[-1]["loss"])) and len(recs) < 6


def test_a_data_override_replaces_the_recipes_data_source(tmp_path):
    cfg = load_recipe("olmo3_tiny", ["data.paths=[a.npy, b.npy]", "train.max_steps=3", "seed=5",
                                     "optim.lr=1e-3", "train.seq_len=64", "train.global_batch_size=4",
                                     "model.preset=olmo3-1m", "init.hf_dir=/some/hf"])
    assert cfg.data.paths == ("a.npy", "b.npy") and cfg.data.embedded is False
    assert (cfg.train.max_steps, cfg.seed, cfg.optim.lr, cfg.train.seq_len,
            cfg.train.global_batch_size) == (3, 5, 1e-3, 64, 4)
    assert cfg.model.d_model == 12 and cfg.init.hf_dir == "/some/hf"
    assert load_recipe("olmo3_tiny").data.embedded is True


def test_resume_hides_the_interrupted_runs_tensorboard_steps(token_files, tmp_path):
    """TensorBoard (its own reader, orphan purging on) shows each step once, with the values of
    the run that resumed, as metrics.jsonl does."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    paths, recipe = token_files
    run_dir = tmp_path / "run"
    common = [str(recipe), "--run-dir", str(run_dir), "checkpoint.interval=2", "--quiet"]
    assert main(["train", *common, "train.max_steps=5", "optim.lr=0.5"]) == 0
    orphaned_lr = _records(run_dir)[-1]["lr"]
    # as if killed after logging step 5 but before its checkpoint committed: resume from step 4,
    # with another learning rate so that re-logged steps differ from the orphaned ones
    shutil.rmtree(run_dir / "checkpoints" / "5")
    assert main(["train", *common, "train.max_steps=7", "optim.lr=0.01"]) == 0
    recs = {r["step"]: r for r in _records(run_dir) if "loss" in r}
    assert sorted(recs) == list(range(1, 8))

    acc = EventAccumulator(str(run_dir / "tb"), purge_orphaned_data=True)
    acc.Reload()
    for key in ("train/loss", "train/lr"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == list(range(1, 8)), key
        want = [recs[s][key.split("/")[1]] for s in range(1, 8)]
        np.testing.assert_allclose([e.value for e in events], want, rtol=1e-6)
    assert recs[5]["lr"] != orphaned_lr  # step 5 was re-logged with other values
