"""``splash``: TPU flash attention through JAX's Pallas splash-attention kernel.

``jax.experimental.pallas.ops.tpu.splash_attention`` computes causal / sliding-window attention
block by block (online softmax in fp32 scratch, bf16 or fp32 matmul operands) and skips every
(query block, key block) pair its mask rules out, in the forward pass and in both backward kernels
(dq; dk and dv). olmax gives it:

- the masks: full layers ``CausalMask``; sliding layers ``LocalMask`` with
  ``window_size=(W - 1, 0)``, i.e. key k is visible from query q iff ``q - W < k <= q`` -- exactly
  W keys including the query itself (OLMo's convention; see ``olmax.model.attention``);
- GQA natively: ``make_splash_mha`` takes keys/values ``[Hkv, T, D]`` and maps query head h to key
  head ``h // (Hq / Hkv)``;
- the softmax scale folded into q (the kernel applies none);
- blocks of ``min(B, T')`` in every kernel (``train.splash_block``, B = 1,024 by default), where
  T' is T rounded up to a multiple of 128 lanes and then of the block. Padding rows lie after
  every real query, so causality hides them from real queries; padded query rows are dropped;
- documents (intra-document masking): the segment ids [B, T] as the kernel's ``SegmentIds``
  (its mask is the static mask and-ed with ``segment[q] == segment[k]``); padded positions get
  a segment of their own (-1), so that no padded row is fully masked;
- one kernel per device: in the training step the call runs per device
  (``olmax.model.logical.per_device``: a ``shard_map`` placing q, k, v by their logical axes --
  batch over ``data x fsdp``, heads over ``tensor`` where it divides both head counts), so XLA never
  gathers q/k/v to run a custom call it cannot partition. Each device ``vmap``s over its sequences;
- context parallelism (``context`` > 1, :mod:`olmax.model.attention_cp`): each device runs the
  kernel on its own queries (two chunks of the zig-zag layout) against the keys it gathered (the
  whole sequence in natural order, or for a window within a chunk its halo layout). The mask is
  the causal / local mask evaluated at the queries' true positions (the kernel's ``q_sequence``);
  where it differs between devices, each device's mask tables are built when the program is
  traced, with equal shapes (no grid shrinking), and the device picks its own by its index in the
  context group. Query and key lengths then differ, with a block each (``min(512, length)``);
- the residuals the backward kernels read, the output and its softmax statistics (one fp32 per
  query row and head), named ``RESIDUALS`` (the kernel's ``residual_checkpoint_name``), so that a
  rematerialisation policy keeps them by that name (``olmax.model.runtime``). The forward kernel
  itself writes the statistics 128 lanes wide; a policy that kept the kernel's raw outputs would
  keep 128 copies of each (for ``olmo3-600m`` at 8 x 4096 tokens, 256 MiB a layer).

In a program compiled for TPU (``native``) the kernel is compiled by Mosaic; elsewhere it runs in
Pallas interpret mode (exact, slow: how the TPU profile's code path is tested on CPU), which is
logged once. Any sequence length the model accepts is padded inside, as above. The kernel's FLOPs are not visible to XLA's cost analysis, so
every call is wrapped in a named scope ``olmax_splash[...]`` that records its shape, and
:func:`kernel_flops` gives the FLOPs the kernels execute (``olmax plan`` adds them to XLA's count).
"""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np

from olmax.model.attention_ref import per_device_attention

log = logging.getLogger(__name__)

LANES = 128
DEFAULT_BLOCK = 1024   # train.splash_block's default (measured on a v5e chip: its comment)
RESIDUALS = "splash_residuals"   # checkpoint name of the kernel's output and softmax statistics
# Matmuls per visited (query block, key block) pair: forward QK^T and PV; backward dq kernel
# QK^T (recomputed), dO V^T, dS K; dkv kernel QK^T (recomputed), P^T dO, dO V^T, dS^T Q.
MATMULS = {"fwd": 2, "dq": 3, "dkv": 4, "dkv_fused": 5}   # dkv_fused: dkv's 4 and dq = dS K


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def block_and_padded_len(t: int, block: int = DEFAULT_BLOCK) -> tuple[int, int]:
    """(block size, padded sequence length) for a sequence of ``t`` tokens."""
    bs = min(block, _round_up(t, LANES))
    return bs, _round_up(t, bs)


