"""RMSNorm's written-out backward (the CPU kernel set) against torch autograd in float64 and against
JAX's autodiff of the same forward (the reference kernel set), at the shapes the model uses: the
residual stream [B, T, D] with a [D] weight, the full QK-norm over [B, T, H * Dh], and the per-head
QK-norm [B, T, H, Dh] with a [Dh] weight (the weight's gradient sums over every leading dimension)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.model.kernels import KERNELS
from olmax.model.runtime import Runtime
from olmax.platforms import PROFILES
from helpers.reference import require

torch = require("torch")

EPS = 1e-6
SHAPES = [((2, 5, 48), (48,)), ((3, 4, 64), (64,)), ((2, 3, 4, 16), (16,))]


def _inputs(x_shape, w_shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=x_shape) * rng.uniform(0.1, 3.0, size=x_shape[:-1] + (1,))
    w = 1.0 + 0.3 * rng.normal(size=w_shape)
    g = rng.normal(size=x_shape)
    return x, w, g


def _torch_reference(x, w, g):
    """OLMo's RMSNorm in float64 and its input / weight gradients for the cotangent ``g``."""
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    out = wt * (xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + EPS))
    out.backward(torch.tensor(g, dtype=torch.float64))
    return out.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


def _vjp(fn, x, w, g):
    out, pull = jax.vjp(lambda a, b: fn(a, b, EPS), x, w)
    return (out, *pull(g))


_written_out = KERNELS["cpu"].rms_norm
_autodiff = KERNELS["reference"].rms_norm


@pytest.mark.parametrize("x_shape,w_shape", SHAPES)
def test_written_out_backward_matches_float64_and_autodiff(x_shape, w_shape):
    x, w, g = _inputs(x_shape, w_shape)
    ref = _torch_reference(x, w, g)
    args = (jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(g, jnp.float32))
    own = _vjp(_written_out, *args)
    auto = _vjp(_autodiff, *args)
    for name, a, b, r in zip(("out", "dx", "dw"), own, auto, ref):
        scale = np.max(np.abs(r))
        np.testing.assert_allclose(np.asarray(a), r, atol=2e-6 * scale, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6 * scale, rtol=1e-5,
                                   err_msg=name)


@pytest.mark.parametrize("x_shape,w_shape", SHAPES)
def test_written_out_backward_in_bf16_is_as_close_as_autodiff(x_shape, w_shape):
    """bf16 activations, fp32 weight (the master weights): both backward passes round once to
    bf16 at the end, so each stays within bf16's rounding of the float64 gradient, and the
    written-out one is no further from it than autodiff."""
    x, w, g = _inputs(x_shape, w_shape, seed=1)
    xb, gb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(g, jnp.bfloat16)
    # the reference sees exactly the bf16 inputs
    ref = _torch_reference(np.asarray(xb, np.float64), w, np.asarray(gb, np.float64))
    own = _vjp(_written_out, xb, jnp.asarray(w, jnp.float32), gb)
    auto = _vjp(_autodiff, xb, jnp.asarray(w, jnp.float32), gb)
    assert own[0].dtype == own[1].dtype == jnp.bfloat16 and own[2].dtype == jnp.float32
    for name, a, b, r in zip(("out", "dx", "dw"), own, auto, ref):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.max(np.abs(r))
        err_own, err_auto = np.max(np.abs(a - r)) / scale, np.max(np.abs(b - r)) / scale
        assert err_own <= 2 ** -8, (name, err_own)
        assert err_own <= 1.5 * err_auto + 1e-6, (name, err_own, err_auto)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_runs_its_own_kernel_set(profile):
    """The cpu profile's norm has the written-out backward; the accelerators' is autodiff's --
    whatever device this test runs on."""
    x, w, _ = _inputs((2, 3, 8), (8,))
    norm = Runtime(profile=PROFILES[profile]).kernels.rms_norm
    jaxpr = str(jax.make_jaxpr(lambda a, b: norm(a, b, EPS))(jnp.asarray(x, jnp.float32),
                                                             jnp.asarray(w, jnp.float32)))
    assert ("custom_vjp_call" in jaxpr) == (profile == "cpu")


