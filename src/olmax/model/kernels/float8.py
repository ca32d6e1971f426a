"""Float8 dense layers: torchao's tensorwise dynamic recipe, as OLMo 3's long-context stage ran it.

AI2's stage-3 run converts every ``nn.Linear`` of the transformer blocks (attention q/k/v/output
projections and the MLP's three; not the LM head, whose ``lm_head.w_out`` OLMo-core always leaves
out; not the embedding, which is no Linear) to torchao's ``Float8Linear`` with
``AOFloat8LinearConfig.recommended()``; a Linear with a dimension not divisible by 16 stays in
high precision. The recipe, per dense layer ``y = x @ w``:

- each operand is cast with its own dynamic per-tensor scale ``s = fp8_max / max(amax, 1e-12)``
  (torchao computes the quotient in fp64 and rounds it to fp32), rounded *down* to a power of 2,
  ``q = saturate(x * s)``: the input and the weight to ``float8_e4m3fn`` (max 448), the output's
  gradient to ``float8_e5m2`` (max 57344);
- the three matmuls take float8 operands and accumulate in fp32: ``y = qx qw / (sx sw)``,
  ``dx = qg qw^T / (sg sw)``, ``dw = qx^T qg / (sx sg)``, each rounded to its operands' dtype;
- the backward pass keeps the high-precision ``x`` and ``w`` and casts them again (torchao's
  ``force_recompute_fp8_weight_in_bwd``; the casts give the same float8 values and scales).

Power-of-2 scales make the de-scaling exact, so multiplying the fp32 accumulator by ``1/(sa sb)``
(a float8 GEMM) and multiplying the de-scaled operands ``qa/sa`` and ``qb/sb`` in fp32 (torchao's
``emulate=True``) give the same value up to fp32 summation order. :func:`dense` writes the first
(its dots take float8 operands: XLA runs them as float8 GEMMs where the hardware has them, and
converts the operands to fp32 elsewhere); :func:`dense_emulated` the second.

Sharded weights (FSDP): a weight's amax is the max over its shards (an all-reduce of one scalar)
and every device casts its own shard; the partitioner all-gathers the dot's operand, which in
:func:`dense` is the float8 weight: the cast comes before the gather, as torchao's
``enable_fsdp_float8_all_gather`` does. Compiled for tpu7x 2x2x1 (olmo3-tiny, bf16, FSDP over 4),
the step's layer-weight all-gathers move f8e4m3fn: 475,136 bytes against 884,736 in bf16 (the
embedding and LM head stay bf16). In :func:`dense_emulated` the operand is the de-scaled fp32
weight, and XLA's CPU backend gathers that (its bf16 steps, too, gather fp32).

An ``amax`` of 0 gives the scale ``2^48`` for e4m3 (``448 / 1e-12`` rounded down) and zeros; an
``amax`` of inf the scale 0, so NaN at the inf (``inf * 0``) and NaN everywhere in the matmul
(``0 / 0``); a NaN gives NaN: as torchao.
Rounding down is exact here (the scale's exponent bits); torchao's ``exp2(floor(log2(s)))`` in
fp32 rounds a scale within about ``k 2^-24`` (relative) below ``2^k`` up to ``2^k``, an
amax band of that relative width that saturates one extra float8 step (tests/train/test_float8.py).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn      # input and weight
E5M2 = jnp.float8_e5m2        # gradient of the output
EPS = 1e-12                   # torchao's floor under amax (torchao.float8.float8_utils.EPS)
ALIGNMENT = 16                # OLMo-core converts a Linear only if both its dimensions divide by 16


def _fp8_max(dtype) -> np.float32:
    return np.float32(float(jnp.finfo(dtype).max))


def _quotient_at_eps(dtype) -> np.float32:
    """``fp8_max / 1e-12`` computed in fp64 and rounded to fp32, as torchao does."""
    return np.float32(float(jnp.finfo(dtype).max) / EPS)


# The largest fp32 amax that torchao's fp64 clamp raises to 1e-12 (the fp32 next to 1e-12 below it).
_EPS_F32 = np.float32(EPS)
_BELOW_EPS = _EPS_F32 if float(_EPS_F32) < EPS else np.nextafter(_EPS_F32, np.float32(0))


def round_down_to_power_of_2(s: jax.Array) -> jax.Array:
    """The largest power of 2 at most ``s`` (fp32, ``s >= 2^-126``): ``s`` with its mantissa
    bits cleared. 0 stays 0, NaN stays NaN."""
    bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
    rounded = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFF800000), jnp.float32)
    return jnp.where(jnp.isnan(s), s, rounded)


def scale_of(x: jax.Array, dtype) -> jax.Array:
    """torchao's tensorwise dynamic scale of ``x`` for ``dtype`` (fp32 scalar):
    ``fp8_max / max(amax, 1e-12)`` rounded down to a power of 2."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    fp8_max = _fp8_max(dtype)
    # fp32 division is correctly rounded; torchao's fp64 quotient rounded to fp32 is the same
    # value (double rounding from 53 to 24 bits is innocuous for division).
    s = jnp.where(amax <= _BELOW_EPS, _quotient_at_eps(dtype), fp8_max / amax)
    return round_down_to_power_of_2(s)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``x`` in ``dtype`` with its scale: ``saturate(fp32(x) * s)`` and ``s``."""
    s = scale_of(x, dtype)
    fp8_max = _fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * s, -fp8_max, fp8_max).astype(dtype), s


def dequantize(q: jax.Array, s: jax.Array) -> jax.Array:
    """``q / s`` in fp32 (exact: ``s`` is a power of 2)."""
    return q.astype(jnp.float32) / s


def _gemm(a, sa, b, sb, spec: str) -> jax.Array:
    """A float8 GEMM: float8 operands, fp32 accumulation, the accumulator times ``1/(sa sb)``."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * ((1 / sa) * (1 / sb))