def _mask(tp: int, t: int, window: int | None):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as m

    if window is None or window >= t:
        return m.CausalMask((tp, tp))
    return m.LocalMask((tp, tp), window_size=(window - 1, 0), offset=0)


@functools.lru_cache(maxsize=64)
def _kernel(tp: int, t: int, window: int | None, heads: int, block: int, interpret: bool,
            fused_bwd: bool = False):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as m

    # Fused: the dk/dv kernel also accumulates dq (no dq kernel: its blocks are None).
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=None if fused_bwd else block, block_kv_dq=None if fused_bwd else block,
                          use_fused_bwd_kernel=fused_bwd)
    mask = m.MultiHeadMask([_mask(tp, t, window) for _ in range(heads)])
    with jax.ensure_compile_time_eval():  # concrete mask tables, safe to cache across traces
        return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  residual_checkpoint_name=RESIDUALS, interpret=interpret)


@functools.lru_cache(maxsize=256)
def visited_blocks(t: int, window: int | None, block: int = DEFAULT_BLOCK) -> int:
    """(query block, key block) pairs the kernels compute for one head of one sequence."""
    bs, tp = block_and_padded_len(t, block)
    n = tp // bs
    q0 = np.arange(n)[:, None] * bs          # first query of each block
    q1 = q0 + bs - 1                         # last query
    k0 = np.arange(n)[None, :] * bs
    k1 = k0 + bs - 1
    visible = k0 <= q1                       # some key <= some query (causal)
    if window is not None and window < t:
        visible &= k1 > q0 - window          # some key inside the first query's window
    return int(visible.sum())


