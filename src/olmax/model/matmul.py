"""Dense layers and weight gradients as GEMMs XLA's CPU backend runs fast.

A weight's gradient contracts the activations and the output gradient over every token,
``dW = sum_n x[n, :]^T g[n, :]``: written naturally (``einsum("...i,...o->io")``, or as autodiff
transposes ``x @ w``) the contraction runs over the leading, major dimension of both operands. XLA's
CPU backend hands that form (a transposed left operand) to Eigen, not to its XNNPACK/YNNPACK GEMMs,
and under bf16 first converts both operands to fp32 -- measured on a 2-core AVX-512-bf16 CPU, 1.3-2x
slower than the same product with a row-major left operand in fp32, and 2-3x in bf16. Writing the
left operand as an explicit 3-D transposition ``x [B, T, i] -> [i, B, T] -> [i, B*T]`` keeps it a
plain row-major GEMM: a 2-D transpose would be folded back into the dot as a transposed operand, a
3-D one is not (it is a real copy of the activations, cheap next to the GEMM).

:func:`dense` is the model's ``x @ w`` (fp32 accumulation, rounded to ``x``'s dtype, as a bf16 GEMM
does). On CPU its backward pass computes ``dx = g w^T`` and ``dW`` as above, both GEMMs with
inputs in the compute dtype and fp32 accumulation; elsewhere it is plain autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmax.model.logical import context_platform


def contract_rows(x: jax.Array, g: jax.Array) -> jax.Array:
    """``sum_n x[n, :]^T g[n, :]`` in fp32 for ``x`` [..., i] (at least 3-D) and ``g`` [..., o]
    with the same leading elements: ``[i, N] @ [N, o]``, the left operand an explicit 3-D
    transposition of ``x`` (see the module docstring)."""
    i, o = x.shape[-1], g.shape[-1]
    x_t = jnp.moveaxis(x, -1, 0).reshape(i, -1)
    return jnp.einsum("in,no->io", x_t, g.reshape(-1, o), preferred_element_type=jnp.float32)


def _forward(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


@jax.custom_vjp
def _dense_cpu(x: jax.Array, w: jax.Array) -> jax.Array:
    return _forward(x, w)


def _dense_cpu_fwd(x, w):
    return _forward(x, w), (x, w)


def _dense_cpu_bwd(res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = jnp.einsum("...o,io->...i", g, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return dx, contract_rows(x, g).astype(w.dtype)


_dense_cpu.defvjp(_dense_cpu_fwd, _dense_cpu_bwd)


def dense(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """x @ w accumulated in fp32, rounded to x.dtype (as a bf16 GEMM does)."""
    if x.ndim >= 3 and context_platform() == "cpu":
        return _dense_cpu(x, w)
    return _forward(x, w)
