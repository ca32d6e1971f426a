"""A recipe states what it starts from (``init.required``): ``olmo3_7b_stage3`` warm-starts from
stage 2's checkpoint with its optimizer, ``olmo3_7b_stage2`` from stage 1's weights,
``olmo3_7b_stage1_part2`` continues part 1's run (its run directory holds part 1's checkpoint). Without them
``olmax train`` and ``olmax launch`` refuse in one line naming the key (exit 2) before anything is
written; ``init.required=none`` is the override for experiments. A run directory whose path is
not UTF-8 is refused at the same point, before any work."""

from __future__ import annotations

import os

import pytest

from olmax.cli import main
from olmax.train import trainer as training

DATA = "data.embedded=true"     # the mix need not be on this machine


@pytest.fixture
def started(monkeypatch, tmp_path):
    """Trainer replaced: records the config it would have trained."""
    got = []

    class Fake:
        is_main = True

        def __init__(self, cfg, run_dir, **kw):
            got.append(cfg)

        def run(self):
            return {"stopped_early": False, "run_dir": "r", "steps": 0}

    monkeypatch.setattr(training, "Trainer", Fake)
    monkeypatch.setattr("olmax.commands.train.format_summary", lambda s: "fake")
    monkeypatch.chdir(tmp_path)
    return got


@pytest.mark.parametrize("recipe,overrides,expect", [
    ("olmo3_7b_stage3", [], "init.checkpoint must be set: this recipe (init.required=optimizer) "
                            "starts from a checkpoint with its optimizer state"),
    ("olmo3_7b_stage3", ["init.checkpoint=ck", "init.load_optimizer=false"],
     "init.load_optimizer must be true"),
    ("olmo3_7b_stage2", [], "init.checkpoint or init.hf_dir must be set: this recipe "
                            "(init.required=weights) starts from trained weights"),
    ("olmo3_7b_stage1_part2", [], "--run-dir must hold the checkpoint this recipe continues "
                                  "(init.required=resume)"),
    ("olmo3_7b_stage1_part2", ["--run-dir", "part1", "init.checkpoint=ck", "init.load_optimizer=true"],
     "--run-dir must hold the checkpoint this recipe continues"),
])
def test_train_refuses_a_recipe_without_its_start(capsys, started, tmp_path, recipe, overrides,
                                                  expect):
    assert main(["train", recipe, DATA, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expect in err and "init.required=none" in err, err
    assert not started and not list(tmp_path.iterdir())


def test_part2_starts_in_the_run_directory_of_part1(started, tmp_path):
    """The trainer is replaced (nothing reads the checkpoint): part 1's last step dir is its layout,
    the params/ and meta/ items a complete step has."""
    for item in ("params", "meta"):
        (tmp_path / "part1" / "checkpoints" / "596047" / item).mkdir(parents=True)
    assert main(["train", "olmo3_7b_stage1_part2", DATA, "--run-dir", "part1"]) == 0
    assert main(["train", "olmo3_7b_stage1_part2", DATA, "--run-dir", "elsewhere", "init.checkpoint=ck",
                 "init.load_optimizer=true", "init.load_trainer_state=true"]) == 0
    assert len(started) == 2 and started[0].init.required == "resume"


def test_the_override_lets_an_experiment_start_fresh(capsys, started):
    assert main(["train", "olmo3_7b_stage3", DATA, "init.required=none"]) == 0
    assert len(started) == 1 and started[0].init.checkpoint is None


def test_a_recipe_without_a_declared_start_is_unchanged(started):
    assert main(["train", "olmo3_tiny"]) == 0 and started[0].init.required == "none"


def test_launch_refuses_it_before_writing_the_job(capsys, tmp_path):
    out = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", "olmo3_7b_stage3", DATA, "--nodes", "1", "--gpus-per-node", "8",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "init.checkpoint must be set" in err and not out.exists(), err


def test_required_takes_only_its_values(capsys, started):
    assert main(["train", "olmo3_tiny", "init.required=Weights"]) == 2
    err = capsys.readouterr().err
    assert "init.required: expected one of none, weights, checkpoint, optimizer" in err
    assert "did you mean 'weights'?" in err


def test_a_run_directory_that_is_not_utf8_is_refused_before_any_work(capsys, started, tmp_path):
    """TensorStore refused it only at the first checkpoint save, with 55 tracebacks."""
    name = os.fsdecode(b"run-\xff")
    assert main(["train", "olmo3_tiny", "--run-dir", name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not UTF-8 text" in err and "--run-dir" in err, err
    assert not started and not list(tmp_path.iterdir())
