"""Non-finite weights, found and named.

A model whose weights hold NaN or Inf computes NaN everywhere; evaluating, converting or training
it only hides where the damage is. Every place that loads weights for use (``olmax eval``,
``olmax convert`` both ways, ``olmax parity``, training's ``init.hf_dir`` / ``init.checkpoint`` /
resume) checks them and refuses with one line naming each bad tensor (for the stacked layer
parameters, the layer) and how many NaN and Inf values it holds.

Works on numpy and on (sharded, multi-host) ``jax.Array`` leaves alike: the counts are reductions
computed where the data lives; only two integers per tensor (per layer) leave the devices.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from olmax.errors import OlmaxError

MAX_NAMED = 8


def _numpy_counts(x: Any, axes) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating) and a.dtype.kind != "V":   # V: bfloat16
        a = a.astype(np.float32)
    return np.isnan(a).sum(axis=axes), np.isinf(a).sum(axis=axes)


def _count(xs: list, axes: tuple) -> list:
    return [(jnp.isnan(x).sum(axis=ax), jnp.isinf(x).sum(axis=ax)) for x, ax in zip(xs, axes)]


def _jax_counts(leaves: list, axes: list) -> list[tuple[np.ndarray, np.ndarray]]:
    """NaN/Inf counts of device arrays, in one compiled program computed where the data lives."""
    axes = tuple(axes)
    out_shardings = None
    if not all(getattr(x, "is_fully_addressable", True) for x in leaves):
        # several processes: the counts come back replicated, so every process can read them
        def replicated(x):
            mesh = getattr(x.sharding, "mesh", None)
            if mesh is None:
                return None
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        out_shardings = [(replicated(x), replicated(x)) for x in leaves]
    got = jax.jit(_count, static_argnums=1, out_shardings=out_shardings)(leaves, axes)
    return [(np.asarray(n), np.asarray(i)) for n, i in got]


def _describe(nan: int, inf: int) -> str:
    parts = ([f"{nan} NaN"] if nan else []) + ([f"{inf} Inf"] if inf else [])
    return " and ".join(parts)


def tensor_problem(name: str, x: Any) -> str | None:
    """``"name (3 NaN)"`` when the array ``x`` holds non-finite values, else None."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        nan, inf = _numpy_counts(x, None)
    else:
        (nan, inf), = _jax_counts([x], [None])
    nan, inf = int(nan), int(inf)
    return f"{name} ({_describe(nan, inf)})" if nan or inf else None


def params_problems(params: Any) -> list[str]:
    """One entry per non-finite tensor of an olmax parameter tree; stacked layer parameters
    are reported per layer (``layers.up_proj[2]``)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp) for kp, _ in flat]
    leaves = [leaf for _, leaf in flat]
    stacked = [n.startswith("layers.") and np.ndim(x) >= 2 for n, x in zip(names, leaves)]
    axes = [tuple(range(1, np.ndim(x))) if st else None for x, st in zip(leaves, stacked)]
    counts: list = [None] * len(leaves)
    on_device = [i for i, x in enumerate(leaves) if not isinstance(x, np.ndarray)]
    for i, x in enumerate(leaves):
        if i not in on_device:
            counts[i] = _numpy_counts(x, axes[i])
    if on_device:
        for i, c in zip(on_device, _jax_counts([leaves[i] for i in on_device],
                                               [axes[i] for i in on_device])):
            counts[i] = c
    found: list[str] = []
    for name, st, (nan, inf) in zip(names, stacked, counts):
        if st:
            for i in np.flatnonzero((nan + inf) > 0):
                found.append(f"{name}[{i}] ({_describe(int(nan[i]), int(inf[i]))})")
        elif int(nan) or int(inf):
            found.append(f"{name} ({_describe(int(nan), int(inf))})")
    return found


def raise_non_finite(where: str, problems: Iterable[str]) -> None:
    """One OlmaxError naming (up to ``MAX_NAMED`` of) the non-finite tensors, if there are any."""
    problems = list(problems)
    if not problems:
        return
    shown = ", ".join(problems[:MAX_NAMED])
    more = f" and {len(problems) - MAX_NAMED} more" if len(problems) > MAX_NAMED else ""
    raise OlmaxError(f"{where}: non-finite weights in {len(problems)} tensor(s): {shown}{more}")


def check_params(params: Any, where: str) -> None:
    """Refuse an olmax parameter tree holding NaN/Inf (see :func:`params_problems`)."""
    raise_non_finite(where, params_problems(params))


__all__ = ["check_params", "params_problems", "tensor_problem", "raise_non_finite"]
