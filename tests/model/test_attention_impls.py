"""Every attention implementation equals the ``xla`` reference (windows shorter and longer than the
sequence, GQA, forward and gradients), and the block-sparse path costs O(T*W) on sliding layers."""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.model import forward, init_params
from olmax.model.attention import IMPLEMENTATIONS, attention, xla_attention
from olmax.model.runtime import Runtime
from olmax.model.attention_impls import chunked_with_block
from olmax.model.presets import get_preset

B, T, HQ, HKV, D = 2, 37, 4, 2, 8
WINDOWS = [1, 5, 16, 36, 100, None]


def _qkv(dtype=jnp.float32, t=T, hq=HQ, hkv=HKV):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (B, t, hq, D), dtype), jax.random.normal(kk, (B, t, hkv, D), dtype),
            jax.random.normal(kv, (B, t, hkv, D), dtype))


def _out_and_grads(fn, window):
    """Jitted (output, d<out, probe>/d(q, k, v)) of one implementation."""
    probe = jax.random.normal(jax.random.key(1), (B, T, HQ, D))

    def loss(q, k, v):
        out = fn(q, k, v, window, D ** -0.5)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@functools.cache
def _reference(window):
    return _out_and_grads(xla_attention, window)(*_qkv())


def _check_against_reference(impl, windows):
    fn = chunked_with_block(int(impl.split("-")[1])) if "-" in impl else IMPLEMENTATIONS[impl]
    q, k, v = _qkv()
    for window in windows:
        (_, ref), g_ref = _reference(window)
        (_, out), g = _out_and_grads(fn, window)(q, k, v)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5,
                                   err_msg=f"window={window}")
        for a, r in zip(g, g_ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5, rtol=1e-5,
                                       err_msg=f"grad, window={window}")


# Windows shorter than a block, spanning several blocks, one short of T, longer than T, full.
@pytest.mark.parametrize("impl,windows", [("chunked-4", (5, 36)), ("chunked-16", (None, 16, 100)),
                                          ("dot_product", (5, None))])
def test_equals_reference_fp32(impl, windows):
    _check_against_reference(impl, windows)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["chunked-4", "chunked-16", "chunked", "dot_product"])
def test_equals_reference_fp32_all_windows(impl):
    _check_against_reference(impl, WINDOWS)


