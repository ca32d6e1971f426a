"""``attn_impl=splash`` (Pallas splash attention) equals the ``xla`` reference.

On CPU the kernel runs in Pallas interpret mode: the same kernel code, block skipping and online
softmax, executed by XLA. Outputs and gradients (q, k, v) are compared with the reference in fp32
(<= 1e-5 relative) and bf16 (error against an fp32 ground truth no worse than the bf16 reference's
own, within a small factor). The TPU compilation test (Mosaic) is in ``tests/perf/test_plan_tpu.py``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.model.attention import attention
from olmax.model.attention_ref import causal_window_mask
from olmax.model.splash import (block_and_padded_len, kernel_flops, parse_scope, splash_attention,
                                visited_blocks)

pytestmark = pytest.mark.tpu


def _inputs(t, hq, hkv, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (2, t, hq, d), jnp.float32)
    k = jax.random.normal(ks[1], (2, t, hkv, d), jnp.float32)
    v = jax.random.normal(ks[2], (2, t, hkv, d), jnp.float32)
    ct = jax.random.normal(ks[3], (2, t, hq, d), jnp.float32)
    return tuple(x.astype(dtype) for x in (q, k, v)), ct.astype(dtype)


def _out_and_grads(fn, windows, scale):
    """For every window: (output, dq, dk, dv) of ``fn`` under the cotangent ``ct``."""
    def run(q, k, v, ct):
        res = []
        for w in windows:
            out, vjp = jax.vjp(lambda q, k, v, w=w: fn(q, k, v, w, scale), q, k, v)
            res.append((out, *vjp(ct)))
        return res
    return jax.jit(run)


def _rel(a, b):
    """Max abs difference relative to the reference's max magnitude (absolute where the reference
    is exactly zero: dq of a window of 1, whose softmax over one key does not depend on q)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / (scale if scale > 0 else 1.0))


def _splash128(q, k, v, w, scale):  # 128-blocks: a 300-token sequence is a 3 x 3 block grid
    return splash_attention(q, k, v, w, scale, block_size=128)


def _xla(q, k, v, w, scale):
    return attention(q, k, v, w, scale, impl="xla")


@pytest.mark.parametrize("t,hq,hkv,d,windows,fn", [
    (300, 4, 2, 32, (1, 5, 16, 300, None), _splash128),   # GQA, block skipping, windows 1..>=T
    (37, 4, 1, 16, (5, 16, 64), lambda q, k, v, w, s: attention(q, k, v, w, s, impl="splash")),
])
def test_splash_equals_xla_fp32(t, hq, hkv, d, windows, fn):
    (q, k, v), ct = _inputs(t, hq, hkv, d, jnp.float32)
    with jax.default_matmul_precision("highest"):
        got = _out_and_grads(fn, windows, d ** -0.5)(q, k, v, ct)
        ref = _out_and_grads(_xla, windows, d ** -0.5)(q, k, v, ct)
    for w, g, r in zip(windows, got, ref):
        for name, a, b in zip(("out", "dq", "dk", "dv"), g, r):
            assert a.shape == b.shape and a.dtype == jnp.float32
            assert _rel(a, b) <= 1e-5, (w, name, _rel(a, b))


def test_splash_bf16_as_accurate_as_xla_bf16():
    t, hq, hkv, d, windows = 300, 4, 2, 32, (5, 128, None)
    (q, k, v), ct = _inputs(t, hq, hkv, d, jnp.bfloat16, seed=1)
    with jax.default_matmul_precision("highest"):
        truth = _out_and_grads(_xla, windows, d ** -0.5)(
            *(x.astype(jnp.float32) for x in (q, k, v, ct)))
    got = _out_and_grads(_splash128, windows, d ** -0.5)(q, k, v, ct)
    ref = _out_and_grads(_xla, windows, d ** -0.5)(q, k, v, ct)
    for w, g, r, tr in zip(windows, got, ref, truth):
        for name, a, b, c in zip(("out", "dq", "dk", "dv"), g, r, tr):
            assert a.dtype == jnp.bfloat16
            err_splash, err_xla = _rel(a, c), _rel(b, c)
            assert err_splash <= 2 * err_xla + 1e-3, (w, name, err_splash, err_xla)


