"""1 device vs 8 devices (FSDP 8, and data 2 x fsdp 2 x tensor 2): the same losses and parameters.

Meshes are built over 1 and 8 of the process's 8 CPU devices (the mesh tier: tests/conftest.py),
with different micro-batch counts (8, 1 and 2 micro-batches).
"""

from functools import cache

import jax
import numpy as np
import pytest

from helpers.sharded import run_steps
from olmax.config import MeshConfig, OptimConfig, SchedulerConfig, TrainConfig
from olmax.parallel.mesh import make_mesh
from olmax.train.optim import skip_step_adamw
from olmax.train.schedules import build_schedule
from olmax.train.step import build_sharded_training
from helpers.tiny import small_cfg

pytestmark = pytest.mark.mesh

CFG = small_cfg(vocab_size=250, padded_vocab_size=256, window_pattern=(8, 8, 8, None), max_seq_len=32)
MESHES = {"1": (MeshConfig(fsdp=1), 1), "fsdp8": (MeshConfig(), 8),
          "2x2x2": (MeshConfig(data=2, fsdp=2, tensor=2), 8)}


@cache
def _run_mesh(name: str, attn: str = "xla", steps: int = 5, micro: int = 2, by_layer: bool = True) -> dict:
    train = TrainConfig(seq_len=32, global_batch_size=16, micro_batch_size=micro, max_steps=5, attn_impl=attn,
                        accumulate_by_layer=by_layer)
    tx = skip_step_adamw(OptimConfig(lr=5e-3))
    sched = build_schedule(SchedulerConfig(warmup_steps=2), 5e-3, 5)
    rng = np.random.default_rng(0)
    batches = [np.minimum(rng.geometric(0.05, size=(16, 32)), 249).astype(np.int32) for _ in range(steps)]
    mcfg, n = MESHES[name]
    st = build_sharded_training(CFG, train, tx, make_mesh(mcfg, jax.devices()[:n]), jax.random.key(0))
    state, m = run_steps(st, [{"tokens": toks, "instance_mask": np.ones(16, bool)} for toks in batches],
                         sched)
    emb = state.params["embed"]
    return {"losses": m["loss"], "n_micro": st.n_micro,
            "n_shards": len({d.id for d in emb.sharding.device_set}),
            "embed_spec": str(emb.sharding.spec),
            "params": [np.asarray(x).ravel()[:4096] for x in jax.tree.leaves(state.params)]}


def _run(*meshes, attn: str = "xla", steps: int = 5) -> dict:
    assert jax.device_count() == 8
    return {name: _run_mesh(name, attn, steps) for name in meshes}


def _compare(out, names):
    ref = np.array(out["1"]["losses"])
    assert ref[-1] < ref[0]
    for k in names:
        got = np.array(out[k]["losses"])
        print(k, "max relative loss difference vs 1 device:", np.max(np.abs(got - ref) / ref))
        np.testing.assert_allclose(got, ref, rtol=1e-5)
        for a, b in zip(out[k]["params"], out["1"]["params"]):
            np.testing.assert_allclose(a, b, atol=2e-5)


def test_one_vs_eight_devices_fsdp_same_losses():
    out = _run("1", "fsdp8")
    assert [out[k]["n_micro"] for k in ("1", "fsdp8")] == [8, 1]
    assert out["fsdp8"]["n_shards"] == 8 and "fsdp" in out["fsdp8"]["embed_spec"]
    _compare(out, ["fsdp8"])


@pytest.mark.parametrize("name", ["fsdp8", pytest.param("2x2x2", marks=pytest.mark.slow)])
def test_per_layer_accumulation_on_a_mesh_trains_as_the_stacked_one(name):
    """Micro-batches on 8 devices (fsdp 8: 2 per device; data x fsdp x tensor: 4): each layer's
    gradients placed like its weights, summed per layer, then stacked -- the stacked
    accumulation's losses and parameters, to fp32 rounding (on one device they are equal bit
    for bit: tests/train/test_accumulate_by_layer.py; the two partitioned programs' parameters
    differ by 3e-7 at most on fsdp 8)."""
    by_layer, stacked = (_run_mesh(name, micro=1, by_layer=flag) for flag in (True, False))
    assert by_layer["n_micro"] == stacked["n_micro"] == {"fsdp8": 2, "2x2x2": 4}[name]
    np.testing.assert_allclose(by_layer["losses"], stacked["losses"], rtol=1e-6)
    for a, b in zip(by_layer["params"], stacked["params"]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_one_vs_data_fsdp_tensor_mesh_same_losses():
    out = _run("1", "2x2x2")
    assert out["2x2x2"]["n_micro"] == 2 and "tensor" in out["2x2x2"]["embed_spec"]
    _compare(out, ["2x2x2"])


@pytest.mark.tpu
@pytest.mark.slow
def test_splash_per_device_on_data_fsdp_tensor_mesh():
    """The splash kernel (Pallas interpret mode on CPU) runs once per device in a shard_map: batch
    over data x fsdp, query and key heads over tensor (4q/2kv: each device keeps matching GQA
    groups). Same losses and parameters as one device."""
    out = _run("1", "2x2x2", attn="splash", steps=3)
    assert out["2x2x2"]["n_micro"] == 2
    _compare(out, ["2x2x2"])
