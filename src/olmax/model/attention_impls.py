"""Attention implementations that scale with the sliding window, listed in
``olmax.model.attention.IMPLEMENTATIONS`` next to the ``xla`` reference.

All take ``q: [B, T, Hq, D]``, ``k, v: [B, T, Hkv, D]`` (GQA: Hq a multiple of Hkv), the layer's
window (OLMo semantics: query q sees keys ``q - W < k <= q``; None = full causal) and the softmax
scale, and return ``[B, T, Hq, D]`` in q's dtype. Scores and softmax are fp32, as in the reference.

``chunked``
    Block-sparse attention in plain XLA. Queries are cut into blocks of ``Bq`` positions.
    *Sliding layers* (W < T): query block i attends only to the keys ``[i Bq - W + 1, (i+1) Bq)``,
    gathered as ``ceil((W-1)/Bq) + 1`` key blocks, all query blocks in one batched matmul: cost
    O(T (W + Bq)) instead of O(T^2). *Full layers*: query block i attends to the key prefix
    ``[0, (i+1) Bq)`` (block-causal), about half the reference's T^2 work. Every query's whole
    visible key set lies inside its block's key range, so the softmax is exact (no online
    rescaling) and the result equals the reference up to fp32 summation order.
``dot_product``
    ``jax.nn.dot_product_attention`` (XLA backend) with ``is_causal`` and
    ``local_window_size=(W-1, 0)`` -- the exact arguments the ``cudnn`` path passes, so the tests of
    this implementation against the reference also pin down the window convention given to cuDNN.
``cudnn``
    ``jax.nn.dot_product_attention(implementation="cudnn", local_window_size=(W-1, 0))`` (cuDNN
    flash attention with a sliding window) when the arrays live on an NVIDIA GPU and are bf16/fp16.
    Anywhere else (CPU/TPU, fp32, or cuDNN refusing the shape at trace time) it falls back to
    ``chunked`` -- the window is always applied, never dropped; a fallback is logged once.
"""

from __future__ import annotations

import logging
import math
from functools import partial

import jax
import jax.numpy as jnp

from olmax.model.attention_ref import NEG, per_device_attention
from olmax.model.logical import context_platform

log = logging.getLogger(__name__)

DEFAULT_BLOCK = 512


def _scores(q, k, mask, scale, q_spec: str, k_spec: str):
    s_spec = f"{q_spec[:-4]}hgqk"
    scores = jnp.einsum(f"{q_spec},{k_spec}->{s_spec}", q, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask, scores, NEG), s_spec


