"""``olmax train`` on 2 jax.distributed processes x 4 CPU devices (localhost, gloo) vs 1 x 8.

Same batch hashes and losses, and the same in-loop evaluation (held-out perplexity, OLMES tasks) at
the end; only process 0 writes metrics; checkpoints written by 2 processes resume in 1 process and
vice versa, continuing the reference run.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.trainrun import STEPS
from helpers.trainrun import check_against, checkpoint_steps, eval_metrics, train, train_multiprocess

pytestmark = pytest.mark.slow


def test_two_processes_match_one(reference_run, two_process_run):
    d = two_process_run       # (shared with the bucket run's 2-process test)
    diffs = check_against(reference_run, d, STEPS)
    print("2x4 vs 1x8 loss differences:", diffs)
    ref_eval, got_eval = eval_metrics(reference_run), eval_metrics(d)
    assert any("/PPL" in k for k in ref_eval) and any("downstream" in k for k in ref_eval), ref_eval
    assert got_eval.keys() == ref_eval.keys()
    for k in ref_eval:
        np.testing.assert_allclose(got_eval[k], ref_eval[k], rtol=1e-4, atol=0, err_msg=k)
    shards = {p.name for p in (d / "checkpoints" / str(STEPS) / "params").iterdir()}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards  # every process wrote its shards


def test_checkpoint_from_two_processes_resumes_in_one_and_back(reference_run, tmp_path):
    a = tmp_path / "2to1"
    train_multiprocess(a, ["train.max_steps=4", "checkpoint.interval=4"])
    train(a, [f"train.max_steps={STEPS}", "checkpoint.interval=4"], devices=8)
    check_against(reference_run, a, STEPS)
    b = tmp_path / "1to2"
    train(b, ["train.max_steps=4", "checkpoint.interval=4"], devices=8)
    train_multiprocess(b, [f"train.max_steps={STEPS}", "checkpoint.interval=4"])
    check_against(reference_run, b, STEPS)
    assert checkpoint_steps(b) == [4, STEPS]
