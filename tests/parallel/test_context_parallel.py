"""Context parallelism: each sequence split over ``mesh.context`` devices gives the losses of one
device, and each device holds 1/context of the activations.

Runs in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``: 10 steps of a
tiny OLMo 3 (GQA, windows of 8 shorter than a device's block of positions, a full-attention layer)
on 1 device, on context 8, and on context 4 x fsdp 2, with the xla attention, and on packed
documents (intra-document masking, documents across the devices' blocks) with the chunked attention
and the tpu profile's splash (Pallas, interpreted on CPU); then
``olmax plan``'s per-device memory of the step on 8 devices for context 1, 2, 4 and 8 at the same
rows per device.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from olmax.model.olmo3 import seq_chunks, seq_unchunks

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np, jax
    from olmax.config import (MeshConfig, ModelConfig, OptimConfig, RunConfig, SchedulerConfig,
                              TrainConfig)
    from olmax.parallel.mesh import make_mesh
    from olmax.perf.plan import plan
    from olmax.train.optim import skip_step_adamw
    from olmax.train.schedules import build_schedule
    from olmax.train.step import build_sharded_training
    from helpers.sharded import run_steps

    assert jax.device_count() == 8
    cfg = ModelConfig(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=64,
                      vocab_size=250, padded_vocab_size=256, window_pattern=(8, 8, 8, None),
                      max_seq_len=4096)
    tx = skip_step_adamw(OptimConfig(lr=5e-3))
    sched = build_schedule(SchedulerConfig(warmup_steps=2), 5e-3, 10)
    rng = np.random.default_rng(0)
    batches = [np.minimum(rng.geometric(0.05, size=(4, 64)), 249).astype(np.int32) for _ in range(10)]

    def doc_lens(step):   # 1 to 4 documents per row, some across the devices' blocks of 8
        out = np.zeros((4, 5), np.int32)
        r = np.random.default_rng(step)
        for row in range(4):
            cuts = np.sort(r.choice(np.arange(1, 64), r.integers(0, 4), replace=False))
            lens = np.diff(np.concatenate([[0], cuts, [64]]))
            out[row, :len(lens)] = lens
        return out
    meshes = {"1": (MeshConfig(fsdp=1), 1), "ctx8": (MeshConfig(fsdp=1, context=8), 8),
              "ctx4_fsdp2": (MeshConfig(fsdp=2, context=4), 8)}
    out = {}
    for attn, profile in (("xla", "cpu"), ("chunked", "cpu"), ("splash", "tpu")):
        train = TrainConfig(seq_len=64, global_batch_size=4, max_steps=10, attn_impl=attn, profile=profile)
        for name, (mcfg, n) in meshes.items():
            mesh = make_mesh(mcfg, jax.devices()[:n])
            st = build_sharded_training(cfg, train, tx, mesh, jax.random.key(0))
            hosts = [{"tokens": toks, "instance_mask": np.ones(4, bool),   # packed documents too:
                      **({} if attn == "xla" else {"doc_lens": doc_lens(s)})}
                     for s, toks in enumerate(batches, start=1)]
            state, m = run_steps(st, hosts, sched)
            out[f"{attn}/{name}"] = {"losses": m["loss"], "embed_spec": str(state.params["embed"].sharding.spec)}
    # olmax plan of the step on the 8 devices at 2 rows per device: context 1, 2, 4, 8
    long = cfg.replace(d_model=64, head_dim=16, mlp_hidden=128)
    out["plan"] = {}
    for ctx in (1, 2, 4, 8):
        run = RunConfig(model=long, mesh=MeshConfig(fsdp=8 // ctx, context=ctx),
                        train=TrainConfig(seq_len=1024, global_batch_size=2 * (8 // ctx),
                                          attn_impl="chunked", profile="cpu", remat="full"))
        p = plan(run, None, parts=False)
        out["plan"][ctx] = {"temp_bytes": p.memory["temp_bytes"], "mesh": p.details["mesh"]}
    json.dump(out, sys.stdout)
""")


def _run() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join(sys.path),   # helpers.sharded
               JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_context_parallel_losses_equal_one_device_and_memory_scales():
    out = _run()
    for attn in ("xla", "chunked", "splash"):
        ref = np.array(out[f"{attn}/1"]["losses"])
        assert ref[-1] < ref[0]
        for name in ("ctx8", "ctx4_fsdp2"):
            got = np.array(out[f"{attn}/{name}"]["losses"])
            print(attn, name, "max relative loss difference vs 1 device:",
                  np.max(np.abs(got - ref) / ref))
            np.testing.assert_allclose(got, ref, rtol=1e-6)
        # parameters and optimizer state are sharded over fsdp x context
        assert "context" in out[f"{attn}/ctx8"]["embed_spec"]
        assert "fsdp" in out[f"{attn}/ctx4_fsdp2"]["embed_spec"]
    plans = {int(k): v for k, v in out["plan"].items()}
    assert [plans[c]["mesh"]["context"] for c in (1, 2, 4, 8)] == [1, 2, 4, 8]
    mem = {c: p["temp_bytes"] for c, p in plans.items()}
    print("olmax plan, temporary bytes per device by context:", mem)
    # activations scale with 1/context: every doubling of context needs less (at least 1.3x; fixed
    # buffers such as the weights gathered for one layer do not shrink), and context 8 at most
    # a quarter of context 1 (the ideal is an eighth)
    for a, b in ((1, 2), (2, 4), (4, 8)):
        assert mem[b] * 1.3 < mem[a], mem
    assert mem[8] * 4 < mem[1], mem


def test_loss_chunks_take_every_devices_own_positions():
    x = jnp.arange(2 * 24).reshape(2, 24)          # 2 rows of 24 positions, 4 blocks of 6
    y = seq_chunks(x, 2, shards=4)                 # 2 positions of every block per chunk
    assert y.shape == (3, 2, 8)
    assert y[0, 0].tolist() == [0, 1, 6, 7, 12, 13, 18, 19]
    assert y[2, 1].tolist() == [28, 29, 34, 35, 40, 41, 46, 47]
    assert (seq_unchunks(y, 4) == x).all()
    # one shard: consecutive chunks, as without context parallelism
    z = seq_chunks(x, 8)
    assert z.shape == (3, 2, 8) and z[1, 0].tolist() == list(range(8, 16))
    assert (seq_unchunks(z) == x).all()
