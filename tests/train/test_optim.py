"""SkipStep AdamW (olmax.train.optim) against OLMo-core's SkipStepAdamW, step by step.

OLMo-core is driven the way its ``TransformerTrainModule.optim_step`` drives it: total norm, torch
``clip_grads_with_norm_``, ``latest_loss``/``latest_grad_norm`` set, scheduled lr written into the
param groups, ``step()``. Parameters, moments and skip decisions must agree.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax

from olmax.config import OptimConfig
from olmax.train.optim import clip_coefficient, last_step_info, skip_step_adamw
from helpers.reference import require

torch = require("torch")
oc_adamw = require("olmo_core.optim.adamw")

SHAPES = {"embed": (11, 6), "layers": {"w": (6, 5), "norm": (5,)}, "lm_head": (6, 11)}


def _oc_run(params0, grads_seq, losses, lrs, cfg: OptimConfig, step0_save: bool = False):
    names, tensors = [], []
    for path, v in jax.tree_util.tree_flatten_with_path(params0)[0]:
        names.append(jax.tree_util.keystr(path))
        tensors.append(torch.nn.Parameter(torch.tensor(np.asarray(v))))
    groups = [{"params": [t for n, t in zip(names, tensors) if n.startswith("['embed']")],
               "weight_decay": 0.0},
              {"params": [t for n, t in zip(names, tensors) if not n.startswith("['embed']")]}]
    opt = oc_adamw.SkipStepAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay,
                                 rolling_interval_length=cfg.rolling_interval_length,
                                 sigma_factor=cfg.sigma_factor, foreach=True,
                                 step_increment_bugfix=cfg.step_increment_bugfix)
    if step0_save:   # what saving OLMo-core's step-0 checkpoint does to the optimizer
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(opt)
    out, skipped = [], []
    for grads, loss, lr in zip(grads_seq, losses, lrs):
        for t, g in zip(tensors, jax.tree.leaves(grads)):
            t.grad = torch.tensor(np.asarray(g))
        gs = [t.grad for t in tensors]
        norm = torch.nn.utils.get_total_norm(gs, norm_type=2.0)
        torch.nn.utils.clip_grads_with_norm_(tensors, cfg.max_grad_norm, norm)
        opt.latest_grad_norm = norm
        opt.latest_loss = torch.tensor(loss, dtype=torch.float32)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        skipped.append(float(opt.step_skipped))
        out.append([t.detach().numpy().copy() for t in tensors])
    return out, skipped


def _ours_run(params0, grads_seq, losses, lrs, cfg):
    tx = skip_step_adamw(cfg)
    state = tx.init(params0)

    @jax.jit
    def upd(params, state, grads, loss, lr):
        u, state = tx.update(grads, state, params, lr=lr, loss=loss)
        return optax.apply_updates(params, u), state

    params, out, skipped = params0, [], []
    for grads, loss, lr in zip(grads_seq, losses, lrs):
        params, state = upd(params, state, grads, jnp.float32(loss), jnp.float32(lr))
        skipped.append(float(last_step_info(state)["skipped"]))
        out.append([np.asarray(x) for x in jax.tree.leaves(params)])
    return out, skipped, state


def _problem(steps, seed=0, grad_scale=1.0):
    rng = np.random.default_rng(seed)
    mk = lambda s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    params0 = jax.tree.map(lambda s: mk(s) * 0.1, SHAPES, is_leaf=is_shape)
    grads = [jax.tree.map(lambda s, i=i: mk(s) * grad_scale * (1 + 0.1 * i % 3), SHAPES, is_leaf=is_shape)
             for i in range(steps)]
    losses = list(3.0 + 0.01 * rng.normal(size=steps))
    return params0, grads, losses


@pytest.mark.parametrize("grad_scale", [0.05, 3.0])  # clip inactive / clip active
def test_adamw_updates_match_olmo_core(grad_scale):
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, rolling_interval_length=128)
    params0, grads, losses = _problem(30, grad_scale=grad_scale)
    lrs = [1e-2 * (i + 1) / 30 for i in range(30)]
    ref, ref_skip = _oc_run(params0, grads, losses, lrs, cfg)
    ours, our_skip, _ = _ours_run(params0, grads, losses, lrs, cfg)
    assert our_skip == ref_skip == [0.0] * 30
    for step, (a, b) in enumerate(zip(ours, ref)):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-7, err_msg=f"step {step + 1}")
    # the embedding is not decayed: with a zero gradient it must not move
    cfg0 = OptimConfig(lr=1e-2, weight_decay=0.5)
    zeros = [jax.tree.map(jnp.zeros_like, grads[0])]
    ours0, _, _ = _ours_run(params0, zeros, [3.0], [1e-2], cfg0)
    np.testing.assert_array_equal(ours0[0][0], np.asarray(params0["embed"]))
    np.testing.assert_allclose(ours0[0][1], np.asarray(params0["layers"]["norm"]) * (1 - 1e-2 * 0.5),
                               rtol=1e-6)


@pytest.mark.parametrize("step0_save, initial, bugfix", [(True, 1, True), (False, 0, False),
                                                        (True, 0, False)])
def test_adams_count_as_olmo_cores(step0_save, initial, bugfix):
    """``optim.initial_adam_count=1`` is OLMo-core's optimizer after its checkpointer saved step 0
    (torch's ``_init_optim_state``: zero moments, every ``step`` 1); ``step_increment_bugfix=false``
    is its SkipStepAdamW with the flag off (the count never advances, so a step-0 save leaves it at
    0). Both change every update (the bias correction): parameters and counts must agree."""
    cfg = OptimConfig(lr=1e-2, rolling_interval_length=128, initial_adam_count=initial,
                      step_increment_bugfix=bugfix)
    params0, grads, losses = _problem(12, seed=2, grad_scale=0.05)
    lrs = [1e-2] * 12
    ref, _ = _oc_run(params0, grads, losses, lrs, cfg, step0_save=step0_save)
    ours, _, state = _ours_run(params0, grads, losses, lrs, cfg)
    plain, _, _ = _ours_run(params0, grads, losses, lrs, OptimConfig(lr=1e-2))
    for step, (a, b) in enumerate(zip(ours, ref)):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-7, err_msg=f"step {step + 1}")
    assert int(state.inner[0].count) == (initial + 12 if bugfix else initial)
    moved = max(float(np.max(np.abs(x - y))) for x, y in zip(ours[-1], plain[-1]))
    assert moved > 1e-4   # the count shows in the trajectory


def test_skip_rule_matches_olmo_core():
    """Window 16 (active from the 8th loss); loss and grad-norm spikes are skipped by both, and a
    skipped step advances neither the moments nor Adam's bias-correction count. Skipped values
    stay in the window (a NaN loss makes every later step skip while it is in the window)."""
    cfg = OptimConfig(lr=1e-2, rolling_interval_length=16, sigma_factor=6.0)
    steps = 40
    params0, grads, losses = _problem(steps, seed=1, grad_scale=0.05)
    losses[4] = 50.0     # spike before the rule is active: applied
    losses[25] = 50.0    # loss spike (the first one has left the 17-entry window): skipped
    grads[31] = jax.tree.map(lambda g: g * 1000.0, grads[31])  # grad-norm spike: skipped
    losses[37] = float("nan")  # a NaN loss fails the comparison: skipped, and poisons the window
    lrs = [1e-2] * steps
    ref, ref_skip = _oc_run(params0, grads, losses, lrs, cfg)
    ours, our_skip, state = _ours_run(params0, grads, losses, lrs, cfg)
    assert our_skip == ref_skip
    assert [i for i, s in enumerate(our_skip) if s] == [25, 31, 37, 38, 39]
    np.testing.assert_array_equal(ours[25][1], ours[24][1])
    for a, b in zip(ours[-1], ref[-1]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-7)
    adam = state.inner[0]
    assert int(adam.count) == steps - 5


def test_clip_coefficient_is_torchs():
    for norm in [0.0, 0.5, 0.999999, 1.0, 2.0, 1e6]:
        g = torch.tensor([norm], dtype=torch.float32)
        p = torch.nn.Parameter(torch.zeros(1))
        p.grad = g.clone()
        torch.nn.utils.clip_grads_with_norm_([p], 1.0, torch.tensor(norm))
        coef_ref = float(p.grad[0] / norm) if norm else 1.0
        assert float(clip_coefficient(jnp.float32(norm), 1.0)) == pytest.approx(coef_ref, rel=1e-7)