@pytest.mark.parametrize("kernels", sorted(KERNELS))
def test_bf16_output_is_the_exact_norm_rounded_once(kernels):
    """Every kernel set (the cpu profile's and the accelerators') normalises and multiplies by the
    weight in fp32 and rounds once to bf16: each output is within half a bf16 ulp of the float64
    norm of the same bf16 input. A norm computed in bf16 (no fp32 upcast) is off by up to ~2.4
    ulp, and on 40 % of the elements by more than half an ulp."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 32, 512)) * rng.uniform(0.1, 3.0, size=(4, 32, 1))
    w = 1.0 + 0.3 * rng.normal(size=(512,))
    xb = jnp.asarray(x, jnp.bfloat16)
    x64 = np.asarray(xb, np.float64)
    ref = w * (x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + EPS))
    out = jax.jit(KERNELS[kernels].rms_norm, static_argnums=2)(xb, jnp.asarray(w, jnp.float32), EPS)
    assert out.dtype == jnp.bfloat16
    ulp = 2.0 ** (np.floor(np.log2(np.abs(ref))) - 7)       # bf16: 8 significant bits
    err = np.abs(np.asarray(out, np.float64) - ref) / ulp
    assert err.max() <= 0.5 + 1e-3, err.max()


def test_train_kernels_overrides_the_profiles_set():
    """``train.kernels`` picks the set whatever the profile; ``norm`` is the reference set with the
    written-out RMSNorm (the same function object the tests above hold against float64)."""
    from olmax.config.schema import TrainConfig

    assert Runtime.of(TrainConfig(profile="tpu")).kernels.name == "reference"
    rt = Runtime.of(TrainConfig(profile="tpu", kernels="norm"))
    assert rt.kernels == KERNELS["norm"] and rt.profile_name == "tpu"
    assert rt.kernels.rms_norm is _written_out
    assert rt.kernels.dense is KERNELS["reference"].dense
    assert rt.kernels.contract_rows is KERNELS["reference"].contract_rows
    assert Runtime.of(TrainConfig(profile="cpu", kernels="reference")).kernels.name == "reference"
    assert Runtime.of(TrainConfig(profile="tpu", kernels="norm", float8=False)).kernels.name == "norm"
    with pytest.raises(ValueError, match="unknown kernel set 'fast'"):
        Runtime(kernel_set="fast")


def test_norm_set_keeps_the_norms_input_in_bf16_for_the_backward():
    """What the ``norm`` set is for: in a bf16 model, autodiff's norm keeps an fp32 copy of the
    input [B, T, D] for the backward pass; the written-out one keeps the bf16 input and one fp32
    scale per row ([B, T, 1])."""
    import contextlib
    import io
    import re

    from jax.ad_checkpoint import print_saved_residuals

    x = jnp.ones((2, 8, 64), jnp.bfloat16)
    w = jnp.ones((64,), jnp.float32)

    def saved(name):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):     # "bf16[2,8,64] from the argument x" a line
            print_saved_residuals(
                lambda a, b: KERNELS[name].rms_norm(a, b, EPS).astype(jnp.float32).sum(), x, w)
        found = [re.match(r"(\w+)\[([\d,]*)\] ", line) for line in out.getvalue().splitlines()]
        return {(tuple(int(d) for d in m[2].split(",") if d), m[1]) for m in found if m}
    assert ((2, 8, 64), "f32") in saved("reference")
    norm = saved("norm")
    assert ((2, 8, 64), "f32") not in norm
    assert {((2, 8, 64), "bf16"), ((2, 8, 1), "f32")} <= norm


@pytest.mark.slow      # three compiles of a two-layer model
def test_norm_set_trains_the_model_as_the_reference_set():
    """A bf16 model on the tpu profile: the ``norm`` set's loss and every gradient are as close to
    the same model's in fp32 as the reference set's (autodiff of the same norm) are. The two bf16
    runs round in different places, and a difference of one bf16 rounding in a norm's gradient
    grows through the layers below it, so each is held against the fp32 gradients rather than
    against the other."""
    from olmax.model import olmo3
    from helpers.tiny import random_params, small_cfg

    cfg = small_cfg(vocab_size=200, padded_vocab_size=256, window_pattern=(4, None),
                    rope_theta=10_000.0, max_seq_len=64)
    rng = np.random.default_rng(0)
    params = random_params(cfg, rng)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)))

    def run(kernel_set, dtype=jnp.bfloat16):
        rt = Runtime(compute_dtype=dtype, attn_impl="xla", profile=PROFILES["tpu"],
                     kernel_set=kernel_set)
        assert rt.kernels.name == (kernel_set or "reference")
        loss, grads = jax.jit(jax.value_and_grad(
            lambda p: jnp.mean(olmo3.hidden_states(p, tokens, cfg, rt).astype(jnp.float32) ** 2)))(params)
        return float(loss), {jax.tree_util.keystr(k): np.asarray(v, np.float64)
                             for k, v in jax.tree_util.tree_leaves_with_path(grads)}
    (l32, g32), (l_ref, g_ref), (l_norm, g_norm) = run(None, jnp.float32), run(None), run("norm")
    assert abs(l_norm - l32) <= 1.5 * abs(l_ref - l32) + 2.0 ** -9 * abs(l32)
    for name, exact in g32.items():
        scale = np.max(np.abs(exact))
        if scale == 0:                                   # the LM head: not in hidden_states
            assert not g_norm[name].any() and not g_ref[name].any()
            continue
        err_norm = np.max(np.abs(g_norm[name] - exact)) / scale
        err_ref = np.max(np.abs(g_ref[name] - exact)) / scale
        assert err_norm <= 1.5 * err_ref + 2.0 ** -9, (name, err_norm, err_ref)