@pytest.mark.parametrize("impl", ["chunked", "dot_product", "cudnn"])
def test_window_is_never_dropped(impl):
    """On this CPU ``cudnn`` must fall back to a windowed implementation, not to full attention."""
    q, k, v = _qkv()
    run = jax.jit(partial(attention, impl=impl), static_argnums=(3, 4))
    windowed = run(q, k, v, 5, D ** -0.5)
    np.testing.assert_allclose(np.asarray(windowed), np.asarray(xla_attention(q, k, v, 5, D ** -0.5)),
                               atol=2e-6)
    full = xla_attention(q, k, v, None, D ** -0.5)
    assert float(jnp.max(jnp.abs(windowed - full))) > 1e-2
    # window 1: every query sees only itself, so the output is its own value vector.
    own = run(q, k, v, 1, D ** -0.5)
    np.testing.assert_allclose(np.asarray(own), np.asarray(jnp.repeat(v, HQ // HKV, axis=2)),
                               atol=1e-6)


def test_auto_picks_the_platform_kernel():
    from olmax.platforms import PROFILES, profile_for

    auto = lambda backend: Runtime(attn_impl="auto", profile=profile_for("auto", backend)).attn_impl  # noqa: E731
    assert auto("tpu") == "splash" and auto("gpu") == "cudnn" and auto("cpu") == "chunked"
    # a forced profile's own choice, whatever the backend; an explicit choice is kept
    assert Runtime(attn_impl="auto", profile=profile_for("tpu", "cpu")).attn_impl == "splash"
    assert Runtime(attn_impl="xla", profile=PROFILES["tpu"]).attn_impl == "xla"
    assert Runtime.resolve(attn_impl="auto").attn_impl == "chunked"      # this CPU machine
    with pytest.raises(ValueError, match="needs a platform profile"):
        Runtime(attn_impl="auto")


def test_bf16_close_to_reference():
    q, k, v = _qkv(jnp.bfloat16)
    for window in (5, None):
        ref = jax.jit(xla_attention, static_argnums=(3, 4))(q, k, v, window, D ** -0.5)
        out = jax.jit(chunked_with_block(8), static_argnums=(3, 4))(q, k, v, window, D ** -0.5)
        assert out.dtype == ref.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


def _compiled_flops(fn, t, window):
    q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _qkv(t=t))
    lowered = jax.jit(fn, static_argnums=(3, 4)).lower(q, k, v, window, D ** -0.5)
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def test_sliding_cost_is_linear_in_sequence_length():
    window = 16
    chunked = chunked_with_block(16)
    c1, c2 = _compiled_flops(chunked, 256, window), _compiled_flops(chunked, 512, window)
    r1, r2 = _compiled_flops(xla_attention, 256, window), _compiled_flops(xla_attention, 512, window)
    assert c2 / c1 == pytest.approx(2.0, rel=0.1)      # O(T * W)
    assert r2 / r1 == pytest.approx(4.0, rel=0.1)      # the reference is O(T^2)
    assert c2 < r2 / 8
    # Full layers: block-causal skips the upper triangle (about half the reference's work).
    f_chunk = _compiled_flops(chunked_with_block(64), 512, None)
    assert f_chunk < 0.6 * r2


def test_model_forward_matches_reference():
    cfg = get_preset("olmo3-tiny")             # GQA, windows of 64 < T
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 96), 0, cfg.vocab_size)
    ref = jax.jit(lambda p, t: forward(p, t, cfg))(params, tokens)
    out = jax.jit(lambda p, t: forward(p, t, cfg, Runtime(attn_impl="chunked")))(params, tokens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_depend_on_keeps_every_value_bit_for_bit(dtype):
    """The chunked backward ties its recomputation to the cotangent by adding a zero derived from
    it: every value of ``x`` -- signed zeros, infinities, NaN -- comes out with the same bits,
    whatever the cotangent holds. (Subnormals are left out: XLA's CPU backend flushes them to zero
    in any arithmetic, the matmul that consumes ``x`` included.)"""
    from olmax.model.attention_impls import depend_on

    x = jnp.asarray([0.0, -0.0, 1.5, -2.25, jnp.inf, -jnp.inf, jnp.nan, 1e-30, -3e38], dtype)
    for d0 in (0.7, -0.0, 0.0, -5.0, jnp.inf, -jnp.inf, jnp.nan):
        dep = jnp.full((2, 3), 1.0, jnp.float32).at[0, 0].set(d0)
        out = jax.jit(depend_on)(x, dep)
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.asarray(x).view(np.uint8))


# ----------------------------------------------------------------------------------------------
# Intra-document masking (segment ids from OLMo-core style doc_lens)


