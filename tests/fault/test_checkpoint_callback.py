"""The checkpointing callback on a stand-in trainer (plain pytrees, real optimizer, single device):
resume with metrics rewind, NaN guard, SIGTERM save, stage-2 warm start."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import CheckpointConfig, InitConfig, OlmaxError, OptimConfig, RunConfig
from olmax.model.presets import get_preset
from olmax.train.callbacks.checkpointing import CheckpointCallback, NonFiniteLoss
from olmax.checkpoint.checkpointer import abstract_tree
from olmax.train.optim import build_optimizer
from olmax.train.state import TrainState


def run_cfg(**sections) -> RunConfig:
    base = dict(model=get_preset("olmo3-tiny"), checkpoint=CheckpointConfig(interval=2, keep=5),
                optim=OptimConfig(rolling_interval_length=4))
    return RunConfig(**{**base, **sections})


class FakeTrainer:
    """The attributes the callback uses: state, step, mesh, data (and stop_requested)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, nan_at: int | None = None):
        self.cfg, self.run_dir, self.nan_at = cfg, run_dir, nan_at
        self.tx = build_optimizer(cfg.optim)
        self.mesh = self.data = None
        self.stop_requested = False
        self.cb = CheckpointCallback(cfg, run_dir)

    def init_state(self, params):
        if params is None:
            params = {"w": jnp.linspace(-1.0, 1.0, 16).reshape(4, 4), "embed": jnp.ones((3, 4))}
        return TrainState(params, self.tx.init(params), jnp.zeros((), jnp.int32))

    def run(self, max_steps: int, on_step=None) -> list[float]:
        self.state = self.cb.initial_state(abstract_tree(self.init_state(None)), self.init_state)
        self.step = int(self.state.step)
        losses = []
        try:
            while self.step < max_steps and not self.stop_requested:
                s = self.step + 1
                data = jnp.float32(s)  # "batch" s-1
                loss_fn = lambda p: jnp.sum((p["w"] - data) ** 2) + jnp.sum(p["embed"] ** 2)  # noqa: E731
                loss, grads = jax.value_and_grad(loss_fn)(self.state.params)
                if s == self.nan_at:
                    loss = jnp.float32(np.nan)
                updates, opt = self.tx.update(grads, self.state.opt_state, self.state.params,
                                              lr=0.1, loss=loss)
                params = jax.tree.map(lambda p, u: p + u, self.state.params, updates)
                self.state, self.step = TrainState(params, opt, self.state.step + 1), s
                with open(self.run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({"step": s, "loss": float(loss)}) + "\n")
                losses.append(float(loss))
                if on_step:
                    on_step(s)
                self.cb.on_step_end(self, s, {"loss": loss, "grad_norm": 1.0, "skipped": 0.0})
            self.cb.on_train_end(self)
        finally:
            self.cb.stop.__exit__()
        return losses


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_exactly_and_rewinds_metrics(tmp_path):
    ref = FakeTrainer(run_cfg(), tmp_path / "ref").run(9)
    d = tmp_path / "run"
    first = FakeTrainer(run_cfg(checkpoint=CheckpointConfig(interval=4, keep=5)), d)
    with pytest.raises(KeyboardInterrupt):  # dies after step 6; last checkpoint is step 4
        first.run(9, on_step=lambda s: (_ for _ in ()).throw(KeyboardInterrupt) if s == 6 else None)
    first.cb.ckpt.wait()
    assert metrics_steps(d) == [1, 2, 3, 4, 5, 6]
    t = FakeTrainer(run_cfg(), d)
    rest = t.run(9)
    assert t.cb.resumed_step == 4
    assert metrics_steps(d) == list(range(1, 10))
    logged = [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert logged == ref and rest == ref[4:]  # bit-identical from the first step after the restore


def test_nan_stops_and_keeps_last_good(tmp_path):
    t = FakeTrainer(run_cfg(), tmp_path, nan_at=5)
    with pytest.raises(NonFiniteLoss, match=r"loss nan at step 5: .*checkpoints/4"):
        t.run(9)
    assert t.cb.ckpt.all_steps() == [2, 4]


def test_sigterm_saves_then_stops(tmp_path):
    cfg = run_cfg(checkpoint=CheckpointConfig(interval=100))
    t = FakeTrainer(cfg, tmp_path)
    t.run(9, on_step=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 3 else None)
    assert t.stop_requested and t.step == 3
    assert t.cb.ckpt.all_steps() == [3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    t2 = FakeTrainer(cfg, tmp_path)
    t2.run(5)
    assert t2.cb.resumed_step == 3 and metrics_steps(tmp_path) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("load_optimizer", [True, False])
def test_warm_start(tmp_path, load_optimizer):
    s1 = FakeTrainer(run_cfg(), tmp_path / "stage1")
    s1.run(6)
    final = s1.state
    cfg2 = run_cfg(init=InitConfig(checkpoint=str(tmp_path / "stage1"), load_optimizer=load_optimizer),
                   optim=OptimConfig(lr=1e-2, rolling_interval_length=4))
    s2 = FakeTrainer(cfg2, tmp_path / "stage2")
    state = s2.cb.initial_state(abstract_tree(s2.init_state(None)), s2.init_state)
    assert s2.cb.resumed_step == 0 and int(state.step) == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(final.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adam, adam1 = state.opt_state.inner[0], final.opt_state.inner[0]
    if load_optimizer:
        assert int(adam.count) == int(adam1.count) > 0
        for a, b in zip(jax.tree.leaves((adam.mu, adam.nu)), jax.tree.leaves((adam1.mu, adam1.nu))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
        assert int(adam.count) == 0 and not np.any(np.asarray(adam.mu["w"]))
    assert int(state.opt_state.window.count) == 0  # skip-step statistics restart
    assert s2.cb.origin["kind"] == "checkpoint" and s2.cb.origin["step"] == 6
    s2.cb.close()


def test_resume_refuses_another_model(tmp_path):
    FakeTrainer(run_cfg(), tmp_path).run(2)
    cfg = run_cfg(model=get_preset("olmo3-tiny").replace(d_model=32))
    with pytest.raises(OlmaxError, match=r"different model \(d_model 64 vs 32\)"):
        FakeTrainer(cfg, tmp_path).run(4)
