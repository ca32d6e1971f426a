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
