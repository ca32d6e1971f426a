"""OLMo-core's SkipStep AdamW as an optax transformation.

Reference: OLMo-core ``optim/adamw.py`` (``adamw_step``), ``optim/skip_step_optimizer.py``
(``get_step_factor``) and ``train/train_module/transformer/train_module.py`` (``optim_step``,
``_clip_grad_norm``). One update, given the gradient ``g``, the batch's CE loss and the scheduled
``lr``:

1. ``norm = ||g||_2`` over all parameters (pre-clip; logged and fed to the skip rule), then
   ``g *= min(1, max_grad_norm / (norm + 1e-6))`` (torch ``clip_grads_with_norm_``).
2. Skip rule: the loss and the norm are appended to rolling windows of the last
   ``rolling_interval_length + 1`` values. Once at least ``max(2, rolling_interval_length // 2)``
   losses are recorded, the step proceeds only if ``loss - mean <= sigma * std`` and
   ``norm - mean_n <= sigma * std_n``, with mean/std (ddof=1, ``torch.std_mean``) over the window
   *without* the current entry. Skipped steps still enter the window.
3. AdamW (optax ``scale_by_adam``: ``m_hat / (sqrt(v_hat) + eps)``), decoupled weight decay with
   the scheduled lr (``p -= lr * wd * p``, i.e. OLMo-core's ``p *= 1 - lr * wd``) on every parameter
   except those named in ``no_decay`` (OLMo 3: the embedding only), update ``-lr * (...)``.
   A skipped step leaves parameters, moments and Adam's step count unchanged, so bias correction
   counts applied steps only (OLMo-core ``step_increment_bugfix=True``). The count starts at
   ``initial_adam_count`` (1 where OLMo-core's checkpointer saved step 0 before the first update);
   with ``step_increment_bugfix=False`` it never advances (OLMo-core before 2025-06-30: every step's
   bias correction is the first one's, about 2.2x the lr at betas 0.9/0.95 from a count of 0).

Differences from OLMo-core, both deliberate: the rolling windows live in the optimizer state (so they
are checkpointed and a resumed run skips exactly as an uninterrupted one would; OLMo-core keeps them
in Python lists that restart empty), and the statistics are computed in fp32 in a fixed order.

optax supplies Adam's moments and bias correction, the decoupled weight decay with its mask and the
global norm; this module adds what optax lacks: the torch clipping coefficient, the skip rule and an
lr passed per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from olmax.config import OptimConfig

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grads_with_norm_: max_norm / (total_norm + 1e-6)


class SkipWindow(NamedTuple):
    """Ring buffers of the last ``size`` losses and gradient norms (fp32) and the number seen."""

    losses: jax.Array
    grad_norms: jax.Array
    count: jax.Array  # int32: entries appended so far (saturates at nothing; used modulo size)


class SkipStepAdamWState(NamedTuple):
    inner: Any            # optax state of (scale_by_adam, add_decayed_weights)
    window: SkipWindow
    last_factor: jax.Array  # fp32: 1.0 if the most recent update was applied, 0.0 if skipped


def _window_init(size: int) -> SkipWindow:
    return SkipWindow(jnp.zeros((size,), jnp.float32), jnp.zeros((size,), jnp.float32),
                      jnp.zeros((), jnp.int32))


def _window_append(w: SkipWindow, loss: jax.Array, grad_norm: jax.Array) -> SkipWindow:
    i = w.count % w.losses.shape[0]
    return SkipWindow(w.losses.at[i].set(loss.astype(jnp.float32)),
                      w.grad_norms.at[i].set(grad_norm.astype(jnp.float32)), w.count + 1)


def _std_mean_previous(values: jax.Array, count: jax.Array, newest: jax.Array):
    """Unbiased std and mean over the valid entries of a ring buffer, excluding slot ``newest``."""
    size = values.shape[0]
    idx = jnp.arange(size)
    valid = (idx < jnp.minimum(count, size)) & (idx != newest)
    n = jnp.sum(valid).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, values, 0.0)) / n
    var = jnp.sum(jnp.where(valid, jnp.square(values - mean), 0.0)) / (n - 1.0)
    return jnp.sqrt(var), mean


def step_factor(window: SkipWindow, *, interval: int, sigma: float) -> jax.Array:
    """1.0 if the step whose loss/norm were appended last should be applied, else 0.0.

    OLMo-core ``SkipStepOptimizer.get_step_factor``: the window holds ``interval + 1`` entries, the
    rule activates once ``max(2, interval // 2)`` losses have been recorded.
    """
    size = window.losses.shape[0]
    assert size == interval + 1
    recorded = jnp.minimum(window.count, size)
    newest = (window.count - 1) % size
    l_std, l_mean = _std_mean_previous(window.losses, window.count, newest)
    g_std, g_mean = _std_mean_previous(window.grad_norms, window.count, newest)
    ok = ((window.losses[newest] - l_mean) <= sigma * l_std) & \
         ((window.grad_norms[newest] - g_mean) <= sigma * g_std)
    active = recorded >= max(2, interval // 2)
    return jnp.where(active, ok, True).astype(jnp.float32)


def decay_mask(params: Any, no_decay: tuple[str, ...]) -> Any:
    """Pytree of bools: True where weight decay applies (top-level names in ``no_decay`` excluded)."""
    def mark(path, _leaf):
        top = path[0].key if hasattr(path[0], "key") else str(path[0])
        return top not in no_decay
    return jax.tree_util.tree_map_with_path(mark, params)


def clip_coefficient(grad_norm: jax.Array, max_grad_norm: float) -> jax.Array:
    """torch ``clip_grads_with_norm_``: ``clamp(max_norm / (norm + 1e-6), max=1)``."""
    return jnp.minimum(1.0, max_grad_norm / (grad_norm + CLIP_EPS))


def skip_step_adamw(cfg: OptimConfig) -> optax.GradientTransformationExtraArgs:
    """SkipStep AdamW; ``update(grads, state, params, *, lr, loss)`` returns updates whose
    application (``optax.apply_updates``) is the OLMo-core step. ``lr`` is the scheduled rate, ``loss``
    the batch's (globally averaged) CE loss. With ``cfg.skip_steps=False`` no step is ever skipped.

    The new state exposes the step's diagnostics through :func:`last_step_info`.
    """
    b1, b2 = cfg.betas
    interval = cfg.rolling_interval_length

    def decay(params):
        return optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask(params, cfg.no_decay))

    def make_inner(params):
        return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=cfg.eps, eps_root=0.0), decay(params))

    def init(params):
        inner = make_inner(params).init(params)
        if cfg.initial_adam_count:
            adam = inner[0]
            inner = (adam._replace(count=jnp.full_like(adam.count, cfg.initial_adam_count)),) + \
                tuple(inner[1:])
        return SkipStepAdamWState(inner, _window_init(interval + 1), jnp.ones((), jnp.float32))

    def update(grads, state, params=None, *, lr, loss, **extra):
        del extra
        if params is None:
            raise ValueError("skip_step_adamw needs params (decoupled weight decay)")
        grad_norm = optax.global_norm(grads)
        if cfg.max_grad_norm is not None and cfg.max_grad_norm > 0:
            coef = clip_coefficient(grad_norm, cfg.max_grad_norm)
            grads = jax.tree.map(lambda g: g * coef.astype(g.dtype), grads)
        window = _window_append(state.window, jnp.asarray(loss), grad_norm)
        if cfg.skip_steps:
            factor = step_factor(window, interval=interval, sigma=cfg.sigma_factor)
        else:
            factor = jnp.ones((), jnp.float32)
        apply = factor > 0
        _, new_inner = make_inner(params).update(grads, state.inner, params)
        inner = jax.tree.map(lambda new, old: jnp.where(apply, new, old), new_inner, state.inner)
        bias_count = inner[0].count
        if not cfg.step_increment_bugfix:   # the bias correction's count, then the old one kept
            inner = (inner[0]._replace(count=state.inner[0].count),) + tuple(inner[1:])
        # The step's direction from the moments just kept (optax scale_by_adam's formula, then the
        # masked decoupled decay), not from the old moments again: the moments' buffers are updated
        # in place, and XLA would copy every moment first when a later pass still read the old
        # values.
        adam = inner[0]
        mu_hat = optax.tree.bias_correction(adam.mu, b1, bias_count)
        nu_hat = optax.tree.bias_correction(adam.nu, b2, bias_count)
        direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + cfg.eps), mu_hat, nu_hat)
        direction, _ = decay(params).update(direction, inner[1], params)
        lr = jnp.asarray(lr, jnp.float32)
        updates = jax.tree.map(lambda d: jnp.where(apply, -lr * d, jnp.zeros_like(d)), direction)
        return updates, SkipStepAdamWState(inner, window, factor)

    return optax.GradientTransformationExtraArgs(init, update)


def last_step_info(state: SkipStepAdamWState) -> dict[str, jax.Array]:
    """Diagnostics of the most recent update: pre-clip ``grad_norm`` and ``skipped`` (0.0/1.0)."""
    w = state.window
    i = (w.count - 1) % w.losses.shape[0]
    return {"grad_norm": w.grad_norms[i], "skipped": 1.0 - state.last_factor}


def build_optimizer(cfg: OptimConfig) -> optax.GradientTransformationExtraArgs:
    """``optim.name``: ``skip_step_adamw``, or ``adamw`` (the same without the skip rule)."""
    if cfg.name == "adamw":
        cfg = dataclasses.replace(cfg, skip_steps=False)
    return skip_step_adamw(cfg)
