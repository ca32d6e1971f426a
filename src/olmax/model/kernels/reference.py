"""The reference kernels: plain JAX, differentiated by autodiff (the TPU and GPU profiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` accumulated in fp32, rounded to ``x``'s dtype (as a bf16 GEMM does). ``w`` may be
    held in a wider dtype (fp32 master weights): it is multiplied in ``x``'s.

    The backward pass is autodiff's, written out for one difference: the weight gradient comes out
    in ``w``'s own dtype straight from the fp32 accumulator, where autodiff would round it to the
    compute dtype first (for bf16 weights the two are the same)."""
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def _dense_fwd(x, w):
    return dense(x, w), (x, w)


def _dense_bwd(res, g):
    x, w = res
    dx = jnp.einsum("...o,io->...i", g, w.astype(x.dtype), preferred_element_type=jnp.float32)
    dw = jnp.einsum("...i,...o->io", x, g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def rms_norm_and_scale(x: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """OLMo's RMSNorm of ``x`` and the per-row ``r = (mean(x^2) + eps)^-1/2``: normalisation *and*
    weight multiply in fp32, then cast to ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * (x32 * r)).astype(x.dtype), r


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return rms_norm_and_scale(x, weight, eps)[0]


def contract_rows(x: jax.Array, g: jax.Array) -> jax.Array:
    """``sum_n x[n, :]^T g[n, :]`` in fp32 for ``x`` [..., i] and ``g`` [..., o] with the same
    number of leading elements."""
    return jnp.einsum("ni,no->io", x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]),
                      preferred_element_type=jnp.float32)
