"""The CPU kernels: the reference functions with backward passes written out for XLA's CPU backend.

- **Weight gradients as row-major GEMMs.** A weight's gradient ``dW = sum_n x[n, :]^T g[n, :]``,
  as autodiff writes it, contracts both operands over their leading, major dimension. XLA's CPU
  backend hands that form (a transposed left operand) to Eigen instead of its XNNPACK/YNNPACK
  GEMMs, and under bf16 first converts both operands to fp32. :func:`contract_rows` writes the
  left operand as an explicit 3-D transposition ``x [B, T, i] -> [i, B, T] -> [i, B*T]``: a 2-D
  transposition would be folded back into the dot as a transposed operand, a 3-D one is kept (a
  copy of the activations, cheap next to the GEMM). :func:`dense` uses it in its backward pass.
- **RMSNorm keeps only its input and the per-row scale.** Autodiff of the fp32 formulation keeps
  the fp32 input, its normalised value and the weighted product of every norm from the forward
  pass to the backward; :func:`rms_norm`'s written-out backward recomputes them from ``x`` and
  ``r``.

The values equal :mod:`olmax.model.kernels.reference` up to fp32 summation order (tested against
torch float64 autograd and JAX autodiff). Measurements: benchmarks/notes/2026-11-30-cpu-shapes-a-and-b-before-and-after.md.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from olmax.model.kernels.reference import dense as _reference_dense
from olmax.model.kernels.reference import rms_norm_and_scale


def contract_rows(x: jax.Array, g: jax.Array) -> jax.Array:
    """``sum_n x[n, :]^T g[n, :]`` in fp32 for ``x`` [..., i] (at least 3-D) and ``g`` [..., o]
    with the same leading elements: ``[i, N] @ [N, o]``, the left operand an explicit 3-D
    transposition of ``x`` (see the module docstring)."""
    i, o = x.shape[-1], g.shape[-1]
    x_t = jnp.moveaxis(x, -1, 0).reshape(i, -1)
    return jnp.einsum("in,no->io", x_t, g.reshape(-1, o), preferred_element_type=jnp.float32)


@jax.custom_vjp
def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
    return _reference_dense(x, w)


def _dense_fwd(x, w):
    return _reference_dense(x, w), (x, w)


def _dense_bwd(res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = jnp.einsum("...o,io->...i", g, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return dx, contract_rows(x, g).astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` accumulated in fp32, rounded to ``x``'s dtype; for activations [B, T, i] the
    backward pass computes ``dx = g w^T`` and ``dW`` with :func:`contract_rows`, both GEMMs with
    inputs in the compute dtype and fp32 accumulation."""
    return _dense(x, w) if x.ndim >= 3 else _reference_dense(x, w)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """OLMo's RMSNorm (fp32 normalisation and weight multiply, cast to ``x``'s dtype)."""
    return rms_norm_and_scale(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
    out, r = rms_norm_and_scale(x, weight, eps)
    return out, (x, weight, r)


def _rms_norm_bwd(eps, res, g):
    """``y = x r``, ``r = (mean(x^2) + eps)^-1/2``, ``out = w y``: ``dw = sum_rows(g y)``,
    ``dx = r (g w - y mean(g w y))``, all in fp32 from the saved input and ``r``."""
    del eps
    x, weight, r = res
    x32, g32 = x.astype(jnp.float32), g.astype(jnp.float32)
    gr = g32 * r
    dw = jnp.sum(gr * x32, axis=tuple(range(x.ndim - weight.ndim)))
    gwr = gr * weight.astype(jnp.float32)
    dx = gwr - (x32 * (r * r)) * jnp.mean(gwr * x32, axis=-1, keepdims=True)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
