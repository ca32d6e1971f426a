"""Logical axis names -> mesh axes, through one rules table.

The model names every parameter dimension (``olmax.model.params.param_axes``: ``vocab``, ``embed``,
``heads``, ``kv_heads``, ``mlp``, ``layers``, ``norm``, ``head_dim``); :data:`RULES` maps each to
mesh axes. FSDP is the default: the ``embed`` dimension of every matrix is sharded over ``fsdp``
(and ``context``, whose devices hold the same rows' other positions); ``tensor`` shards heads, MLP
and vocabulary. A mesh axis is dropped from a dimension it does not
divide (that dimension is then replicated over it) and never used twice in one array.
Activations are placed by the same table (``act_*`` names, :func:`activation_constrainer`): rows
over ``data x fsdp``, positions over ``context``, heads / MLP / vocabulary over ``tensor``, the
model dimension whole.
Optimizer moments are sharded exactly like the parameters they belong to.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from olmax.config import ModelConfig
from olmax.model.logical import activation_parts, activation_sharding, per_device_kernels
from olmax.model.params import param_axes, param_shapes
from olmax.parallel.mesh import BATCH_AXES

RULES: Mapping[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "vocab": ("tensor",),
    "embed": ("fsdp", "context"),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "layers": (),
    "norm": (),
    "head_dim": (),
    "seq": ("context",),
    "rows": BATCH_AXES + ("context",),
    # activations (``olmax.model.logical``): the model dimension is never split between devices
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
}


def logical_to_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                    rules: Mapping[str, tuple[str, ...]] = RULES) -> P:
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        chosen = []
        size = 1
        for mesh_axis in (rules.get(name, ()) if name else ()):
            n = dict(mesh.shape).get(mesh_axis, 1)
            if mesh_axis in used or n == 1 or dim % (size * n):
                continue
            chosen.append(mesh_axis)
            size *= n
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*spec)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Mapping[str, tuple[str, ...]] = RULES) -> Any:
    """NamedShardings for the parameter pytree."""
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    return jax.tree.map(lambda shape, axes: NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules)),
                        param_shapes(cfg), param_axes(cfg), is_leaf=is_shape)


def activation_constrainer(mesh: Mesh, rules: Mapping[str, tuple[str, ...]] = RULES):
    """The function :func:`olmax.model.logical.activation_sharding` takes: logical activation axes
    -> ``with_sharding_constraint`` on ``mesh`` (a mesh axis that does not divide a dimension is
    dropped from it, as for parameters)."""

    def constrain(x: jax.Array, axes: tuple) -> jax.Array:
        spec = logical_to_spec(axes, x.shape, mesh, rules)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return constrain


def activation_splitter(mesh: Mesh, rules: Mapping[str, tuple[str, ...]] = RULES):
    """The function :func:`olmax.model.logical.activation_parts` takes: ``(name, size)`` -> the
    number of devices :func:`activation_constrainer` splits such a dimension over."""

    def parts(name: str, size: int) -> int:
        spec = logical_to_spec((name,), (size,), mesh, rules)[0]
        axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
        return math.prod(dict(mesh.shape)[a] for a in axes)

    return parts


def per_device_runner(mesh: Mesh, rules: Mapping[str, tuple[str, ...]] = RULES):
    """The runner :func:`olmax.model.logical.per_device_kernels` takes: a ``shard_map`` over
    ``mesh`` with each input split by its logical axes. A dimension that is split for some inputs
    but not all (GQA key heads that ``tensor`` does not divide) is kept whole for all of them, so
    that the kernel sees matching parts (query head h with key head h // group)."""

    def run(fn, arrays: tuple, axes: tuple):
        specs = [tuple(logical_to_spec(a, x.shape, mesh, rules)) + (None,) * (x.ndim - len(a))
                 for x, a in zip(arrays, axes)]
        for d in range(max(len(s) for s in specs)):
            if len({s[d] for s in specs if d < len(s)}) > 1:
                specs = [s[:d] + (None,) + s[d + 1:] if d < len(s) else s for s in specs]
        specs = [P(*s) for s in specs]
        return jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=specs[0],
                             check_vma=False)(*arrays)

    return run


@contextlib.contextmanager
def placed_on(mesh: Mesh | None) -> Iterator[None]:
    """Trace model code with its activations placed on ``mesh``: the logical constraints
    (:func:`activation_constrainer`) and the per-device kernel runner (:func:`per_device_runner`).
    Without a mesh, nothing is constrained."""
    if mesh is None:
        yield
        return
    with activation_sharding(activation_constrainer(mesh)), \
            activation_parts(activation_splitter(mesh)), per_device_kernels(per_device_runner(mesh)):
        yield


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over ``data x fsdp``; other dimensions replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def like_params_shardings(abstract_tree: Any, abstract_params: Any, params_shardings: Any,
                          mesh: Mesh) -> Any:
    """Shardings for a pytree (e.g. optimizer state) whose sub-trees mirror the parameters.

    A leaf whose key path ends with a parameter's key path and has that parameter's shape gets the
    parameter's sharding (Adam's ``mu``/``nu``); every other leaf (counters, skip windows) is
    replicated.
    """
    flat_params = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    flat_shard = jax.tree.leaves(params_shardings)
    by_path = {tuple(map(str, path)): (leaf.shape, sh)
               for (path, leaf), sh in zip(flat_params, flat_shard)}
    lengths = sorted({len(p) for p in by_path}, reverse=True)

    def pick(path, leaf):
        keys = tuple(map(str, path))
        for n in lengths:
            hit = by_path.get(keys[-n:]) if len(keys) >= n else None
            if hit is not None and tuple(hit[0]) == tuple(getattr(leaf, "shape", ())):
                return hit[1]
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, abstract_tree)
