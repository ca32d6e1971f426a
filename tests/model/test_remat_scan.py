"""``hidden_states`` gives the same numbers with every remat policy and with the layer scan as a
plain per-layer Python loop (layer i uses params[i] and window_pattern[i % period])."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.model import olmo3
from olmax.model.runtime import Runtime
from olmax.model.rope import rope_tables
from olmax.platforms import PROFILES
from helpers.jaxprs import all_eqns
from helpers.tiny import random_params, small_cfg

# Two scan groups of a period-2 pattern: a wrong group/position pairing changes the numbers.
CFG = small_cfg(vocab_size=200, padded_vocab_size=256, window_pattern=(4, None),
                rope_theta=10_000.0, max_seq_len=64)
T = 16


def _params_and_tokens():
    rng = np.random.default_rng(0)
    params = random_params(CFG, rng)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, T)))
    return params, tokens


@partial(jax.jit, static_argnums=2)
def _unrolled(params, tokens, windows):
    """The per-layer loop (no scan): layer i with params[i] and its own window."""
    sin, cos = rope_tables(jnp.arange(T), CFG.head_dim, CFG.rope_theta)
    h = jnp.take(params["embed"], tokens, axis=0)
    for i, window in enumerate(windows):
        p = jax.tree.map(lambda x, i=i: x[i], params["layers"])
        h = olmo3._layer(p, h, CFG, window, sin, cos, Runtime())
    return Runtime().kernels.rms_norm(h, params["final_norm"], CFG.norm_eps)


def _assert_close_scaled(a, b, rel=1e-5):
    """max |a - b| <= rel * max |b|: equal up to fp32 reassociation (XLA fuses the variants
    differently), far below what a wrong layer, window or param pairing changes."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= rel * np.max(np.abs(b)) + 1e-12


@pytest.mark.parametrize("profile", [None, "cpu", "tpu", "gpu"])
def test_scan_equals_per_layer_loop(profile):
    """The plain path and every profile's (the cpu profile unrolls the scan over the two groups
    and takes the RoPE tables as constants; splash on the tpu profile, chunked elsewhere)."""
    params, tokens = _params_and_tokens()
    rt = Runtime() if profile is None else Runtime(attn_impl="auto", profile=PROFILES[profile])
    scanned = jax.jit(lambda p, t: olmo3.hidden_states(p, t, CFG, rt))(params, tokens)
    _assert_close_scaled(scanned, _unrolled(params, tokens, CFG.layer_windows()))
    # The windows matter at this length: full attention everywhere gives other numbers.
    full = _unrolled(params, tokens, (None,) * CFG.n_layers)
    assert np.max(np.abs(np.asarray(full) - np.asarray(scanned))) > 1e-3


POLICIES = [r for r in olmo3.REMAT_POLICIES if r != "none"]


def test_remat_policies_give_identical_hidden_states():
    params, tokens = _params_and_tokens()
    outs = jax.jit(lambda p: {r: olmo3.hidden_states(p, tokens, CFG, Runtime(remat=r))
                              for r in olmo3.REMAT_POLICIES})(params)
    for r in POLICIES:
        _assert_close_scaled(outs[r], outs["none"])


def _loss(params, tokens, remat):
    h = olmo3.hidden_states(params, tokens, CFG, Runtime(remat=remat))
    return jnp.mean(jnp.square(h) * jnp.arange(CFG.d_model))


@pytest.mark.parametrize("remat", [pytest.param(r, marks=() if r == "full" else pytest.mark.slow)
                                   for r in POLICIES])
def test_remat_policies_give_identical_gradients(remat):
    params, tokens = _params_and_tokens()
    g_ref = jax.jit(jax.grad(lambda p: _loss(p, tokens, "none")))(params)
    g = jax.jit(jax.grad(lambda p: _loss(p, tokens, remat)))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        _assert_close_scaled(a, b)


def test_unknown_remat_policy_is_rejected():
    params, tokens = _params_and_tokens()
    with pytest.raises(ValueError, match="unknown remat policy"):
        olmo3.hidden_states(params, tokens, CFG, Runtime(remat="bogus"))


def test_policies_recompute_only_the_matmuls_they_do_not_keep():
    """Matmuls the backward pass runs again, per layer, counted in the gradient's program against
    ``none`` (``xla`` attention: its two matmuls, scores and probabilities x values, are never kept
    by a named policy). A layer has 7 projections: q, k, v, o, gate, up, down."""
    params, tokens = _params_and_tokens()

    def dots(remat):
        fn = jax.grad(lambda p: jnp.sum(olmo3.hidden_states(p, tokens, CFG, Runtime(remat=remat))))
        return str(jax.make_jaxpr(fn)(params)).count("dot_general")

    period = len(CFG.window_pattern)   # layers in the scanned group: the body appears once
    recomputed = {r: (dots(r) - dots("none")) / period for r in ("full", "save_outputs", "save_attn",
                                                                   "save_proj")}
    assert recomputed == {"full": 9,           # everything: 7 projections + 2 attention matmuls
                          "save_outputs": 7,   # q, k, v, gate, up + attention (o, down kept)
                          "save_attn": 6,      # o, gate, up, down + attention (q, k, v kept)
                          "save_proj": 2}      # the attention matmuls only


