"""Checkpoint saves and the start state on a stand-in trainer (plain pytrees, real optimizer,
single device): resume with metrics rewind, NaN guard, SIGTERM save, stage-2 warm start.

The stand-in runs the trainer's own pieces in the trainer's order: ``start_state``, the
non-finite check, the :class:`CheckpointSaver` hooks."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.checkpoint.checkpointer import Checkpointer, abstract_tree
from olmax.config import CheckpointConfig, InitConfig, OptimConfig, RunConfig, TrainConfig
from olmax.errors import OlmaxError
from olmax.model.presets import get_preset
from olmax.train.callbacks import RunView
from olmax.train.callbacks.saver import CheckpointSaver
from olmax.train.start import start_state
from olmax.train.optim import build_optimizer
from olmax.train.state import TrainState
from olmax.train.trainer import NonFiniteLossError, non_finite


def run_cfg(**sections) -> RunConfig:
    base = dict(model=get_preset("olmo3-tiny"), train=TrainConfig(seq_len=256),
                checkpoint=CheckpointConfig(interval=2, keep=5),
                optim=OptimConfig(rolling_interval_length=4))
    return RunConfig(**{**base, **sections})


class FakeTrainer:
    """A toy loss on a small pytree, driven like ``Trainer.run``."""

    def __init__(self, cfg: RunConfig, run_dir: Path, nan_at: int | None = None):
        self.cfg, self.run_dir, self.nan_at = cfg, run_dir, nan_at
        self.tx = build_optimizer(cfg.optim)
        self.ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
        self.cb = CheckpointSaver()
        self.run_view = RunView(cfg, run_dir, is_main=True, checkpointer=self.ckpt)

    def fresh_state(self, params):
        if params is None:
            params = {"w": jnp.linspace(-1.0, 1.0, 16).reshape(4, 4), "embed": jnp.ones((3, 4))}
        return TrainState(params, self.tx.init(params), jnp.zeros((), jnp.int32))

    def start(self):
        return start_state(self.cfg, self.ckpt, abstract_tree(self.fresh_state(None)), self.fresh_state,
                             metrics_path=self.run_dir / "metrics.jsonl")

    @property
    def state(self):
        return self.run_view.state

    @property
    def step(self):
        return self.run_view.step

    @property
    def stop_requested(self):
        return self.run_view.stop_requested

    def run(self, max_steps: int, on_step=None) -> list[float]:
        run = self.run_view
        self.started = self.start()
        run.state, run.step, run.origin = self.started.state, self.started.step, self.started.origin
        losses = []
        try:
            while run.step < max_steps and not run.stop_requested:
                s = run.step + 1
                data = jnp.float32(s)  # "batch" s-1
                loss_fn = lambda p, data=data: jnp.sum((p["w"] - data) ** 2) + jnp.sum(p["embed"] ** 2)  # noqa: E731
                loss, grads = jax.value_and_grad(loss_fn)(run.state.params)
                if s == self.nan_at:
                    loss = jnp.float32(np.nan)
                updates, opt = self.tx.update(grads, run.state.opt_state, run.state.params,
                                              lr=0.1, loss=loss)
                params = jax.tree.map(lambda p, u: p + u, run.state.params, updates)
                run.state, run.step = TrainState(params, opt, run.state.step + 1), s
                metrics = {"loss": loss, "grad_norm": 1.0, "skipped": 0.0}
                with open(self.run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({"step": s, "loss": float(loss)}) + "\n")
                losses.append(float(loss))
                if on_step:
                    on_step(s)
                what = non_finite(metrics)
                if what:
                    raise NonFiniteLossError.at(s, what, self.ckpt)
                self.cb.after_log(run, s, metrics)
            self.cb.on_train_end(run)
        finally:
            self.cb.close()
        return losses


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_exactly_and_rewinds_metrics(tmp_path):
    ref = FakeTrainer(run_cfg(), tmp_path / "ref").run(9)
    d = tmp_path / "run"
    first = FakeTrainer(run_cfg(checkpoint=CheckpointConfig(interval=4, keep=5)), d)
    with pytest.raises(KeyboardInterrupt):  # dies after step 6; last checkpoint is step 4
        first.run(9, on_step=lambda s: (_ for _ in ()).throw(KeyboardInterrupt) if s == 6 else None)
    first.ckpt.wait()
    assert metrics_steps(d) == [1, 2, 3, 4, 5, 6]
    t = FakeTrainer(run_cfg(), d)
    rest = t.run(9)
    assert t.started.step == 4
    assert metrics_steps(d) == list(range(1, 10))
    logged = [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert logged == ref and rest == ref[4:]  # bit-identical from the first step after the restore


def test_nan_stops_and_keeps_last_good(tmp_path):
    t = FakeTrainer(run_cfg(), tmp_path, nan_at=5)
    with pytest.raises(NonFiniteLossError, match=r"loss nan at step 5: .*checkpoints/4"):
        t.run(9)
    assert t.ckpt.all_steps() == [2, 4]


def test_sigterm_saves_then_stops(tmp_path):
    cfg = run_cfg(checkpoint=CheckpointConfig(interval=100))
    t = FakeTrainer(cfg, tmp_path)
    t.run(9, on_step=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 3 else None)
    assert t.stop_requested and t.step == 3
    assert t.ckpt.all_steps() == [3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    t2 = FakeTrainer(cfg, tmp_path)
    t2.run(5)
    assert t2.started.step == 3 and metrics_steps(tmp_path) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("load_optimizer", [True, False])
def test_warm_start(tmp_path, load_optimizer):
    s1 = FakeTrainer(run_cfg(), tmp_path / "stage1")
    s1.run(6)
    final = s1.state
    cfg2 = run_cfg(init=InitConfig(checkpoint=str(tmp_path / "stage1"), load_optimizer=load_optimizer),
                   optim=OptimConfig(lr=1e-2, rolling_interval_length=4))
    s2 = FakeTrainer(cfg2, tmp_path / "stage2")
    start = s2.start()
    state = start.state
    assert start.step == 0 and int(state.step) == 0
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
    assert start.origin["kind"] == "checkpoint" and start.origin["step"] == 6
    s2.cb.close()
    s2.ckpt.close()


def test_resume_refuses_another_model(tmp_path):
    FakeTrainer(run_cfg(), tmp_path).run(2)
    cfg = run_cfg(model=get_preset("olmo3-tiny").replace(d_model=32))
    with pytest.raises(OlmaxError, match=r"different model \(d_model 64 vs 32\)"):
        FakeTrainer(cfg, tmp_path).run(4)
