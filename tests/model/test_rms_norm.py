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
