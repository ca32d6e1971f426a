"""Context parallelism: each sequence split over ``mesh.context`` devices gives the losses of one
device, each device holds 1/context of the activations and computes attention for its own queries.

On the mesh tier's 8 CPU devices (tests/conftest.py): 10 steps of a
tiny OLMo 3 (GQA, 128 positions, a full-attention layer and windows of 8 and 12: on context 8 a
device holds two chunks of 8 positions, so the windows of 8 take the halo exchange and the window
of 12 the all-gather; on context 4 both windows fit a chunk of 16) on 1 device, on context 8, and
on context 4 x fsdp 2 (gathering one key head at a time), with the xla attention, and on packed
documents (intra-document masking, documents across the devices' chunks) with the chunked
attention and the tpu profile's splash (Pallas, interpreted on CPU). xla and splash split the
attention (load-balanced zig-zag layout, :mod:`olmax.model.attention_cp`); chunked keeps whole
sequences. The compiled step of splash on context 8 is read for its collectives, the per-device
kernel's shape and its query positions. Then the split splash kernel on bigger blocks (several
query and key blocks per device) against the reference, and ``olmax plan``'s per-device memory of
the step on 8 devices for context 1, 2, 4 and 8 at the same rows per device.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib._hlo import HloPrintOptions

from helpers.sharded import run_steps
from olmax.config import MeshConfig, OptimConfig, RunConfig, SchedulerConfig, TrainConfig
from olmax.model.attention_cp import from_zigzag, to_zigzag
from olmax.model.attention_ref import xla_attention
from olmax.model.olmo3 import seq_chunks, seq_unchunks
from olmax.model.splash import parse_scope, splash_attention
from olmax.parallel.mesh import make_mesh
from olmax.parallel.sharding import placed_on
from olmax.perf.plan import plan
from olmax.train.optim import skip_step_adamw
from olmax.train.schedules import build_schedule
from olmax.train.step import build_sharded_training
from helpers.tiny import small_cfg


T = 128
CFG = small_cfg(vocab_size=250, padded_vocab_size=256, window_pattern=(8, 12, 8, None), max_seq_len=4096)
MESHES = {"1": (MeshConfig(fsdp=1), 1), "ctx8": (MeshConfig(fsdp=1, context=8), 8),
          "ctx4_fsdp2": (MeshConfig(fsdp=2, context=4), 8)}
PROFILE = {"xla": "cpu", "chunked": "cpu", "splash": "tpu"}


def _doc_lens(step):   # 1 to 4 documents per row, some across the devices' chunks
    out = np.zeros((4, 5), np.int32)
    r = np.random.default_rng(step)
    for row in range(4):
        cuts = np.sort(r.choice(np.arange(1, T), r.integers(0, 4), replace=False))
        lens = np.diff(np.concatenate([[0], cuts, [T]]))
        out[row, :len(lens)] = lens
    return out


def _collectives(text):   # (op, result shape) -> count, over the compiled step
    found = re.findall(r"= (\w+\[[\d,]*\])(?:\{[^}]*\})? (all-gather|collective-permute)(?:-start)?\(", text)
    return {f"{op} {shape}": found.count((shape, op)) for shape, op in set(found)}


def _train(attn: str) -> dict:
    """10 steps with ``attn`` on 1 device, on context 8 and on context 4 x fsdp 2; for splash, the
    compiled step on context 8 too."""
    assert jax.device_count() == 8
    tx = skip_step_adamw(OptimConfig(lr=5e-3))
    sched = build_schedule(SchedulerConfig(warmup_steps=2), 5e-3, 10)
    rng = np.random.default_rng(0)
    batches = [np.minimum(rng.geometric(0.05, size=(4, T)), 249).astype(np.int32) for _ in range(10)]
    train = TrainConfig(seq_len=T, global_batch_size=4, max_steps=10, attn_impl=attn, profile=PROFILE[attn])
    out = {}
    for name, (mcfg, n) in MESHES.items():
        mesh = make_mesh(mcfg, jax.devices()[:n])
        # context 4 x fsdp 2 gathers the keys and values of one key head at a time
        stride = 1 if name == "ctx4_fsdp2" else None
        st = build_sharded_training(CFG, dataclasses.replace(train, context_head_stride=stride),
                                    tx, mesh, jax.random.key(0))
        hosts = [{"tokens": toks, "instance_mask": np.ones(4, bool),   # packed documents too:
                  **({} if attn == "xla" else {"doc_lens": _doc_lens(s)})}
                 for s, toks in enumerate(batches, start=1)]
        state, m = run_steps(st, hosts, sched)
        out[name] = {"losses": m["loss"], "embed_spec": str(state.params["embed"].sharding.spec)}
        if (attn, name) == ("splash", "ctx8"):   # the compiled step (jit's cached executable)
            batch = {k: jax.device_put(v, st.batch_shardings[k]) for k, v in hosts[0].items()}
            compiled = st.step_fn.lower(state, batch, np.float32(0.0)).compile()
            opts = HloPrintOptions.short_parsable()
            opts.print_large_constants = True
            text = compiled.runtime_executable().hlo_modules()[0].to_string(opts)
            tables = re.findall(r"s32\[8,128\]\{1,0\} constant\(\{ (.*?) \}\)", text)
            meta = compiled.as_text()                # with op_name metadata
            out["hlo"] = {"collectives": _collectives(meta),
                          "scopes": sorted(set(re.findall(r"olmax_splash_\w+?_cp\d+(?:halo|gather)", meta))),
                          "q_tables": [[[int(x) for x in row.strip(" {}").split(",")]
                                        for row in t.split("}, {")] for t in tables]}
    return out


@pytest.mark.mesh
@pytest.mark.slow
@pytest.mark.own_unit
@pytest.mark.parametrize("attn", ["xla", "chunked", "splash"])
def test_context_parallel_losses_equal_one_device(attn):
    out = _train(attn)
    ref = np.array(out["1"]["losses"])
    assert ref[-1] < ref[0]
    for name in ("ctx8", "ctx4_fsdp2"):
        got = np.array(out[name]["losses"])
        print(attn, name, "max relative loss difference vs 1 device:", np.max(np.abs(got - ref) / ref))
        np.testing.assert_allclose(got, ref, rtol=1e-6)
    # parameters and optimizer state are sharded over fsdp x context
    assert "context" in out["ctx8"]["embed_spec"]
    assert "fsdp" in out["ctx4_fsdp2"]["embed_spec"]
    if attn != "splash":
        return
    # The compiled step of splash on context 8 (4 rows per device, 2 key heads of 8, T = 128 in
    # 16 chunks of 8). (a) The sliding layers of window 8 fetch only 8 positions of keys and values
    # from each neighbour (collective-permutes, forward and backward), and only the two layers that
    # need the whole sequence (window 12 > a chunk, full attention) all-gather keys and values.
    hlo = out["hlo"]
    coll = hlo["collectives"]
    print("collectives of the compiled step (context 8):", coll)
    halo = coll.get("collective-permute f32[4,8,2,8]", 0)
    assert halo >= 2 * 2 * 2, coll          # 2 halo layers x (k, v) x 2 neighbours, forward
    assert coll.get("all-gather f32[4,128,2,8]", 0) == 2 * 2, coll
    assert coll.get("collective-permute s32[4,8]", 0) >= 2, coll   # the halos' segment ids
    # (b) each device's kernel has T / context = 16 queries: against the 2 x (8 + 8) positions of
    # its halo layout, or the gathered 128
    print("splash calls:", hlo["scopes"])
    scopes = [parse_scope(x) for x in hlo["scopes"]]
    assert {(s["t"], s["window"], s["kv_len"], s["halo"]) for s in scopes} == {
        (16, 8, 32, True), (16, 12, 128, False), (16, None, 128, False)}
    assert all(s["context"] == 8 for s in scopes)
    # (c) load-balanced: device d's queries (the kernel's query-position table, one row per
    # device; padded rows repeat the last query) are chunks d and 15 - d
    assert hlo["q_tables"], "no query-position table in the compiled step"
    for table in hlo["q_tables"]:
        for d, row in enumerate(table):
            assert row[:16] == list(range(8 * d, 8 * d + 8)) + list(range(8 * (15 - d), 8 * (16 - d)))
            assert set(row[16:]) == {row[15]}


@pytest.mark.mesh
@pytest.mark.slow
@pytest.mark.own_unit
def test_split_splash_with_several_blocks_per_device_equals_the_reference():
    """The split splash kernel with several query and key blocks per device (context 2, blocks of
    128): output and gradients equal XLA's reference attention."""
    mesh2 = make_mesh(MeshConfig(fsdp=1, context=2), jax.devices()[:2])
    ks = jax.random.split(jax.random.key(1), 4)
    q, ct = (jax.random.normal(ks[i], (1, 512, 4, 16)) for i in (0, 3))
    k, v = (jax.random.normal(ks[i], (1, 512, 2, 16)) for i in (1, 2))
    seg = jnp.asarray(np.repeat(np.arange(4), [100, 200, 150, 62])[None], jnp.int32)

    def split(q, k, v, w):
        with placed_on(mesh2):
            o = splash_attention(*(to_zigzag(x, 2) for x in (q, k, v)), w, 0.25, to_zigzag(seg, 2),
                                 block_size=128, context=2)
        return from_zigzag(o, 2)

    errors = {}
    with jax.default_matmul_precision("highest"):
        for w in (100, 160, None):   # halo (window <= chunk of 128), gather, causal
            def out_and_grads(fn, q, k, v, c):
                o, vjp = jax.vjp(fn, q, k, v)
                return [o, *vjp(c)]
            got = jax.jit(lambda *a, w=w: out_and_grads(lambda *x: split(*x, w), *a))(q, k, v, ct)
            ref = out_and_grads(lambda *x, w=w: xla_attention(*x, w, 0.25, seg), q, k, v, ct)
            errors[w] = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, ref)]
    print("split splash vs xla, blocks of 128 (out, dq, dk, dv):", errors)
    for w, errs in errors.items():
        assert max(errs) <= 1e-5, (w, errs)