def split_visited_blocks(t: int, window: int | None, context: int, halo: bool,
                         block: int = DEFAULT_BLOCK, kv_block: int | None = None) -> int:
    """(query block, key block) pairs one head of one sequence visits on the busiest device of a
    context-parallel call (:mod:`olmax.model.attention_cp`): ``t`` is the whole sequence, each
    device's 2C = t / context queries (the zig-zag layout) against the gathered keys in natural
    order, or with ``halo`` against its ``[halo, chunk, halo, chunk]`` keys."""
    from olmax.model import attention_cp as cp

    c = t // (2 * context)
    if halo:
        coords = [cp.halo_query_coords(c, window)]
        tkv = 2 * (c + window)
    else:
        coords = [cp.device_positions(t, context, d) for d in range(context)]
        tkv = t
    bq, tq_p = block_and_padded_len(2 * c, block)
    bkv, tkv_p = block_and_padded_len(tkv, kv_block or block)
    w = tkv_p + tq_p if window is None else window
    best = 0
    for q in coords:
        q = np.concatenate([q, np.full(tq_p - len(q), q[-1])])      # padded rows: the last query
        n = 0
        for i in range(tq_p // bq):
            rows = np.sort(q[i * bq:(i + 1) * bq])
            for k0 in range(0, tkv_p, bkv):
                # some query q of the block sees some key of [k0, k0 + bkv): k0 <= q < k0 + bkv - 1 + w
                lo = np.searchsorted(rows, k0)
                n += bool(lo < len(rows) and rows[lo] < k0 + bkv - 1 + w)
        best = max(best, n)
    return best


def kernel_flops(t: int, window: int | None, heads: int, head_dim: int, batch: int, phase: str,
                 block: int = DEFAULT_BLOCK, *, kv_len: int | None = None,
                 kv_block: int | None = None, context: int = 1, halo: bool = False,
                 fused: bool = False) -> int:
    """FLOPs one call of kernel ``phase`` ('fwd', 'dq', 'dkv') executes: the matmuls of every
    visited block pair, masked entries of partial blocks included (that is what the MXU does).
    ``fused``: the backward in one kernel (``train.splash_fused_bwd``), whose dkv kernel also
    computes dq (5 matmuls a block pair, where the two kernels run 3 + 4).

    A context-parallel call (``context`` > 1; :func:`parse_scope` of its scope gives every
    argument): ``t`` is the device's query length, ``kv_len`` its key length, ``block`` and
    ``kv_block`` their blocks; the count is the busiest device's (the zig-zag layout balances
    them)."""
    if fused and phase == "dkv":
        phase = "dkv_fused"
    if context == 1 or kv_len is None:
        bs, _ = block_and_padded_len(t, block)
        return 2 * MATMULS[phase] * bs * bs * head_dim * visited_blocks(t, window, block) * heads * batch
    whole = t * context
    bq, _ = block_and_padded_len(t, block)
    bkv, _ = block_and_padded_len(kv_len, kv_block or block)
    visited = split_visited_blocks(whole, window, context, halo, block, kv_block or block)
    return 2 * MATMULS[phase] * bq * bkv * head_dim * visited * heads * batch


_SCOPE = "olmax_splash"
SCOPE_RE = re.compile(_SCOPE + r"_t(\d+)_w(\d+|full)_h(\d+)_d(\d+)_b(\d+)_bs(\d+)(_fused)?"
                      r"(?:_kv(\d+)_bk(\d+)_cp(\d+)(halo|gather))?")


def parse_scope(op_name: str) -> dict | None:
    """The shape recorded in a splash call's named scope (as found in HLO op_name metadata)."""
    m = SCOPE_RE.search(op_name)
    if not m:
        return None
    t, w, h, d, b, bs, fused, kv, bk, cp, how = m.groups()
    out = {"t": int(t), "window": None if w == "full" else int(w), "heads": int(h),
           "head_dim": int(d), "batch": int(b), "block": int(bs)}
    if fused:               # the backward in one kernel: its dkv kernel computes dq too
        out["fused"] = True
    if cp is not None:      # a context-parallel call: t is the device's query length
        out.update(kv_len=int(kv), kv_block=int(bk), context=int(cp), halo=how == "halo")
    return out


_warned: set[str] = set()


def _local_splash(q, k, v, segment_ids=None, *, window: int | None, scale: float, block: int,
                  interpret: bool, fused_bwd: bool = False):
    """q: [b, T, Hq, D], k/v: [b, T, Hkv, D], segment_ids [b, T] or None (one device's part)
    -> [b, T, Hq, D]."""
    b, t, hq, d = q.shape
    bs, tp = block_and_padded_len(t, block)
    pad = ((0, 0), (0, tp - t), (0, 0), (0, 0))
    # [b, H, T', D]; the scale is applied to q in fp32 and rounded once to q's dtype.
    qt = jnp.pad((q.astype(jnp.float32) * scale).astype(q.dtype), pad).transpose(0, 2, 1, 3)
    kt = jnp.pad(k, pad).transpose(0, 2, 1, 3)
    vt = jnp.pad(v, pad).transpose(0, 2, 1, 3)
    kernel = _kernel(tp, t, window, hq, bs, interpret, fused_bwd)
    scope = (f"{_SCOPE}_t{t}_w{'full' if window is None or window >= t else window}_h{hq}_d{d}_b{b}_bs{bs}"
             + ("_fused" if fused_bwd else ""))
    with jax.named_scope(scope):
        if segment_ids is None:
            out = jax.vmap(kernel)(qt, kt, vt)
        else:
            from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import (
                SegmentIds)
            seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)
            out = jax.vmap(lambda q_, k_, v_, s_: kernel(q_, k_, v_, segment_ids=SegmentIds(s_, s_)))(
                qt, kt, vt, seg)
    return out.transpose(0, 2, 1, 3)[:, :t]