def test_window_keeps_exactly_w_keys():
    """A value row that only key position p carries shows which queries see p: with window W
    exactly queries p .. p+W-1 (the query itself included) do."""
    t, w, p = 300, 16, 100
    q = jnp.zeros((1, t, 1, 8))                       # uniform scores: each query averages its keys
    k = jnp.zeros((1, t, 1, 8))
    v = jnp.zeros((1, t, 1, 8)).at[0, p, 0, :].set(1.0)
    out = np.asarray(_splash128(q, k, v, w, 1.0))[0, :, 0, 0]
    seen = np.nonzero(out > 0)[0]
    assert seen.tolist() == list(range(p, p + w))
    np.testing.assert_allclose(out[p:p + w], 1.0 / w, rtol=1e-6)
    mask = np.asarray(causal_window_mask(t, t, w))
    assert mask.sum(axis=1)[w:].tolist() == [w] * (t - w)


def test_visited_blocks_and_flops():
    # 8192 tokens in 512-blocks: causal keeps the 136 lower-triangular block pairs; a 4096 window
    # keeps for each of the 16 query blocks the blocks overlapping (q - 4096, q]: 9 blocks each
    # (fewer at the start). In 1,024-blocks (the default): 36 pairs, and 5 blocks each.
    assert block_and_padded_len(8192, 512) == (512, 8192)
    assert block_and_padded_len(8192) == (1024, 8192)
    assert block_and_padded_len(37) == (128, 128)
    assert block_and_padded_len(600, 512) == (512, 1024)
    assert block_and_padded_len(600) == (640, 640)
    assert block_and_padded_len(1100) == (1024, 2048)
    assert visited_blocks(8192, None, 512) == 16 * 17 // 2
    assert visited_blocks(8192, None) == 8 * 9 // 2
    assert visited_blocks(8192, 4096, 512) == sum(min(i, 8) + 1 for i in range(16))
    assert visited_blocks(8192, 4096) == sum(min(i, 4) + 1 for i in range(8)) == 30
    assert visited_blocks(8192, 8192) == visited_blocks(8192, None)
    f = kernel_flops(8192, None, 32, 128, 1, "fwd", 512)
    assert f == 2 * 2 * 512 * 512 * 128 * 136 * 32
    assert kernel_flops(8192, None, 32, 128, 1, "fwd") == 2 * 2 * 1024 * 1024 * 128 * 36 * 32
    assert kernel_flops(8192, None, 32, 128, 1, "dkv", 512) == 2 * f
    # the backward in one kernel: dkv's 4 matmuls and dq's dS K, where the two kernels run 4 + 3
    assert kernel_flops(8192, None, 32, 128, 1, "dkv", 512, fused=True) == 5 * f // 2
    assert kernel_flops(8192, None, 32, 128, 1, "dq", 512, fused=True) == 3 * f // 2
    assert parse_scope("jit(step)/olmax_splash_t8192_wfull_h32_d128_b1_bs512_fused/splash_mha_dkv") == {
        "t": 8192, "window": None, "heads": 32, "head_dim": 128, "batch": 1, "block": 512, "fused": True}
    assert parse_scope("jit(step)/olmax_splash_t8192_w4096_h32_d128_b1_bs512/splash_mha_fwd") == {
        "t": 8192, "window": 4096, "heads": 32, "head_dim": 128, "batch": 1, "block": 512}
    assert parse_scope("olmax_splash_t37_wfull_h4_d16_b2_bs128")["window"] is None


