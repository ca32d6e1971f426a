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
    ``[0, (i+1) Bq)`` (block-causal, at least two blocks), about half the reference's T^2 work.
    Every query's whole visible key set lies inside its block's key range, so the softmax is exact
    (no online rescaling) and the result equals the reference up to fp32 summation order.
    Computed heads-major ([B, H, T, D]), so that every product is a row-major batched GEMM.
``dot_product``
    ``jax.nn.dot_product_attention`` (XLA backend) with ``is_causal`` and
    ``local_window_size=(W-1, 0)`` -- the exact arguments the ``cudnn`` path passes, so the tests of
    this implementation against the reference also pin down the window convention given to cuDNN.
``cudnn``
    ``jax.nn.dot_product_attention(implementation="cudnn", local_window_size=(W-1, 0))`` (cuDNN
    flash attention with a sliding window) in a program compiled for a GPU (``native``) with
    bf16/fp16 inputs. Anywhere else (another backend, fp32, or cuDNN refusing the shape at trace
    time) it falls back to ``chunked`` -- the window is always applied, never dropped; a fallback
    is logged once. This fallback is what the ``gpu`` profile runs on CPU.

Every implementation takes optional ``segment_ids`` [B, T] (intra-document masking, see
:mod:`olmax.model.attention_ref`). ``chunked`` gathers them block by block like the keys, so
the block-sparse cost is unchanged; ``dot_product`` passes the document mask as ``mask``.
``cudnn`` with segments runs its fallback: ``jax.nn.dot_product_attention`` (jax 0.10) takes no
segment ids for cuDNN, only a dense mask, which it would turn into a [B, 1, T, T] bias.
"""

from __future__ import annotations

import logging
import math
from functools import partial

import jax
import jax.numpy as jnp

from olmax.model.attention_ref import NEG, per_device_attention, same_segment

log = logging.getLogger(__name__)

DEFAULT_BLOCK = 512


def _softmax_pv_forward(q, k, v, mask, scale):
    scores = jnp.einsum("...rd,...cd->...rc", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask, scores, NEG)
    m = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - m)                     # jax.nn.softmax's formula, so the same numbers
    den = jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum("...rc,...cd->...rd", (e / den).astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out, m + jnp.log(den)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _softmax_pv(q, k, v, mask, scale):
    """fp32 scores -> masked softmax -> probs @ v (fp32) for ``q`` [..., r, D] (query rows) and
    ``k``, ``v`` [..., c, D] (keys), the leading dimensions batch dimensions, ``mask``
    broadcastable to [..., r, c].

    Every product is a row-major batched GEMM: the batch dimensions lead (heads before positions)
    and no operand is contracted over its major dimension, which XLA's CPU backend would hand to a
    slower dot on operands converted to fp32 (benchmarks/notes/2026-11-30-cpu-shapes-a-and-b-before-and-after.md).

    The backward pass is flash attention's: from q, k, v, the output and the rows' logsumexp it
    recomputes the probabilities (``exp(scores - lse)``) instead of keeping them, so a layer holds
    no [.., r, c] scores or probabilities between its forward and backward passes, and the
    softmax's backward is one element-wise pass, ``ds = p (dp - rowsum(do o)) scale``. GEMM inputs
    are in the compute dtype, accumulation fp32."""
    return _softmax_pv_forward(q, k, v, mask, scale)[0]


def _softmax_pv_fwd(q, k, v, mask, scale):
    out, lse = _softmax_pv_forward(q, k, v, mask, scale)
    return out, (q, k, v, mask, out, lse)


def _rows_major(x_t: jnp.ndarray) -> jnp.ndarray:
    """[..., c, r] -> [..., r, c] as a real copy. A plain transposition would be folded into the
    next dot as a contraction over its operand's major dimension (the slow dot above); splitting
    c first makes it a 3-D transposition XLA keeps."""
    *lead, c, r = x_t.shape
    split = 2 if c % 2 == 0 else 1
    return jnp.moveaxis(x_t.reshape(*lead, split, c // split, r), -1, -3).reshape(*lead, r, c)


def depend_on(x: jnp.ndarray, dep: jnp.ndarray) -> jnp.ndarray:
    """``x`` unchanged (plus an exact zero), but computed from ``dep``, so that nothing consuming
    it can be scheduled before ``dep`` exists. The backward pass's recomputation depends only on
    forward values, and XLA's CPU scheduler would otherwise hoist it into the forward pass, keeping
    every layer's fp32 probabilities alive until the backward (``optimization_barrier`` does not
    hold: that pipeline removes it before scheduling). The zero is -0.0, the exact additive
    identity, also when ``dep`` is not finite; XLA does not fold a float times zero away."""
    d0 = dep.reshape(-1)[0]
    zero = jnp.where(jnp.isfinite(d0), -(jnp.abs(d0) * 0), -0.0)
    return x + zero.astype(x.dtype)


def _softmax_pv_bwd(scale, res, d_out):
    q, k, v, mask, out, lse = res
    q = depend_on(q, d_out)
    # Recomputed key-major, [..., c, r]: the gradients of k and v contract over the query rows,
    # which are then the minor dimension of both operands.
    mask_t = jnp.swapaxes(mask, -1, -2)
    scores_t = jnp.einsum("...cd,...rd->...cr", k, q, preferred_element_type=jnp.float32) * scale
    p_t = jnp.exp(jnp.where(mask_t, scores_t, NEG) - jnp.swapaxes(lse, -1, -2))   # 0 where masked
    do = d_out.astype(v.dtype)
    dv = jnp.einsum("...cr,...rd->...cd", p_t.astype(v.dtype), do, preferred_element_type=jnp.float32)
    dp_t = jnp.einsum("...cd,...rd->...cr", v, do, preferred_element_type=jnp.float32)
    delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1)[..., None, :]
    ds_t = (p_t * (dp_t - delta) * scale).astype(q.dtype)
    dk = jnp.einsum("...cr,...rd->...cd", ds_t, q, preferred_element_type=jnp.float32)
    dq = jnp.einsum("...rc,...cd->...rd", _rows_major(ds_t), k, preferred_element_type=jnp.float32)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_softmax_pv.defvjp(_softmax_pv_fwd, _softmax_pv_bwd)


def _pad_time(x: jnp.ndarray, left: int, right: int) -> jnp.ndarray:
    """Pad the positions (axis 2 of [B, H, T, ...])."""
    if not (left or right):
        return x
    return jnp.pad(x, ((0, 0), (0, 0), (left, right)) + ((0, 0),) * (x.ndim - 3))


def _rows(mask: jnp.ndarray, g: int) -> jnp.ndarray:
    """[..., r, c] -> [..., r * g, c]: a query position's row for each of its group's heads."""
    *lead, r, c = mask.shape
    return jnp.broadcast_to(mask[..., None, :], (*lead, r, g, c)).reshape(*lead, r * g, c)


def _with_segments(mask: jnp.ndarray, seg_q: jnp.ndarray | None, seg_k: jnp.ndarray | None,
                   g: int) -> jnp.ndarray:
    """``mask`` [..., r * g, c] (no batch dimension) and, with segments ``seg_q`` [B, ..., r] and
    ``seg_k`` [B, ..., c], also the document mask: [B, 1, ..., r * g, c] (1: the key heads)."""
    if seg_q is None:
        return mask
    docs = _rows(seg_q[..., :, None] == seg_k[..., None, :], g)
    return (mask & docs)[:, None]


def _sliding_blocks(qh, kh, vh, window: int, scale: float, bq: int, seg=None) -> jnp.ndarray:
    """qh: [B, Hkv, Tp, G, D] with Tp = nb*bq; kh/vh: [B, Hkv, Tp, D]; window < Tp; ``seg``
    [B, Tp] or None. Returns [B, Hkv, Tp, G, D] (fp32)."""
    b, hkv, tp, g, d = qh.shape
    nb = tp // bq
    n_kb = math.ceil((window - 1) / bq) + 1        # key blocks covering [i*bq - W + 1, (i+1)*bq)
    n_kb = min(n_kb, nb)
    pad = (n_kb - 1) * bq
    kb = _pad_time(kh, pad, 0).reshape(b, hkv, nb + n_kb - 1, bq, d)
    vb = _pad_time(vh, pad, 0).reshape(b, hkv, nb + n_kb - 1, bq, d)
    # Key window of query block i = key blocks i .. i+n_kb-1 of the left-padded sequence.
    kw = jnp.concatenate([kb[:, :, j:j + nb] for j in range(n_kb)], axis=3)   # [B, Hkv, nb, n_kb*bq, D]
    vw = jnp.concatenate([vb[:, :, j:j + nb] for j in range(n_kb)], axis=3)
    qpos = jnp.arange(nb)[:, None, None] * bq + jnp.arange(bq)[None, :, None]           # [nb,bq,1]
    kpos = jnp.arange(nb)[:, None, None] * bq - pad + jnp.arange(n_kb * bq)[None, None, :]
    mask = (kpos >= 0) & (kpos <= qpos) & (kpos > qpos - window)                        # [nb,bq,K]
    # Query rows of a block: its positions x the group's heads (position-major, as qh lies).
    mask = _rows(mask, g)
    if seg is not None:       # key segments gathered like the keys (left padding: masked by kpos)
        sb = jnp.pad(seg, ((0, 0), (pad, 0)), constant_values=-2).reshape(b, nb + n_kb - 1, bq)
        seg_k = jnp.concatenate([sb[:, j:j + nb] for j in range(n_kb)], axis=2)      # [B, nb, K]
        mask = _with_segments(mask, seg.reshape(b, nb, bq), seg_k, g)
    out = _softmax_pv(qh.reshape(b, hkv, nb, bq * g, d), kw, vw, mask, scale)
    return out.reshape(b, hkv, tp, g, d)


def _causal_mask(q_start: int, q_end: int, k_end: int, g: int, seg=None) -> jnp.ndarray:
    """[(q_end - q_start) * g, k_end]: query row (position, group head) sees keys <= position;
    with segments ``seg`` [B, >= q_end] also only its document's keys ([B, 1, rows, k_end])."""
    mask = _rows(jnp.arange(k_end)[None, :] <= jnp.arange(q_start, q_end)[:, None], g)
    return mask if seg is None else _with_segments(mask, seg[:, q_start:q_end], seg[:, :k_end], g)