@functools.lru_cache(maxsize=64)
def _split_tables(tq_p: int, tkv_p: int, coords: tuple, window: int | None, heads: int, bq: int,
                  bkv: int, interpret: bool):
    """Mask tables (forward, dq, dkv) of a context-parallel call, one set per row of ``coords``
    (each device's query coordinates, padded to ``tq_p``), stacked along a leading axis, and the
    kernel's static arguments. The grids are not shrunk and the integer type is chosen for all
    devices together, so that every device's tables have the same shapes and types and the device
    can pick its own at run time."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as m
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi

    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                          block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                          block_q_dq=bq, block_kv_dq=bkv)
    infos, first = [], None
    for rows in coords:
        base = (m.CausalMask((tq_p, tkv_p)) if window is None else
                m.LocalMask((tq_p, tkv_p), window_size=(window - 1, 0), offset=0))
        base.q_sequence = np.asarray(rows, np.int32)        # the queries' true coordinates
        mask = m.MultiHeadMask([base] * heads)
        kw = dict(downcast_smem_data=False, shrink_grid=False)
        infos.append((mi.process_mask(mask, (bq, bkv), **kw)[0],
                      mi.process_mask(mask, (bq, bkv), **kw)[0],
                      mi.process_mask_dkv(mask, (bq, bkv), **kw)[0]))
        if first is None:    # the kernel's static arguments, as splash's own constructor sets them
            with jax.ensure_compile_time_eval():
                first = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                           residual_checkpoint_name=RESIDUALS, interpret=interpret)
    tables = jax.tree.map(lambda *xs: _small_ints(np.stack(xs)), *infos)
    return tables, first.kwargs


def _small_ints(x: np.ndarray) -> np.ndarray:
    """Integer tables in the smallest type that holds every device's entries (they live in the
    TPU's small scalar memory); the query positions (int32 in the kernel) stay as they are."""
    if x.dtype == np.int32 and x.ndim == 4:      # [devices, heads, query blocks, key blocks]
        for t in (np.int8, np.int16):
            if x.size == 0 or (x.min() >= np.iinfo(t).min and x.max() <= np.iinfo(t).max):
                return x.astype(t)
    return x