def test_save_policies_keep_the_kernel_outputs():
    """Under ``remat=full`` the backward pass runs the forward kernel again (4 kernel calls per
    layer: forward, its recompute, dq, dkv); ``save_kernels``, ``save_attn`` and ``save_proj``
    keep its output and softmax statistics (3 calls). (``tests/model/test_remat_scan.py`` checks
    that every policy gives the same gradients.)"""
    from olmax.config import ModelConfig
    from olmax.model import olmo3
    from olmax.model.params import abstract_params
    from olmax.model.runtime import Runtime

    cfg = ModelConfig(d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, mlp_hidden=128,
                      vocab_size=100, padded_vocab_size=128, window_pattern=(None,),
                      rope_theta=10_000.0, max_seq_len=128)
    params = abstract_params(cfg)
    tokens = jax.ShapeDtypeStruct((1, 128), jnp.int32)

    def grad(remat):
        runtime = Runtime(attn_impl="splash", remat=remat)
        return jax.grad(lambda p: jnp.sum(olmo3.hidden_states(p, tokens, cfg, runtime) ** 2))

    calls = {r: str(jax.make_jaxpr(grad(r))(params)).count("pallas_call")
             for r in ("full", "save_kernels", "save_attn", "save_proj")}
    assert calls == {"full": 4, "save_kernels": 3, "save_attn": 3, "save_proj": 3}


