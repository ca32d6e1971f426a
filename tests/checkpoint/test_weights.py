"""olmax.checkpoint.weights: the step-dir checkpoint layout shared with training."""

import json
import os

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import to_dict
from olmax.errors import OlmaxError
from olmax.model import param_shapes
from olmax.checkpoint.format import resolve_step_dir
from olmax.checkpoint.weights import load_meta, load_model_config, load_params, save_params
from helpers.tiny import narrow_cfg

CFG = narrow_cfg(vocab_size=100, padded_vocab_size=128, window_pattern=(4, None))


@pytest.fixture(scope="module")
def params():
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32),
                        param_shapes(CFG), is_leaf=lambda x: isinstance(x, tuple))


def _equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_save_and_load_step_run_and_checkpoints_dirs(tmp_path, params):
    run = tmp_path / "run"
    save_params(run / "checkpoints" / "5", params, CFG, extra_meta={"step": 5})
    save_params(run / "checkpoints" / "20", params, CFG, extra_meta={"step": 20})
    (run / "checkpoints" / "30.orbax-checkpoint-tmp-1").mkdir()  # an unfinished save
    (run / "checkpoints" / "40").mkdir()  # no params/meta: incomplete
    for path in (run, run / "checkpoints", run / "checkpoints" / "20"):
        assert resolve_step_dir(path) == run / "checkpoints" / "20"
        loaded, cfg = load_params(path)
        assert cfg == CFG and _equal(loaded, params)
        assert loaded["layers"]["q_proj"].dtype == jnp.float32
    meta = load_meta(run)
    assert meta["step"] == 20 and meta["format_version"] == 1 and meta["model"] == to_dict(CFG)
    assert load_model_config(run / "checkpoints" / "5") == CFG


def test_dtype_cast_on_restore(tmp_path, params):
    save_params(tmp_path / "ck", params, CFG)
    loaded, _ = load_params(tmp_path / "ck", dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(loaded))
    assert _equal(loaded, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))


def test_refuses_non_empty_and_replaces_empty_dirs(tmp_path, params):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(OlmaxError, match="not empty"):
        save_params(tmp_path / "full", params, CFG)
    assert os.listdir(tmp_path / "full") == ["x"]
    (tmp_path / "empty").mkdir()
    save_params(tmp_path / "empty", params, CFG)
    assert load_model_config(tmp_path / "empty") == CFG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full"]  # no temp dirs left


def test_mismatched_checkpoints_are_one_line_errors(tmp_path, params):
    bigger = CFG.replace(mlp_hidden=48)
    save_params(tmp_path / "ck", params, CFG)
    meta_file = tmp_path / "ck" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "model": to_dict(bigger)}))
    expected = r"down_proj' has shape \[2, 32, 16\], the model config implies \[2, 48, 16\]"
    with pytest.raises(OlmaxError, match=expected) as e:
        load_params(tmp_path / "ck")
    assert "\n" not in str(e.value)
    meta_file.write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(OlmaxError, match="format_version 99"):
        load_params(tmp_path / "ck")
    with pytest.raises(OlmaxError, match="not found"):
        load_params(tmp_path / "nowhere")
    with pytest.raises(OlmaxError, match="no olmax checkpoint"):
        load_params(tmp_path)


@pytest.mark.mesh
def test_restore_onto_another_device_layout(tmp_path, params):
    """Saved from one device, restored sharded over the mesh tier's 8 devices."""
    assert len(params["layers"]["q_proj"].sharding.device_set) == 1
    save_params(tmp_path / "ck", params, CFG)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    cfg = load_model_config(tmp_path / "ck")
    shard = jax.tree.map(lambda s: NamedSharding(mesh, P(*([None] * (len(s) - 1) + ["fsdp"]))
                                                 if s[-1] % 8 == 0 else P()),
                         param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    restored, _ = load_params(tmp_path / "ck", shardings=shard)
    q = restored["layers"]["q_proj"]
    assert len(q.sharding.device_set) == 8, q.sharding
    assert q.addressable_shards[0].data.shape == (2, 16, 2)
    assert np.array_equal(np.asarray(q), np.asarray(params["layers"]["q_proj"]))