def _softmax_pv_forward(q, k, v, mask, scale, q_spec, k_spec):
    scores, s_spec = _scores(q, k, mask, scale, q_spec, k_spec)
    m = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - m)                     # jax.nn.softmax's formula, so the same numbers
    den = jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum(f"{s_spec},{k_spec}->{q_spec}", (e / den).astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out, m + jnp.log(den)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _softmax_pv(q, k, v, mask, scale, q_spec: str, k_spec: str):
    """fp32 scores -> masked softmax -> probs @ v (fp32), for grouped queries.

    ``q_spec``/``k_spec`` are the einsum subscripts of q (``...qhgd``) and k/v (``...khd``).
    The backward pass is flash attention's: from q, k, v, the output and the rows' logsumexp it
    recomputes the probabilities (``exp(scores - lse)``) instead of keeping them from the forward
    pass, so a layer holds no [.., q, k] scores or probabilities between its forward and backward
    passes (at batch 8 x 512, 4 heads-groups of 8: 67 MB per array per layer, several per layer
    under autodiff), and the softmax's backward is one element-wise pass,
    ``ds = p (dp - rowsum(do o)) scale``. GEMM inputs are in the compute dtype, accumulation fp32."""
    return _softmax_pv_forward(q, k, v, mask, scale, q_spec, k_spec)[0]


def _softmax_pv_fwd(q, k, v, mask, scale, q_spec, k_spec):
    out, lse = _softmax_pv_forward(q, k, v, mask, scale, q_spec, k_spec)
    return out, (q, k, v, mask, out, lse)


def _softmax_pv_bwd(scale, q_spec, k_spec, res, d_out):
    q, k, v, mask, out, lse = res
    lead = q_spec[:-4]
    n = len(lead)
    # Recomputed key-major, [.., h, k, g, q]: the gradients of k and v contract over the queries,
    # which are then the minor dimensions, and only dq's product needs a transposed operand.
    t_spec = f"{lead}hkgq"
    to_t = tuple(range(n)) + (n, n + 3, n + 1, n + 2)          # [.., h, g, q, k] -> [.., h, k, g, q]
    mask_t = jnp.transpose(jnp.reshape(mask, (1,) * (n + 4 - mask.ndim) + mask.shape), to_t)
    scores_t = jnp.einsum(f"{k_spec},{q_spec}->{t_spec}", k, q, preferred_element_type=jnp.float32) * scale
    p_t = jnp.exp(jnp.where(mask_t, scores_t, NEG) - jnp.transpose(lse, to_t))   # 0 where masked
    do = d_out.astype(v.dtype)
    dv = jnp.einsum(f"{t_spec},{q_spec}->{k_spec}", p_t.astype(v.dtype), do, preferred_element_type=jnp.float32)
    dp_t = jnp.einsum(f"{k_spec},{q_spec}->{t_spec}", v, do, preferred_element_type=jnp.float32)
    delta_t = jnp.einsum(f"{q_spec},{q_spec}->{lead}hgq", d_out.astype(jnp.float32), out)[..., None, :, :]
    ds_t = (p_t * (dp_t - delta_t) * scale).astype(q.dtype)
    dk = jnp.einsum(f"{t_spec},{q_spec}->{k_spec}", ds_t, q, preferred_element_type=jnp.float32)
    dq = jnp.einsum(f"{t_spec},{k_spec}->{q_spec}", ds_t, k, preferred_element_type=jnp.float32)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_softmax_pv.defvjp(_softmax_pv_fwd, _softmax_pv_bwd)


def _pad_time(x: jnp.ndarray, left: int, right: int) -> jnp.ndarray:
    if not (left or right):
        return x
    return jnp.pad(x, ((0, 0), (left, right)) + ((0, 0),) * (x.ndim - 2))


def _sliding_blocks(qg, k, v, window: int, scale: float, bq: int) -> jnp.ndarray:
    """qg: [B, Tp, Hkv, G, D] with Tp = nb*bq; k/v: [B, Tp, Hkv, D]; window < Tp."""
    b, tp, hkv, g, d = qg.shape
    nb = tp // bq
    n_kb = math.ceil((window - 1) / bq) + 1        # key blocks covering [i*bq - W + 1, (i+1)*bq)
    n_kb = min(n_kb, nb)
    pad = (n_kb - 1) * bq
    kb = _pad_time(k, pad, 0).reshape(b, nb + n_kb - 1, bq, hkv, d)
    vb = _pad_time(v, pad, 0).reshape(b, nb + n_kb - 1, bq, hkv, d)
    # Key window of query block i = key blocks i .. i+n_kb-1 of the left-padded sequence.
    kw = jnp.concatenate([kb[:, j:j + nb] for j in range(n_kb)], axis=2)   # [B, nb, n_kb*bq, Hkv, D]
    vw = jnp.concatenate([vb[:, j:j + nb] for j in range(n_kb)], axis=2)
    qpos = jnp.arange(nb)[:, None, None] * bq + jnp.arange(bq)[None, :, None]           # [nb,bq,1]
    kpos = jnp.arange(nb)[:, None, None] * bq - pad + jnp.arange(n_kb * bq)[None, None, :]
    mask = (kpos >= 0) & (kpos <= qpos) & (kpos > qpos - window)                        # [nb,bq,K]
    mask = mask[None, :, None, None]                                                    # b n h g q k
    qb = qg.reshape(b, nb, bq, hkv, g, d)
    out = _softmax_pv(qb, kw, vw, mask, scale, "bnqhgd", "bnkhd")
    return out.reshape(b, tp, hkv, g, d)


def _causal_blocks(qg, k, v, scale: float, bq: int) -> jnp.ndarray:
    """Full causal attention, query block i against the key prefix [0, (i+1)*bq)."""
    tp = qg.shape[1]
    outs = []
    for i in range(tp // bq):
        end = (i + 1) * bq
        qpos = jnp.arange(i * bq, end)[:, None]
        mask = jnp.arange(end)[None, :] <= qpos                       # [bq, end]
        outs.append(_softmax_pv(qg[:, i * bq:end], k[:, :end], v[:, :end], mask, scale,
                                "bqhgd", "bkhd"))
    return jnp.concatenate(outs, axis=1)


def chunked_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, window: int | None,
                      scale: float, block_size: int = DEFAULT_BLOCK) -> jnp.ndarray:
    """Block-sparse causal/sliding-window attention (see module docstring)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    full = window is None or window >= t
    bq = min(block_size, t) if full else min(block_size, window, t)
    if full and bq >= t:                      # one block: the whole causal square
        qg = q.reshape(b, t, hkv, hq // hkv, d)
        mask = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
        return _softmax_pv(qg, k, v, mask, scale, "bqhgd", "bkhd").reshape(b, t, hq, d).astype(q.dtype)
    nb = -(-t // bq)
    right = nb * bq - t   # padded keys lie after every real query: masked by causality
    qg = _pad_time(q, 0, right).reshape(b, nb * bq, hkv, hq // hkv, d)
    kp, vp = _pad_time(k, 0, right), _pad_time(v, 0, right)
    if full:
        out = _causal_blocks(qg, kp, vp, scale, bq)
    else:
        out = _sliding_blocks(qg, kp, vp, window, scale, bq)
    return out.reshape(b, nb * bq, hq, d)[:, :t].astype(q.dtype)


def _window_args(window: int | None, t: int) -> tuple[int, int] | None:
    """OLMo window W -> ``local_window_size`` (left, right) = (W-1, 0); None when W >= T."""
    return None if window is None or window >= t else (window - 1, 0)


def dot_product_attention(q, k, v, window: int | None, scale: float) -> jnp.ndarray:
    """``jax.nn.dot_product_attention`` on its XLA backend, window passed as local_window_size."""
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                       local_window_size=_window_args(window, q.shape[1]),
                                       implementation="xla")
    return out.astype(q.dtype)


def _on_gpu(x: jnp.ndarray) -> bool:
    try:
        devices = x.devices()  # concrete arrays
    except Exception:  # tracers: decide by the platform the computation compiles for
        return context_platform() in ("gpu", "cuda", "rocm")
    return all(dev.platform == "gpu" for dev in devices)


_warned: set[str] = set()


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("attention 'cudnn' unavailable (%s): using 'chunked' (window kept)", reason)


def cudnn_attention(q, k, v, window: int | None, scale: float) -> jnp.ndarray:
    """cuDNN flash attention with the sliding window on NVIDIA GPUs; ``chunked`` elsewhere."""
    if not _on_gpu(q):
        _fallback(f"no GPU (backend {jax.default_backend()})")
        return chunked_attention(q, k, v, window, scale)
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        _fallback(f"dtype {q.dtype} (cuDNN needs bf16/fp16)")
        return chunked_attention(q, k, v, window, scale)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                            local_window_size=_window_args(window, q.shape[1]),
                                            implementation="cudnn")
    try:
        return per_device_attention(cudnn, q, k, v)
    except (ValueError, NotImplementedError, RuntimeError) as e:  # raised at trace time
        _fallback(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return chunked_attention(q, k, v, window, scale)


def chunked_with_block(block_size: int):
    """``chunked`` with a given query block size (for tests and benchmarks)."""
    return partial(chunked_attention, block_size=block_size)