def _gemm_emulated(a, sa, b, sb, spec: str) -> jax.Array:
    """torchao's emulation: the de-scaled operands multiplied in fp32."""
    return jnp.einsum(spec, dequantize(a, sa), dequantize(b, sb),
                      preferred_element_type=jnp.float32)


def _make_dense(gemm: Callable) -> Callable:
    @jax.custom_vjp
    def dense8(x: jax.Array, w: jax.Array) -> jax.Array:
        # the weight is quantized from its compute-dtype copy, as torchao quantizes FSDP's bf16
        # parameter (``w`` may be an fp32 master weight, cast inside the layer)
        (qx, sx), (qw, sw) = quantize(x, E4M3), quantize(w.astype(x.dtype), E4M3)
        return gemm(qx, sx, qw, sw, "...i,io->...o").astype(x.dtype)

    def fwd(x, w):
        return dense8(x, w), (x, w)

    def bwd(res, g):
        x, w = res      # high precision: both casts are recomputed
        (qx, sx), (qw, sw) = quantize(x, E4M3), quantize(w.astype(x.dtype), E4M3)
        qg, sg = quantize(g, E5M2)
        dx = gemm(qg, sg, qw, sw, "...o,io->...i").astype(g.dtype)
        n = qx.reshape(-1, qx.shape[-1]), qg.reshape(-1, qg.shape[-1])
        dw = gemm(n[0], sx, n[1], sg, "ni,no->io").astype(g.dtype)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    dense8.defvjp(fwd, bwd)
    return dense8


_dense = _make_dense(_gemm)
_dense_emulated = _make_dense(_gemm_emulated)


def convertible(w: jax.Array) -> bool:
    """Whether OLMo-core converts a Linear of this weight (both dimensions divisible by 16)."""
    return all(d % ALIGNMENT == 0 for d in w.shape[-2:])


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` with float8 GEMMs (see the module docstring); the output in ``x``'s dtype."""
    return _dense(x, w)


def dense_emulated(x: jax.Array, w: jax.Array) -> jax.Array:
    """:func:`dense` as torchao's ``emulate=True`` computes it: float8 casts, fp32 matmuls."""
    return _dense_emulated(x, w)


def float8_dense(high_precision: Callable, emulate: bool) -> Callable:
    """A kernel set's ``dense`` in float8 where OLMo-core converts the layer, else
    ``high_precision``."""
    fp8 = dense_emulated if emulate else dense

    def dense_fn(x: jax.Array, w: jax.Array) -> jax.Array:
        return fp8(x, w) if convertible(w) else high_precision(x, w)
    return dense_fn