@pytest.mark.mesh
def test_split_splash_in_bf16_under_highest_precision():
    """The split splash kernel in bf16, called under ``jax.default_matmul_precision("highest")``
    (its kernels are traced at the default: Mosaic refuses bf16 products at highest), halo and
    causal layouts: output and gradients no less accurate against the fp32 reference than XLA's
    own bf16 attention, within a small factor."""
    mesh2 = make_mesh(MeshConfig(fsdp=1, context=2), jax.devices()[:2])
    ks = jax.random.split(jax.random.key(1), 4)
    q, ct = (jax.random.normal(ks[i], (1, 512, 4, 16)) for i in (0, 3))
    k, v = (jax.random.normal(ks[i], (1, 512, 2, 16)) for i in (1, 2))
    seg = jnp.asarray(np.repeat(np.arange(4), [100, 200, 150, 62])[None], jnp.int32)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v, ct)]

    def split(q, k, v, w):
        with placed_on(mesh2):
            o = splash_attention(*(to_zigzag(x, 2) for x in (q, k, v)), w, 0.25, to_zigzag(seg, 2),
                                 block_size=128, context=2)
        return from_zigzag(o, 2)

    def out_and_grads(fn, q, k, v, c):
        o, vjp = jax.vjp(fn, q, k, v)
        return [o, *vjp(c)]

    with jax.default_matmul_precision("highest"):
        for w in (100, None):   # halo, causal
            truth = out_and_grads(lambda *x, w=w: xla_attention(*x, w, 0.25, seg), q, k, v, ct)
            got = jax.jit(lambda *a, w=w: out_and_grads(lambda *x: split(*x, w), *a))(*bf)
            xla = out_and_grads(lambda *x, w=w: xla_attention(*x, w, 0.25, seg), *bf)
            for name, a, b, t in zip(("out", "dq", "dk", "dv"), got, xla, truth):
                err = lambda x, t=t: float(jnp.max(jnp.abs(x.astype(jnp.float32) - t)) / jnp.max(jnp.abs(t)))  # noqa: E731
                assert a.dtype == jnp.bfloat16 and err(a) <= 2 * err(b) + 1e-3, (w, name, err(a), err(b))


@pytest.mark.mesh
@pytest.mark.slow
@pytest.mark.own_unit
def test_plan_memory_per_device_falls_with_context():
    """``olmax plan`` of the step on the 8 devices at 2 rows per device: context 1, 2, 4, 8."""
    long = CFG.replace(d_model=64, head_dim=16, mlp_hidden=128)
    plans = {}
    for ctx in (1, 2, 4, 8):
        run = RunConfig(model=long, mesh=MeshConfig(fsdp=8 // ctx, context=ctx),
                        train=TrainConfig(seq_len=1024, global_batch_size=2 * (8 // ctx),
                                          attn_impl="chunked", profile="cpu", remat="full"))
        p = plan(run, None, parts=False)
        plans[ctx] = {"temp_bytes": p.memory["temp_bytes"], "mesh": p.details["mesh"]}
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
