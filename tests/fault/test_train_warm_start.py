"""Stage-2 warm start: ``init.checkpoint=PATH init.load_optimizer=true``.

Params, Adam moments and Adam's step count come from the stage-1 checkpoint; the trainer step, the
data position and the LR schedule restart; the new recipe's LR applies.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from olmax.config import SchedulerConfig
from olmax.train.schedules import build_schedule
from helpers import trainrun
from helpers.trainrun import metrics, train

pytestmark = pytest.mark.slow


def read_state(run_dir, step):
    """(params, opt_state, meta) of a checkpoint as stored (plain restore, no target)."""
    import orbax.checkpoint as ocp

    path = run_dir / "checkpoints" / str(step)
    ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        params=ocp.StandardCheckpointHandler(), opt_state=ocp.StandardCheckpointHandler(),
        meta=ocp.JsonCheckpointHandler()))
    stored = ckptr.metadata(path).item_metadata
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(name):
        tree = getattr(stored[name], "tree", stored[name])
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree,
                            is_leaf=lambda x: hasattr(x, "shape"))

    r = ckptr.restore(path, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(target("params")),
        opt_state=ocp.args.StandardRestore(target("opt_state")), meta=ocp.args.JsonRestore()))
    return r["params"], r["opt_state"], r["meta"]


def adam(opt_state):
    """(count, mu) of optax's ScaleByAdamState inside the stored SkipStep AdamW state."""
    inner = opt_state["inner"] if isinstance(opt_state, dict) else opt_state[0]
    a = inner["0"] if isinstance(inner, dict) else inner[0]
    if isinstance(a, dict):
        return int(np.asarray(a["count"])), a["mu"]
    return int(np.asarray(a[0])), a[1]


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    s1 = tmp_path_factory.mktemp("stage1")
    train(s1, ["train.max_steps=4", "checkpoint.interval=4"])
    return s1


def test_stage2_warm_start_carries_adam_and_restarts_schedule_and_data(stage1, tmp_path):
    s1 = stage1
    _, opt1, _ = read_state(s1, 4)
    count1, mu1 = adam(opt1)
    assert count1 == 4

    stage2 = ["train.max_steps=1", "checkpoint.interval=1", "optim.lr=1e-3",
              "scheduler.warmup_steps=5", f"init.checkpoint={s1}"]
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    train(warm, [*stage2, "init.load_optimizer=true"])
    train(cold, [*stage2, "init.load_optimizer=false"])  # same params, fresh optimizer

    m1, mw, mc = metrics(s1), metrics(warm), metrics(cold)
    assert [r["step"] for r in mw] == [1]  # the trainer step restarts
    # the data restarts at batch 0 (same seed: stage 1's first batch), not at stage 1's batch 4
    assert mw[0]["batch_hash"] == m1[0]["batch_hash"]
    # the new recipe's schedule from its step 1: warmup over 5 steps to 1e-3
    sched = build_schedule(SchedulerConfig(warmup_steps=5, t_max=40), 1e-3, 1)
    assert mw[0]["lr"] == pytest.approx(sched(1), rel=1e-12) and mw[0]["lr"] != m1[0]["lr"]
    # same params and batch in both: identical loss, and not a fresh init's loss
    assert mw[0]["loss"] == mc[0]["loss"] != m1[0]["loss"]

    _, opt_w, meta_w = read_state(warm, 1)
    _, opt_c, _ = read_state(cold, 1)
    (count_w, mu_w), (count_c, mu_c) = adam(opt_w), adam(opt_c)
    assert (count_w, count_c) == (count1 + 1, 1)  # Adam's step count carried over
    # the same gradient in both runs, so the first moments differ by exactly b1 * stage-1 moments
    for w, c, m in zip(jax.tree.leaves(mu_w), jax.tree.leaves(mu_c), jax.tree.leaves(mu1)):
        np.testing.assert_allclose(np.asarray(w) - np.asarray(c), 0.9 * np.asarray(m),
                                   rtol=1e-4, atol=1e-9)
    assert meta_w["step"] == 1 and meta_w["data_position"] == 1
    assert meta_w["init"]["kind"] == "checkpoint" and meta_w["init"]["step"] == 4


def test_init_hf_dir_starts_a_fresh_optimizer(stage1, tmp_path):
    from olmax.interop.hf import convert_olmax_to_hf

    hf = convert_olmax_to_hf(stage1, tmp_path / "hf", dtype="float32")
    d = tmp_path / "run"
    out = train(d, ["train.max_steps=1", "checkpoint.interval=1", f"init.hf_dir={hf}"])
    assert "initialised from HF weights" in out.stderr
    params, opt, meta = read_state(d, 1)
    assert adam(opt)[0] == 1 and meta["init"]["kind"] == "hf"
    # the HF weights are stage 1's (real vocabulary rows; HF has no padding rows)
    p1, _, _ = read_state(stage1, 4)
    v = trainrun.BYTE_VOCAB
    lr = metrics(d)[0]["lr"]
    moved = np.abs(np.asarray(params["embed"])[:v] - np.asarray(p1["embed"])[:v]).max()
    assert 0 < moved <= 2 * lr  # one Adam step (|update| <= lr (1 + wd)) away from stage 1