def _doc_lens(t: int, seed: int, rows: int = B) -> np.ndarray:
    """[rows, 8] zero-padded document lengths summing to t: one-token documents, documents longer
    than the windows tested, and (last row) a single document."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, 8), np.int32)
    for r in range(rows - 1):
        lens, left = [1], t - 1
        while left and len(lens) < 7:
            n = int(min(left, rng.integers(1, max(2, t // 2))))
            lens.append(n)
            left -= n
        lens[-1] += left
        out[r, :len(lens)] = lens
    out[-1, 0] = t
    return out


def _segments(t: int, seed: int = 0) -> jnp.ndarray:
    from olmax.model.documents import segment_ids_from_doc_lens
    return segment_ids_from_doc_lens(jnp.asarray(_doc_lens(t, seed)), t)


def test_segment_ids_and_positions_from_doc_lens():
    from olmax.model.documents import positions_in_documents, segment_ids_from_doc_lens

    doc_lens = jnp.asarray([[3, 1, 4, 0, 0], [8, 0, 0, 0, 0], [2, 0, 3, 3, 0]], jnp.int32)
    seg = segment_ids_from_doc_lens(doc_lens, 8)
    assert seg.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2], [0] * 8, [0, 0, 2, 2, 2, 3, 3, 3]]
    assert positions_in_documents(seg).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3], list(range(8)),
                                                    [0, 1, 0, 1, 2, 0, 1, 2]]
    # lengths summing to less than T: the rest is a segment of its own (ids need not be consecutive)
    short = segment_ids_from_doc_lens(jnp.asarray([[2, 3, 0]], jnp.int32), 8)
    assert short.tolist() == [[0, 0, 1, 1, 1, 3, 3, 3]]


def _attention_alone(q, k, v, window, scale):
    """numpy float64 causal (windowed) GQA attention of one sequence [T, H, D]."""
    t, hq, _ = q.shape
    g = hq // k.shape[1]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    out = np.zeros(q.shape)
    for h in range(hq):
        s = np.where(visible, q[:, h] @ k[:, h // g].T * scale, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // g]
    return out


@pytest.mark.parametrize("window", [None, 4, 16])
def test_segments_equal_attention_per_document(window):
    """The reference with segments equals attention computed on each document alone (numpy)."""
    t = 48
    q, k, v = _qkv(t=t)
    doc_lens = _doc_lens(t, seed=1)
    with jax.default_matmul_precision("highest"):
        out = np.asarray(xla_attention(q, k, v, window, D ** -0.5, _segments(t, seed=1)))
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    for r in range(B):
        s = 0
        for n in (int(n) for n in doc_lens[r] if n):
            alone = _attention_alone(q[r, s:s + n], k[r, s:s + n], v[r, s:s + n], window, D ** -0.5)
            np.testing.assert_allclose(out[r, s:s + n], alone, atol=2e-6, rtol=1e-5)
            s += n


def _segment_out_and_grads(fn, q, k, v, window, seg):
    probe = jax.random.normal(jax.random.key(2), q.shape)

    def loss(q, k, v):
        out = fn(q, k, v, window, D ** -0.5, seg)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)


_SLOW = pytest.mark.slow


# Lengths that are not multiples of any block (48 < 128 lanes; 100; 300: several blocks). Splash at
# 300 tokens (several 128-blocks) is in tests/model/test_splash.py.
@pytest.mark.parametrize("impl,t", [
    ("chunked", 100), ("chunked-16", 48), ("dot_product", 100), ("cudnn", 48), ("splash", 48),
    pytest.param("chunked", 48, marks=_SLOW), pytest.param("chunked", 300, marks=_SLOW),
    pytest.param("chunked-16", 100, marks=_SLOW), pytest.param("chunked-16", 300, marks=_SLOW),
    pytest.param("dot_product", 300, marks=_SLOW), pytest.param("splash", 100, marks=_SLOW)])
def test_impls_equal_reference_with_segments(impl, t):
    fn = chunked_with_block(16) if impl == "chunked-16" else (
        lambda q, k, v, w, scale, seg: attention(q, k, v, w, scale, impl=impl, segment_ids=seg))
    q, k, v = _qkv(t=t)
    seg = _segments(t, seed=t)
    for window in (5, 16, None):
        (_, ref), g_ref = _segment_out_and_grads(xla_attention, q, k, v, window, seg)
        (_, out), g = _segment_out_and_grads(fn, q, k, v, window, seg)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5,
                                   err_msg=f"window={window}")
        for name, a, r in zip("qkv", g, g_ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5, rtol=1e-5,
                                       err_msg=f"d{name}, window={window}")
        # the document mask matters: without it the output differs
        plain = xla_attention(q, k, v, window, D ** -0.5)
        assert float(jnp.max(jnp.abs(plain - ref))) > 1e-2