def _local_splash_split(q, k, v, seg_q, seg_kv, *, window: int | None, halo: bool, n: int,
                        scale: float, block: int, interpret: bool):
    """One device's part of a context-parallel call (:mod:`olmax.model.attention_cp`): its queries
    q [b, 2C, Hq, D] (two chunks of the zig-zag layout) against the keys k/v [b, Tk, Hkv, D] it
    gathered (the whole sequence in natural order, or its halo layout), segment ids ``seg_q``
    [b, 2C] and ``seg_kv`` [b, Tk]. The mask is splash's causal / local mask evaluated at the
    queries' true coordinates (the kernel's ``q_sequence``); with the gathered keys it depends on
    the device, whose tables are picked by its index in the context group."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import (
        SegmentIds, SplashAttentionKernel)
    from olmax.model import attention_cp as cp

    b, tq, hq, d = q.shape
    tk = k.shape[1]
    bq, tq_p = block_and_padded_len(tq, block)
    bkv, tkv_p = block_and_padded_len(tk, block)
    c = tq // 2
    if halo:
        coords = [cp.halo_query_coords(c, window)]
    else:
        coords = [cp.device_positions(tk, n, i) for i in range(n)]
    # padded query rows take the last query's coordinate: they visit no block it does not
    coords = tuple(tuple(np.concatenate([r, np.full(tq_p - tq, r[-1])]).tolist()) for r in coords)
    w = None if window is None or (not halo and window >= tk) else window
    tables, static = _split_tables(tq_p, tkv_p, coords, w, hq, bq, bkv, interpret)
    pick = 0 if len(coords) == 1 else jax.lax.axis_index(cp.AXIS)
    fwd, dq, dkv = jax.tree.map(lambda x: jnp.asarray(x)[pick], tables)
    kernel = SplashAttentionKernel(fwd, dq, dkv, **static)

    qt = jnp.pad((q.astype(jnp.float32) * scale).astype(q.dtype),
                 ((0, 0), (0, tq_p - tq), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    kpad = ((0, 0), (0, tkv_p - tk), (0, 0), (0, 0))
    kt = jnp.pad(k, kpad).transpose(0, 2, 1, 3)
    vt = jnp.pad(v, kpad).transpose(0, 2, 1, 3)
    sq = jnp.pad(seg_q, ((0, 0), (0, tq_p - tq)), constant_values=-1)
    skv = jnp.pad(seg_kv, ((0, 0), (0, tkv_p - tk)), constant_values=-1)
    how = "halo" if halo else "gather"
    scope = (f"{_SCOPE}_t{tq}_w{'full' if w is None else w}_h{hq}_d{d}_b{b}_bs{bq}"
             f"_kv{tk}_bk{bkv}_cp{n}{how}")
    with jax.named_scope(scope):
        out = jax.vmap(lambda q_, k_, v_, a_, b_: kernel(q_, k_, v_, segment_ids=SegmentIds(a_, b_)))(
            qt, kt, vt, sq, skv)
    return out.transpose(0, 2, 1, 3)[:, :tq]


def at_kernel_precision(fn, dtype):
    """``fn(q, k, v, *ids, **static)`` (the kernels' call; ``ids``: integer segment ids, not
    differentiated; ``static``: Python settings), forward and backward traced under JAX's default
    matmul precision when q is 16-bit; ``fn`` itself otherwise.

    Pallas dots take their precision from JAX's configuration when they are traced, and Mosaic
    refuses a 16-bit product at ``highest`` (its compile fails: "Bad lhs type"): a bf16 model run
    under ``jax.default_matmul_precision("highest")`` (``olmax parity``, which asks for it so that
    fp32 means fp32) would not compile on a TPU. A bf16 x bf16 product is exact at any precision;
    the kernels' one fp32 product (probabilities times values) takes one bf16 pass, as in every
    bf16 training step. The backward is traced after the forward returns, so it is held under the
    same setting here (a custom VJP around the kernels' own)."""
    if jnp.dtype(dtype).itemsize > 2:
        return fn

    def call(q, k, v, *ids, **static):
        # ``static``: the call's Python settings (a context-parallel call's window, layout, size)
        @jax.custom_vjp
        def run(q, k, v, *ids):
            with jax.default_matmul_precision("default"):
                return fn(q, k, v, *ids, **static)

        def forward(q, k, v, *ids):
            with jax.default_matmul_precision("default"):
                out, back = jax.vjp(lambda q, k, v: fn(q, k, v, *ids, **static), q, k, v)
            return out, back

        def backward(back, ct):
            with jax.default_matmul_precision("default"):
                return (*back(ct), *(None,) * len(ids))

        run.defvjp(forward, backward)
        return run(q, k, v, *ids)

    return call


def splash_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, window: int | None,
                     scale: float, segment_ids: jnp.ndarray | None = None,
                     block_size: int = DEFAULT_BLOCK, *, native: bool = False,
                     context: int = 1, head_stride: int | None = None,
                     fused_bwd: bool = False) -> jnp.ndarray:
    """q: [B, T, Hq, D], k/v: [B, T, Hkv, D] -> [B, T, Hq, D] in q's dtype (see module docstring);
    ``segment_ids`` [B, T]: the document mask. ``native``: the program compiles for TPU (else
    Pallas interpret mode). ``context`` > 1: the sequence is in the zig-zag layout over that many
    devices and each computes its own queries (:mod:`olmax.model.attention_cp`; ``head_stride``:
    key heads whose keys and values are gathered at a time)."""
    if not native and not _warned:
        _warned.add("interpret")
        log.warning("attention 'splash' runs the TPU kernel in Pallas interpret mode: the program "
                    "does not compile for a TPU (exact but slow; 'chunked' is the fast path off TPU)")
    if context > 1:
        from olmax.model.attention_cp import context_parallel_attention

        local = at_kernel_precision(functools.partial(_local_splash_split, scale=scale,
                                                      block=block_size, interpret=not native), q.dtype)
        return context_parallel_attention(q, k, v, window, scale, context, segment_ids,
                                          local=local, head_stride=head_stride).astype(q.dtype)
    fn = at_kernel_precision(functools.partial(_local_splash, window=window, scale=scale,
                                               block=block_size, interpret=not native,
                                               fused_bwd=fused_bwd), q.dtype)
    return per_device_attention(fn, q, k, v, segment_ids).astype(q.dtype)