def test_save_policies_keep_the_kernel_residuals_compact():
    """What a policy keeps of the kernel is its output and one fp32 statistic per query row and
    head, by the residuals' name: the forward kernel writes the statistics 128 lanes wide, and
    keeping its raw outputs kept 128 copies (for ``olmo3-600m`` at 8 x 4096 tokens, libtpu's
    compile for v5e: ``save_kernels`` 25.69 -> 16.28 GiB, ``save_attn`` 29.88 -> 25.35 GiB;
    ``olmo3-370m`` at 16 x 4096, micro-batch 2, ``save_proj`` 16.30 GiB -> fits)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    from olmax.config import ModelConfig
    from olmax.model import olmo3
    from olmax.model.params import abstract_params
    from olmax.model.runtime import Runtime

    b, t, heads, d = 2, 256, 2, 32
    cfg = ModelConfig(d_model=64, n_layers=1, n_heads=heads, n_kv_heads=1, head_dim=d,
                      mlp_hidden=128, vocab_size=100, padded_vocab_size=128,
                      window_pattern=(None,), rope_theta=10_000.0, max_seq_len=t)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_params(cfg))
    tokens = jnp.zeros((b, t), jnp.int32)

    def saved(remat):
        runtime = Runtime(attn_impl="splash", remat=remat, compute_dtype=jnp.bfloat16)

        def f(p):
            return jnp.sum(olmo3.hidden_states(p, tokens, cfg, runtime).astype(jnp.float32))

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(f, params)        # "bf16[1,2,2,256,32] output of ..." a line
        found = [re.match(r"(\w+)\[([\d,]*)\] ", line) for line in out.getvalue().splitlines()
                 if "from a constant" not in line]    # the kernels' mask tables
        return sorted((m[1], tuple(int(x) for x in m[2].split(",") if x)) for m in found if m)

    full, kernels = saved("full"), saved("save_kernels")
    extra = list(kernels)
    for r in full:
        extra.remove(r)
    # what full keeps and, per layer (the scan's leading axis of 1), the output [b, H, T, D] and
    # the statistics [b, H, T]
    assert sorted(extra) == [("bf16", (1, b, heads, t, d)), ("f32", (1, b, heads, t))]
    assert not [r for r in saved("save_attn") if r[1][-2:] == (t, 128)]


def test_the_configured_block_reaches_the_kernel():
    """``train.splash_block`` runs through the runtime into every splash call of the model: the
    compiled program's kernels run 128-blocks (by their named scope), the outputs equal the
    reference's, and the default block is splash's own; a block that is not a multiple of 128 is
    one line."""
    from olmax.errors import ConfigError
    from olmax.model import olmo3
    from olmax.model.params import init_params
    from olmax.model.runtime import Runtime
    from olmax.model.splash import DEFAULT_BLOCK
    from olmax.train.recipes import load_recipe

    def blocks(train, tokens, params):
        rt = Runtime.of(train)
        fn = jax.jit(lambda p, t: olmo3.hidden_states(p, t, cfg, rt))
        text = fn.lower(params, tokens).as_text(debug_info=True)
        found = {s["block"] for s in map(parse_scope, re.findall(r"olmax_splash_[^/\"]*", text)) if s}
        return found, fn(params, tokens)

    base = load_recipe("olmo3_tiny", ["train.attn_impl=splash"], find_mix=False)
    cfg = base.model
    params = init_params(cfg, jax.random.key(0))
    # 640 positions: one block of 640 under the default of 1,024 (a default of 512 would run
    # blocks of 512 over 1,024 padded positions)
    tokens = jax.random.randint(jax.random.key(1), (1, 640), 0, cfg.vocab_size)
    assert base.train.splash_block == DEFAULT_BLOCK == 1024
    small = load_recipe("olmo3_tiny", ["train.attn_impl=splash", "train.splash_block=128"], find_mix=False)
    with jax.default_matmul_precision("highest"):
        found, out = blocks(small.train, tokens, params)
        found_default, _ = blocks(base.train, tokens, params)
        ref = jax.jit(lambda p, t: olmo3.hidden_states(p, t, cfg, Runtime(attn_impl="xla")))(params, tokens)
    assert found == {128} and found_default == {640}
    assert _rel(out, ref) <= 1e-5
    with pytest.raises(ConfigError, match="train.splash_block must be a positive multiple of 128 \\(got 192\\)"):
        load_recipe("olmo3_tiny", ["train.splash_block=192"], find_mix=False)


@pytest.mark.parametrize("block", [128, 512])
def test_splash_with_segments_equals_xla(block):
    """Intra-document masking: 300 tokens (padded inside to 384 or 512) in documents of 1 to 150
    tokens, GQA, windows shorter and longer than the documents; outputs and gradients."""
    from olmax.model.documents import segment_ids_from_doc_lens

    t, hq, hkv, d = 300, 4, 2, 32
    (q, k, v), ct = _inputs(t, hq, hkv, d, jnp.float32, seed=2)
    seg = segment_ids_from_doc_lens(jnp.asarray([[1, 150, 7, 100, 42], [300, 0, 0, 0, 0]], jnp.int32), t)
    windows = (5, 64, None)

    def splash(q, k, v, w, scale):
        return splash_attention(q, k, v, w, scale, seg, block_size=block)

    def xla(q, k, v, w, scale):
        return attention(q, k, v, w, scale, impl="xla", segment_ids=seg)

    with jax.default_matmul_precision("highest"):
        got = _out_and_grads(splash, windows, d ** -0.5)(q, k, v, ct)
        ref = _out_and_grads(xla, windows, d ** -0.5)(q, k, v, ct)
        plain = _out_and_grads(_xla, windows, d ** -0.5)(q, k, v, ct)
    for w, g, r, p in zip(windows, got, ref, plain):
        assert _rel(p[0], r[0]) > 1e-2            # the documents change the output
        for name, a, b in zip(("out", "dq", "dk", "dv"), g, r):
            assert _rel(a, b) <= 1e-5, (w, name, _rel(a, b))


def test_splash_with_segments_compiles_for_tpu():
    """With segment ids the kernels compile natively (Mosaic, libtpu ahead of time for a v5e chip,
    no TPU needed): forward and both backward kernels, 1000 tokens padded to 1024, window 256."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from olmax.perf.targets import topology_devices

    mesh = Mesh(np.array(topology_devices("v5e:1x1")[:1]), ("x",))
    rep = NamedSharding(mesh, PartitionSpec())
    b, t, hq, hkv, d = 2, 1000, 4, 2, 128
    q = jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16, sharding=rep)
    kv = jax.ShapeDtypeStruct((b, t, hkv, d), jnp.bfloat16, sharding=rep)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rep)

    def loss(q, k, v, seg):
        out = attention(q, k, v, 256, d ** -0.5, impl="splash", backend="tpu", segment_ids=seg)
        return jnp.sum(out.astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
    assert compiled.as_text().count("tpu_custom_call") == 3


def _dot_precisions(jaxpr, out: list) -> list:
    """The precision of every dot_general in ``jaxpr`` and the jaxprs inside it (Pallas kernels)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _dot_precisions(inner, out)
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_kernels_run_bf16_at_default_precision_under_highest(dtype):
    """Under ``jax.default_matmul_precision("highest")`` (what ``olmax parity`` sets), the bf16
    kernels' dots, forward and backward, are traced at the default precision (Mosaic refuses a
    16-bit product at highest), and give what they give without it; fp32 kernels keep highest."""
    (q, k, v), ct = _inputs(128, 4, 2, 32, dtype)

    def run(q, k, v, ct):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, 16, 32 ** -0.5, impl="splash", backend="cpu",
                                                     block=128), q, k, v)
        return out, vjp(ct)

    with jax.default_matmul_precision("highest"):
        found = {str(p) for p in _dot_precisions(jax.make_jaxpr(run)(q, k, v, ct).jaxpr, [])}
        highest = jax.jit(run)(q, k, v, ct)
    if dtype == "bfloat16":
        assert found == {"(Precision.DEFAULT, Precision.DEFAULT)"}
        plain = jax.jit(run)(q, k, v, ct)
        for a, b in zip(jax.tree.leaves(highest), jax.tree.leaves(plain)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    else:
        assert "(Precision.HIGHEST, Precision.HIGHEST)" in found


def test_bf16_kernels_compile_for_tpu_under_highest_precision():
    """Mosaic (libtpu, ahead of time for a v5e chip) compiles the bf16 forward and backward kernels
    of a model run under ``jax.default_matmul_precision("highest")``; the kernels called without
    olmax's precision guard do not ("Bad lhs type")."""
    import functools

    from jax.sharding import SingleDeviceSharding

    from olmax.model import splash
    from olmax.perf.targets import topology_devices

    rep = SingleDeviceSharding(topology_devices("v5e:1x1")[0])
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16, sharding=rep)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16, sharding=rep)
    raw = functools.partial(splash._local_splash, window=64, scale=0.125, block=128, interpret=False)

    def compile_with(fn):
        def f(q, k, v):
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v), q, k, v)
            return out, vjp(out)
        with jax.default_matmul_precision("highest"):
            return jax.jit(f).lower(q, kv, kv).compile()

    assert compile_with(splash.at_kernel_precision(raw, jnp.bfloat16)).as_text().count("tpu_custom_call") == 3
    with pytest.raises(Exception, match="Bad lhs type"):
        compile_with(raw)


