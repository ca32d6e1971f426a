"""``init.checkpoint`` on an OLMo-core checkpoint, through ``olmax train`` (no torch anywhere).

A tiny run trains 2 steps; ``olmax convert olmax-to-olmo-core`` writes its checkpoint in
OLMo-core's layout. A new run started from that folder with ``init.load_trainer_state=true
init.load_optimizer=true`` continues at step 3 and its steps 3..4 are the original run's own
(resumed in its run directory), bit for bit; with ``init.load_trainer_state=false`` it restarts
at step 1. Bad input: one line, exit 2, nothing trained.
"""

import json

import pytest

from helpers.cli import refused_in_one_line
from olmax.cli import main


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def exported(token_files, tmp_path):
    """A 2-step olmax run, and its checkpoint exported in OLMo-core's layout."""
    _, recipe = token_files
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run), "--quiet", "train.max_steps=2",
                 "checkpoint.interval=2"]) == 0
    folder = tmp_path / "step2"
    assert main(["convert", "olmax-to-olmo-core", str(run), str(folder)]) == 0
    return recipe, run, folder


@pytest.mark.slow
def test_continue_and_warm_start_from_an_olmo_core_checkpoint(exported, tmp_path):
    recipe, run, folder = exported
    assert main(["train", str(recipe), "--run-dir", str(run), "--quiet", "train.max_steps=4"]) == 0
    original = _records(run)
    cont = tmp_path / "continued"
    assert main(["train", str(recipe), "--run-dir", str(cont), "--quiet", "train.max_steps=4",
                 f"init.checkpoint={folder}", "init.load_trainer_state=true",
                 "init.load_optimizer=true"]) == 0
    got = _records(cont)
    assert [r["step"] for r in got] == [3, 4]
    for ours, theirs in zip(got, original[2:]):
        for key in ("loss", "grad_norm", "lr", "batch_hash", "tokens"):
            assert ours[key] == theirs[key], (ours["step"], key)
    warm = tmp_path / "warm"
    assert main(["train", str(recipe), "--run-dir", str(warm), "--quiet", "train.max_steps=1",
                 f"init.checkpoint={folder}", "init.load_optimizer=true"]) == 0
    first = _records(warm)
    assert [r["step"] for r in first] == [1] and first[0]["batch_hash"] == original[0]["batch_hash"]


def _fails(capsys, argv, needle):
    refused_in_one_line(capsys, argv, needle)


@pytest.mark.slow
def test_bad_starts_are_one_line(exported, tmp_path, capsys, token_files):
    recipe, _, folder = exported
    base = ["train", str(recipe), "--quiet", "train.max_steps=3", f"init.checkpoint={folder}"]
    _fails(capsys, base + ["--run-dir", str(tmp_path / "a"), "init.load_trainer_state=true",
                           "seed=12"], "needs seed=11")
    paths, _ = token_files
    _fails(capsys, base + ["--run-dir", str(tmp_path / "b"), "init.load_trainer_state=true",
                           f"data.paths=[{paths[0]}]"], "fingerprint mismatch")
    _fails(capsys, base + ["--run-dir", str(tmp_path / "c"), "model.d_model=32"], "d_model")
    _fails(capsys, base + ["--run-dir", str(tmp_path / "e"), "init.load_trainer_state=true",
                           "init.load_optimizer=true", "optim.step_increment_bugfix=false"],
           "needs optim.step_increment_bugfix=true")
    weights = tmp_path / "weights"
    assert main(["convert", "olmax-to-olmo-core", str(folder.parent / "run"), str(weights),
                 "--weights-only"]) == 0
    _fails(capsys, ["train", str(recipe), "--quiet", "train.max_steps=3",
                    f"init.checkpoint={weights}", "--run-dir", str(tmp_path / "d"),
                    "init.load_optimizer=true"], "no optimizer state")
    for name in "abcde":
        assert not (tmp_path / name / "metrics.jsonl").exists()
