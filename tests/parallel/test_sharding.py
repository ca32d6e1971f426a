"""Logical-axis rules, mesh shapes and optimizer-state shardings (no devices needed)."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from olmax.config import MeshConfig, OptimConfig
from olmax.errors import ConfigError
from olmax.model.params import abstract_params, param_axes, param_shapes
from olmax.model.presets import get_preset
from olmax.parallel.mesh import resolve_mesh_shape
from olmax.parallel.sharding import logical_to_spec
from olmax.train.optim import skip_step_adamw


def _mesh(data=1, fsdp=1, tensor=1):
    return SimpleNamespace(shape={"data": data, "fsdp": fsdp, "tensor": tensor})


def test_mesh_shapes():
    assert resolve_mesh_shape(MeshConfig(), 8) == (1, 8, 1, 1)
    assert resolve_mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 1, 2)
    assert resolve_mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=1), 8) == (4, 2, 1, 1)
    assert resolve_mesh_shape(MeshConfig(fsdp=-1, context=4), 8) == (1, 2, 4, 1)
    with pytest.raises(ConfigError, match="devices"):
        resolve_mesh_shape(MeshConfig(data=3, fsdp=-1), 8)
    with pytest.raises(ConfigError, match="at most one"):
        resolve_mesh_shape(MeshConfig(data=-1, fsdp=-1), 8)
    with pytest.raises(ConfigError, match="available"):
        resolve_mesh_shape(MeshConfig(data=1, fsdp=4, tensor=1), 8)


def test_fsdp_default_shards_every_matrix_on_embed():
    cfg = get_preset("olmo3-7b")
    mesh = _mesh(fsdp=8)
    specs = jax.tree.map(lambda s, a: logical_to_spec(a, s, mesh), param_shapes(cfg), param_axes(cfg),
                         is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
    assert specs["embed"] == P(None, "fsdp")
    assert specs["lm_head"] == P("fsdp", None)
    assert specs["layers"]["q_proj"] == P(None, "fsdp", None)
    assert specs["layers"]["down_proj"] == P(None, None, "fsdp")
    assert specs["layers"]["attn_norm"] == P(None, None)     # norms are replicated
    assert specs["final_norm"] == P(None)


def test_tensor_axis_and_indivisible_dims():
    cfg = get_preset("olmo3-7b")
    mesh = _mesh(data=2, fsdp=4, tensor=2)
    assert logical_to_spec(("vocab", "embed"), (100352, 4096), mesh) == P("tensor", "fsdp")
    assert logical_to_spec(("layers", "embed", "mlp"), (32, 4096, 11008), mesh) == P(None, "fsdp", "tensor")
    # a dimension a mesh axis does not divide stays replicated over it
    assert logical_to_spec(("embed", "vocab"), (12, 100279), _mesh(fsdp=8, tensor=2)) == P(None, None)
    assert logical_to_spec(("batch", None), (16, 32), mesh) == P(("data", "fsdp"), None)
    assert cfg.d_model % 4 == 0


def test_optimizer_moments_follow_their_parameters():
    from jax.sharding import Mesh, NamedSharding

    from olmax.parallel.sharding import like_params_shardings

    cfg = get_preset("olmo3-1m")
    mesh = Mesh([[[jax.devices()[0]]]], ("data", "fsdp", "tensor"))
    abs_p = abstract_params(cfg)
    # distinct fake shardings per parameter so that the mapping is observable
    names = {}
    p_sh = jax.tree_util.tree_map_with_path(
        lambda path, _: names.setdefault(jax.tree_util.keystr(path),
                                         NamedSharding(mesh, P(*([None] * len(names))))), abs_p)
    tx = skip_step_adamw(OptimConfig())
    abs_opt = jax.eval_shape(tx.init, abs_p)
    o_sh = like_params_shardings(abs_opt, abs_p, p_sh, mesh)
    adam = o_sh.inner[0]
    assert jax.tree.leaves(adam.mu) == jax.tree.leaves(p_sh)
    assert jax.tree.leaves(adam.nu) == jax.tree.leaves(p_sh)
    assert o_sh.window.losses.spec == P()


def test_a_rows_devices_share_one_process():
    """Context (and tensor) groups hold the same rows: each must lie within one process."""
    from types import SimpleNamespace

    from olmax.parallel.mesh import check_rows_per_process

    # 2 processes x 4 devices, mesh (data 1, fsdp 2, context 4, tensor 1): a context group a process
    grid = np.array([SimpleNamespace(process_index=i // 4) for i in range(8)], dtype=object)
    check_rows_per_process(grid.reshape(1, 2, 4, 1))
    # context 8 over both processes: refused, naming the way out
    with pytest.raises(ConfigError, match=r"span processes \[0, 1\].*--processes-per-node 1"):
        check_rows_per_process(grid.reshape(1, 1, 8, 1))
