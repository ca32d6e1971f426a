"""Logical sharding of activations: the model names dimensions, the parallel layer places them.

The model marks its main activations with logical axis names (``constrain(h, ("batch", "seq",
"act_embed"))``), exactly as parameters carry logical names. Outside a mesh this is the identity.
The training step (``olmax.train.step``) traces the model inside :func:`activation_sharding` with a
function from ``olmax.parallel.sharding`` that turns the names into a ``with_sharding_constraint``
on the mesh. Without these constraints XLA's sharding propagation is free to keep the layout the
embedding lookup produces (the model dimension split, the batch whole), so every device would
compute attention for every sequence of the global batch.

Activation axis names: ``batch``, ``seq``, ``act_embed``, ``act_heads``, ``act_kv_heads``,
``head_dim``, ``act_mlp``, ``act_vocab``.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

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
def activation_sharding(fn: Constrainer | None) -> Iterator[None]:
    """Trace model code under ``fn`` (None: no constraints)."""
    token = _CONSTRAINER.set(fn)
    try:
        yield
    finally:
        _CONSTRAINER.reset(token)
