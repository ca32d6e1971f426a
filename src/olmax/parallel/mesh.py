"""The device mesh: axes ``(data, fsdp, context, tensor)`` from :class:`olmax.config.MeshConfig`.

``data`` replicates parameters (pure data parallelism, e.g. across slices/nodes), ``fsdp`` shards
parameters and optimizer state and splits the batch (ZeRO-3 style), ``context`` splits each
sequence (context parallelism: activations hold 1/context of the positions; parameters and optimizer
state are sharded over ``fsdp x context``), ``tensor`` shards the heads/MLP/vocabulary dimensions.
The batch rows are split over ``data x fsdp``. One size may be -1 (all remaining devices); the
default ``data=1, fsdp=-1, context=1, tensor=1`` is FSDP over every device.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from olmax.config import MeshConfig
from olmax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "context", "tensor")
BATCH_AXES = ("data", "fsdp")


def resolve_mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int, int]:
    """The (data, fsdp, context, tensor) sizes of ``cfg`` over ``n_devices`` (MeshConfig checked
    its own values; this checks them against the device count)."""
    sizes = [cfg.data, cfg.fsdp, cfg.context, cfg.tensor]
    free = [i for i, s in enumerate(sizes) if s == -1]
    fixed = math.prod(s for s in sizes if s != -1)
    if free:
        if n_devices % fixed:
            raise ConfigError(f"mesh: {n_devices} devices are not divisible by the fixed axes "
                              f"(product {fixed})")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes) != n_devices:
        raise ConfigError(f"mesh: data*fsdp*context*tensor = {math.prod(sizes)} but {n_devices} "
                          f"devices are available")
    return tuple(sizes)  # type: ignore[return-value]


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A GSPMD (``AxisType.Auto``) mesh over ``devices`` (default: all devices), in the physical
    order JAX gives a TPU slice (rings along the torus, a chip's two cores next to each other), the
    same for a slice's real devices and for its ahead-of-time topology; devices JAX cannot place
    (an arbitrary subset) keep the order given. Devices of several TPU slices: the ``data`` axis
    runs across the slices (the data-center network), the rest within each slice."""
    devices = list(devices) if devices is not None else jax.devices()
    shape = resolve_mesh_shape(cfg, len(devices))
    types = (AxisType.Auto,) * len(MESH_AXES)
    grid = multislice_grid(shape, devices)
    if grid is not None:
        return Mesh(grid, MESH_AXES, axis_types=types)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=types)


def multislice_grid(shape: tuple[int, ...], devices: Sequence) -> np.ndarray | None:
    """The device grid of ``shape`` over devices of several TPU slices (``slice_index``), the data
    axis across slices; None when the devices are one slice."""
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices == 1:
        return None
    if shape[0] % slices:
        raise ConfigError(f"mesh.data {shape[0]} must be a multiple of the {slices} slices "
                          "(the data axis runs across slices)")
    return mesh_utils.create_hybrid_device_mesh((shape[0] // slices, *shape[1:]),
                                                (slices,) + (1,) * (len(shape) - 1), devices,
                                                allow_split_physical_axes=True)


def data_parallel_size(mesh: Mesh) -> int:
    return int(math.prod(mesh.shape[a] for a in BATCH_AXES))


def context_size(mesh: Mesh | None) -> int:
    """How many devices share each sequence (1 without context parallelism or a mesh)."""
    return 1 if mesh is None else int(dict(mesh.shape).get("context", 1))


def check_rows_per_process(devices: np.ndarray) -> None:
    """Each process reads only its own rows of a batch (``TrainData.host_batch``), so every device
    that holds a block of rows -- one (data, fsdp) coordinate: its context and tensor devices --
    must belong to one process. ``devices``: the mesh's device grid, axes :data:`MESH_AXES`."""
    groups = np.asarray(devices).reshape(devices.shape[0] * devices.shape[1], -1)
    for group in groups:
        processes = sorted({d.process_index for d in group})
        if len(processes) > 1:
            raise ConfigError(f"mesh: a row's devices (mesh.context x mesh.tensor = {group.size}) "
                              f"span processes {processes}; run one process per node "
                              "(olmax launch --processes-per-node 1) or a smaller mesh.context")