@pytest.mark.parametrize("documents", [False, True])
def test_fused_backward_equals_two_kernels(documents):
    """``train.splash_fused_bwd``: dq accumulated in the dk/dv kernel gives the two-kernel backward's
    gradients (fp32, 1e-5 relative), with and without documents; the output is the same kernel's."""
    (q, k, v), ct = _inputs(256, 4, 2, 32, "float32")
    seg = (jnp.asarray(np.repeat(np.arange(3), [70, 100, 86])[None].repeat(2, 0), jnp.int32)
           if documents else None)
    res = {}
    for fused in (False, True):
        def run(q, k, v, ct, fused=fused):
            out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, 96, 32 ** -0.5, impl="splash",
                                                         backend="cpu", block=128, segment_ids=seg,
                                                         fused_bwd=fused), q, k, v)
            return out, vjp(ct)
        res[fused] = jax.tree.leaves(jax.jit(run)(q, k, v, ct))
    for name, a, b in zip(("out", "dq", "dk", "dv"), res[False], res[True]):
        rel = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
        assert rel <= 1e-5, (name, rel)


def test_fused_backward_compiles_to_one_backward_kernel_for_tpu():
    """Compiled by Mosaic for a v5e chip: the fused backward is one kernel (forward + 1), the
    default two (forward + dq + dk/dv)."""
    from jax.sharding import SingleDeviceSharding

    from olmax.perf.targets import topology_devices

    rep = SingleDeviceSharding(topology_devices("v5e:1x1")[0])
    q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16, sharding=rep)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16, sharding=rep)
    kernels = {}
    for fused in (False, True):
        def loss(q, k, v, fused=fused):
            out = attention(q, k, v, 256, 128 ** -0.5, impl="splash", backend="tpu", block=256,
                            fused_bwd=fused)
            return jnp.sum(out.astype(jnp.float32))
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
        kernels[fused] = text.count("tpu_custom_call")
    assert kernels == {False: 3, True: 2}