@pytest.mark.parametrize("remat", ["none", "save_proj", "full"])
def test_tpu_casts_layer_weights_in_the_layer_with_fp32_gradients(remat):
    """The tpu profile casts each layer's weights inside the layer loop (``Profile.cast_in_layer``):
    the same forward pass as the gpu profile's up-front cast, and weight gradients that leave the
    dense layers in fp32 -- the gpu profile's are each one bf16 GEMM output (every element a bf16
    number), the tpu profile's the same sums unrounded (within one bf16 rounding of them). Both
    unroll the layers as the tpu profile does, so that the cast is the one difference."""
    params, tokens = _params_and_tokens()

    def loss(profile):
        rt = Runtime(compute_dtype=jnp.bfloat16, attn_impl="xla", remat=remat,
                     profile=PROFILES[profile], unroll=PROFILES["tpu"].unroll_layers)
        return jax.jit(jax.value_and_grad(
            lambda p: jnp.mean(olmo3.hidden_states(p, tokens, CFG, rt).astype(jnp.float32) ** 2)))
    assert PROFILES["tpu"].cast_in_layer and not PROFILES["gpu"].cast_in_layer
    (l_gpu, g_gpu), (l_tpu, g_tpu) = loss("gpu")(params), loss("tpu")(params)
    assert float(l_tpu) == float(l_gpu)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        a, b = np.asarray(g_gpu["layers"][name]), np.asarray(g_tpu["layers"][name])
        assert a.dtype == b.dtype == np.float32
        as_bf16 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
        np.testing.assert_array_equal(a, as_bf16(a))               # gpu: rounded to bf16
        assert np.mean(b != as_bf16(b)) > 0.9, name                 # tpu: not rounded
        np.testing.assert_allclose(a, b, rtol=2.0 ** -8, atol=1e-30)
    # the norm weights are still used in bf16 (as FSDP's bf16 parameters are) on both profiles
    for name in ("attn_norm", "mlp_norm"):
        np.testing.assert_array_equal(np.asarray(g_gpu["layers"][name]), np.asarray(g_tpu["layers"][name]))


@pytest.mark.parametrize("profile", ["cpu", "tpu"])
def test_layer_weight_gradients_are_written_side_by_side(profile):
    """The backward pass of a layer group joins its layers' weight gradients into the group's
    stack [period, ...] by concatenation: no zero-padded copy of the stack per layer, summed (the
    transpose of indexing one layer out of it; on TPU 12 GB more per 8-layer group of the 7B)."""
    params, tokens = _params_and_tokens()
    rt = Runtime(compute_dtype=jnp.bfloat16, attn_impl="xla", remat="full", profile=PROFILES[profile])
    jaxpr = jax.make_jaxpr(jax.grad(
        lambda p: jnp.mean(olmo3.hidden_states(p, tokens, CFG, rt).astype(jnp.float32) ** 2)))(params)
    period = len(CFG.window_pattern)
    stacks = {(period, *w.shape[1:]) for w in params["layers"].values()}
    made = {}
    for e in all_eqns(jaxpr.jaxpr):
        for shape in {tuple(getattr(v.aval, "shape", ())) for v in e.outvars} & stacks:
            made.setdefault(e.primitive.name, set()).add(shape)
    assert "pad" not in made and "add_any" not in made, made
    assert made.get("concatenate") == stacks, made


@pytest.mark.slow
@pytest.mark.parametrize("unroll", [True, False])
def test_unrolled_layers_give_the_scans_values_and_gradients(unroll):
    """``train.unroll_layers`` overrides the profile's choice (the gpu profile rolls the scan, the
    tpu profile unrolls it) and changes neither the hidden states nor the gradients, at the TPU
    recipes' remat (save_proj), with splash on the tpu profile: the per-layer loop is the reference."""
    params, tokens = _params_and_tokens()
    profile = "gpu" if unroll else "tpu"       # each forced the other way
    rt = Runtime(attn_impl="auto", remat="save_proj", profile=PROFILES[profile], unroll=unroll)
    assert rt.unroll_layers is unroll and PROFILES[profile].unroll_layers is not unroll
    hidden = jax.jit(lambda p, t: olmo3.hidden_states(p, t, CFG, rt))(params, tokens)
    _assert_close_scaled(hidden, _unrolled(params, tokens, CFG.layer_windows()))
    plain = Runtime(attn_impl="auto", remat="save_proj", profile=PROFILES[profile])

    def grads(runtime):
        return jax.jit(jax.grad(lambda p: jnp.mean(jnp.square(olmo3.hidden_states(p, tokens, CFG, runtime))
                                                   * jnp.arange(CFG.d_model))))(params)
    for a, b in zip(jax.tree.leaves(grads(rt)), jax.tree.leaves(grads(plain))):
        _assert_close_scaled(a, b)
    # the program itself differs: a rolled scan is a loop, an unrolled one is none (XLA's
    # attention here: splash in interpret mode has loops of its own)
    xla = Runtime(attn_impl="xla", remat="save_proj", profile=PROFILES[profile], unroll=unroll)
    text = jax.jit(lambda p, t: olmo3.hidden_states(p, t, CFG, xla)).lower(params, tokens).as_text()
    assert ("stablehlo.while" in text) is not unroll
