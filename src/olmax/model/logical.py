"""Logical sharding of activations: the model names dimensions, the parallel layer places them.

The model marks its main activations with logical axis names (``constrain(h, ("batch", "seq",
"act_embed"))``), exactly as parameters carry logical names. Outside a mesh this is the identity.
The training step (``olmax.train.step``) traces the model inside :func:`activation_sharding` with a
function from ``olmax.parallel.sharding`` that turns the names into a ``with_sharding_constraint``
on the mesh. Without these constraints XLA's sharding propagation is free to keep the layout the
embedding lookup produces (the model dimension split, the batch whole), so every device would
compute attention for every sequence of the global batch.

Activation axis names: ``batch``, ``seq``, ``act_embed``, ``act_heads``, ``act_kv_heads``,
``head_dim``, ``act_mlp``, ``act_vocab``, and ``rows`` (positions of a micro-batch flattened to
rows, batch-major: split over every device that holds other rows or other positions).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax

Constrainer = Callable[[jax.Array, tuple], jax.Array]

_CONSTRAINER: contextvars.ContextVar[Constrainer | None] = contextvars.ContextVar(
    "olmax_activation_sharding", default=None)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Constrain ``x`` to the placement its logical ``axes`` map to (identity outside a mesh)."""
    fn = _CONSTRAINER.get()
    if fn is None:
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"logical axes {axes} do not match an array of rank {x.ndim}")
    return fn(x, axes)


@contextlib.contextmanager
def _bound(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def activation_sharding(fn: Constrainer | None) -> contextlib.AbstractContextManager:
    """Trace model code under ``fn`` (None: no constraints)."""
    return _bound(_CONSTRAINER, fn)


# How many parts the placement splits a dimension into: ``parts(name, size)``.
Splitter = Callable[[str, int], int]

_SPLITTER: contextvars.ContextVar[Splitter | None] = contextvars.ContextVar(
    "olmax_activation_parts", default=None)


def parts(axis: str, size: int) -> int:
    """How many devices a dimension of ``size`` named ``axis`` is split over (1 outside a mesh)."""
    fn = _SPLITTER.get()
    return 1 if fn is None else int(fn(axis, size))


def activation_parts(fn: Splitter | None) -> contextlib.AbstractContextManager:
    """Trace model code with ``fn`` answering :func:`parts` (None: nothing is split)."""
    return _bound(_SPLITTER, fn)


# Kernels XLA cannot partition (Pallas custom calls) or partitions only for equal input shardings
# (cuDNN attention) run once per device on its own part of their inputs: the training step
# installs a runner (``olmax.parallel.sharding.per_device_runner``) that places them with a
# ``shard_map`` by the same logical axes. Without one (a single device) they run as they are.
Runner = Callable[[Callable, tuple, tuple], Any]

_RUNNER: contextvars.ContextVar[Runner | None] = contextvars.ContextVar(
    "olmax_per_device_runner", default=None)


def per_device(fn: Callable, arrays: tuple, axes: tuple) -> Any:
    """``fn(*arrays)`` on each device's part of ``arrays`` (logical ``axes`` per array; the result
    is placed like the first array), or ``fn(*arrays)`` itself outside a mesh."""
    runner = _RUNNER.get()
    return fn(*arrays) if runner is None else runner(fn, arrays, axes)


def per_device_kernels(runner: Runner | None) -> contextlib.AbstractContextManager:
    """Trace model code with ``runner`` placing per-device kernels (None: run them as they are)."""
    return _bound(_RUNNER, runner)