def _causal_blocks(qh, kh, vh, scale: float, bq: int, seg=None) -> jnp.ndarray:
    """Full causal attention, query block i against the key prefix [0, (i+1)*bq)."""
    b, hkv, tp, g, d = qh.shape
    outs = []
    for i in range(tp // bq):
        end = (i + 1) * bq
        qi = qh[:, :, i * bq:end].reshape(b, hkv, bq * g, d)
        outs.append(_softmax_pv(qi, kh[:, :, :end], vh[:, :, :end],
                                _causal_mask(i * bq, end, end, g, seg), scale).reshape(b, hkv, bq, g, d))
    return jnp.concatenate(outs, axis=2)


def chunked_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, window: int | None,
                      scale: float, segment_ids: jnp.ndarray | None = None,
                      block_size: int = DEFAULT_BLOCK) -> jnp.ndarray:
    """Block-sparse causal/sliding-window attention (see module docstring). Computed heads-major,
    [B, Hkv, T, G, D]: one transposition of q, k, v in and of the output out."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    full = window is None or window >= t
    # Full layers: at least two query blocks, so that the upper triangle's blocks are skipped.
    bq = min(block_size, -(-t // 2)) if full else min(block_size, window, t)
    if full and bq >= t:                      # one block: the whole causal square
        out = _softmax_pv(qh.reshape(b, hkv, t * g, d), kh, vh, _causal_mask(0, t, t, g, segment_ids),
                          scale)
    else:
        nb = -(-t // bq)
        right = nb * bq - t   # padded keys lie after every real query: masked by causality
        qp, kp, vp = _pad_time(qh, 0, right), _pad_time(kh, 0, right), _pad_time(vh, 0, right)
        # Padded positions form a segment of their own (-1), so their rows still see themselves.
        seg = None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (0, right)),
                                                       constant_values=-1)
        blocks = _causal_blocks if full else partial(_sliding_blocks, window=window)
        out = blocks(qp, kp, vp, scale=scale, bq=bq, seg=seg)[:, :, :t]
    out = out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def _window_args(window: int | None, t: int) -> tuple[int, int] | None:
    """OLMo window W -> ``local_window_size`` (left, right) = (W-1, 0); None when W >= T."""
    return None if window is None or window >= t else (window - 1, 0)


def dot_product_attention(q, k, v, window: int | None, scale: float,
                          segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
    """``jax.nn.dot_product_attention`` on its XLA backend, window passed as local_window_size,
    the document mask (if any) as ``mask``."""
    mask = None if segment_ids is None else same_segment(segment_ids, segment_ids)[:, None]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                       local_window_size=_window_args(window, q.shape[1]),
                                       implementation="xla")
    return out.astype(q.dtype)


_warned: set[str] = set()


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("attention 'cudnn' unavailable (%s): using 'chunked' (window kept)", reason)


def cudnn_attention(q, k, v, window: int | None, scale: float,
                    segment_ids: jnp.ndarray | None = None, *, native: bool = False) -> jnp.ndarray:
    """cuDNN flash attention with the sliding window in a program compiled for a GPU
    (``native``); ``chunked`` elsewhere, and with segment ids (see the module docstring)."""
    if not native:
        _fallback("the program does not compile for a GPU")
        return chunked_attention(q, k, v, window, scale, segment_ids)
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        _fallback(f"dtype {q.dtype} (cuDNN needs bf16/fp16)")
        return chunked_attention(q, k, v, window, scale, segment_ids)
    if segment_ids is not None:
        _fallback("segment ids (no cuDNN document mask in jax.nn.dot_product_attention)")
        return chunked_attention(q, k, v, window, scale, segment_ids)

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
