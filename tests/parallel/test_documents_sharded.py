"""Packed batches (``doc_lens``) on a mesh: the sharded training step (8 host devices: FSDP 8, and
data 2 x fsdp 2 x tensor 2) gives the losses of the single-device step, with the segment ids
placed by rows like the tokens. A batch without ``doc_lens`` still runs through the same jitted step.

On the mesh tier's 8 CPU devices (tests/conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import MeshConfig, OptimConfig, TrainConfig
from olmax.model.params import init_params
from olmax.parallel.mesh import make_mesh
from olmax.train.optim import skip_step_adamw
from olmax.train.state import init_train_state
from olmax.train.step import build_sharded_training, make_train_step
from helpers.tiny import small_cfg

pytestmark = [pytest.mark.mesh, pytest.mark.slow]     # two 8-device runs: about 30 s

CFG = small_cfg(n_layers=2, vocab_size=250, padded_vocab_size=256, window_pattern=(8, None), max_seq_len=32)


def _batches() -> list[dict]:
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        lens = np.zeros((16, 4), np.int32)
        for r in range(16):
            cuts = np.sort(rng.choice(np.arange(1, 32), size=rng.integers(0, 4), replace=False))
            lens[r, :len(cuts) + 1] = np.diff(np.concatenate([[0], cuts, [32]]))
        toks = np.minimum(rng.geometric(0.05, size=(16, 32)), 249).astype(np.int32)
        batches.append({"tokens": toks, "instance_mask": np.ones(16, bool), "doc_lens": lens})
    return batches


def _run(attn: str) -> dict:
    """The losses of one device (8 micro-batches) and of two 8-device meshes."""
    assert jax.device_count() == 8
    train = TrainConfig(seq_len=32, global_batch_size=16, micro_batch_size=2, max_steps=3, attn_impl=attn)
    tx = skip_step_adamw(OptimConfig(lr=5e-3))
    batches = _batches()
    params = init_params(CFG, jax.random.key(0))
    step = jax.jit(make_train_step(CFG, train, tx, n_micro=8))
    state = init_train_state(params, tx)
    out = {"1": []}
    for b in batches:
        state, m = step(state, jax.tree.map(jnp.asarray, b), np.float32(5e-3))
        out["1"].append(float(m["loss"]))
    plain = {k: v for k, v in batches[0].items() if k != "doc_lens"}
    for name, mcfg in (("fsdp8", MeshConfig()), ("2x2x2", MeshConfig(data=2, fsdp=2, tensor=2))):
        st = build_sharded_training(CFG, train, tx, make_mesh(mcfg, jax.devices()), jax.random.key(0))
        state = st.fresh_state(params)
        out[name] = []
        for b in [*batches, plain]:
            placed = {k: jax.device_put(v, st.batch_shardings[k]) for k, v in b.items()}
            state, m = st.step_fn(state, placed, np.float32(5e-3))
            out[name].append(float(m["loss"]))
    return out


@pytest.mark.parametrize("attn", ["chunked", "splash"])
def test_documents_on_a_mesh_give_single_device_losses(attn):
    """``splash`` runs per device (shard_map over batch and heads, the segment ids with the batch)."""
    out = _run(attn)
    ref = np.array(out["1"])
    for name in ("fsdp8", "2x2x2"):
        got = np.array(out[name])
        print(f"{attn} {name}: max relative loss difference {np.max(np.abs(got[:3] - ref) / ref):.2e}")
        np.testing.assert_allclose(got[:3], ref, rtol=1e-5)
        assert np.isfinite(got[3])          # a batch without doc_lens: same jitted step
