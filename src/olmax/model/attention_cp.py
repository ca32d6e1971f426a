"""Context-parallel attention: each device computes attention for its own queries only.

Under context parallelism (``mesh.context`` = N > 1) the positions of every sequence are split over
the N devices of a context group. Attention implementations that support it
(:data:`SPLIT_IMPLS`: ``splash``, the TPU kernel, and ``xla``, its exact dense reference) run per
device (a ``shard_map`` through :func:`olmax.model.logical.per_device`, the sequence axis split over
``context``) on the device's own queries:

- **Load balancing (zig-zag layout).** The training step (``olmax.train.step``) cuts each sequence
  into 2N chunks of C = T / 2N positions and reorders them so that device d holds chunks d and
  2N-1-d (:func:`to_zigzag`): tokens, labels, segment ids and RoPE positions, all computed in
  natural order first, are permuted alike. Every device then has the same causal work (its two
  chunks see 2N+1 chunks of keys in all). Pointwise layers and the summed loss do not care about
  the order; attention masks by the true (natural) positions, which are a static function of the
  layout (:func:`device_positions`). Chosen over reordering inside attention because it costs no
  communication at all: the permutation is applied once to the (row-sharded, whole-sequence) batch
  before the model, where it is a local copy. Implementations that keep whole sequences or leave
  the partitioning to GSPMD (``chunked``, ``dot_product``, ``cudnn``) mask by array index, so the
  step keeps the natural layout for them (``Runtime.context`` stays 1).
- **Full-attention layers (all-gather KV, AI2's "llama3" scheme).** Keys, values and segment ids
  are all-gathered over ``context`` (tiled) and put back in natural order; queries stay local.
  The device's mask (causal, or a window larger than a chunk) depends on which chunks it holds:
  the splash kernel takes it as mask tables indexed by the device's position in the group.
- **Sliding-window layers (halo exchange).** A window W no larger than a chunk needs, for each of
  the device's chunks, only the last W keys of the chunk before it: chunk d's predecessor is chunk
  d-1, the first chunk of device d-1; chunk 2N-1-d's is chunk 2N-2-d, the second chunk of device
  d+1 (for d = N-1 its own first chunk). Two ``ppermute``s of W positions replace the all-gather of
  T; the first chunk of the sequence gets a halo that no query may see (segment id
  :data:`HALO_NONE`). The keys are laid out ``[halo_A, A, halo_B, B]`` and the mask is the same
  static local mask on every device.

Segment ids (documents) travel with the keys; without documents every position is segment 0.
With ``train.context_head_stride`` the keys and values of a few key heads are gathered at a time
(AI2's ``head_stride``), bounding the gathered buffers to those heads'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from olmax.model.attention_ref import masked_attention, same_segment
from olmax.model.logical import per_device

SPLIT_IMPLS = ("xla", "splash")
AXIS = "context"
HALO_NONE = -2      # segment id of keys that exist in no sequence (the halo of the first chunk)

# q, k, v and segment ids, positions split over ``context`` (unlike attention_ref.QKV_AXES)
QKV_SEQ_AXES = (("batch", "seq", "act_heads", "head_dim"),
                ("batch", "seq", "act_kv_heads", "head_dim"),
                ("batch", "seq", "act_kv_heads", "head_dim"))
SEGMENT_SEQ_AXES = ("batch", "seq")


def zigzag_order(t: int, n: int) -> np.ndarray:
    """int [T]: the natural position held at each index of the zig-zag layout over ``n`` devices
    (device d's block of 2C indices holds chunks d and 2N-1-d)."""
    c = t // (2 * n)
    chunks = [j for d in range(n) for j in (d, 2 * n - 1 - d)]
    return (np.asarray(chunks)[:, None] * c + np.arange(c)[None, :]).reshape(-1)


def to_zigzag(x: jnp.ndarray, n: int, axis: int = 1) -> jnp.ndarray:
    """``x`` in natural order along ``axis`` -> the zig-zag layout (identity for ``n`` = 1)."""
    return x if n == 1 else jnp.take(x, zigzag_order(x.shape[axis], n), axis=axis)


def from_zigzag(x: jnp.ndarray, n: int, axis: int = 1) -> jnp.ndarray:
    """The inverse of :func:`to_zigzag`."""
    return x if n == 1 else jnp.take(x, np.argsort(zigzag_order(x.shape[axis], n)), axis=axis)


def balanced(t: int, n: int) -> bool:
    """Whether a sequence of ``t`` positions can take the zig-zag layout over ``n`` devices."""
    return n > 1 and t % (2 * n) == 0


def device_positions(t: int, n: int, d: int) -> np.ndarray:
    """int [2C]: the natural positions of device ``d``'s queries in the zig-zag layout."""
    c = t // (2 * n)
    return np.concatenate([d * c + np.arange(c), (2 * n - 1 - d) * c + np.arange(c)])


def uses_halo(window: int | None, chunk: int) -> bool:
    """Sliding-window layers whose window fits in one chunk exchange halos instead of gathering."""
    return window is not None and window <= chunk


def halo_query_coords(c: int, window: int) -> np.ndarray:
    """int [2C]: each local query's index into the keys' halo layout ``[halo_A, A, halo_B, B]``."""
    return np.concatenate([window + np.arange(c), 2 * window + c + np.arange(c)])


def _gather_natural(x: jnp.ndarray, n: int) -> jnp.ndarray:
    """A device's block [b, 2C, ...] -> the whole sequence [b, T, ...] in natural order."""
    return from_zigzag(jax.lax.all_gather(x, AXIS, axis=1, tiled=True), n)


def _halo(x: jnp.ndarray, n: int, window: int, fill=None) -> jnp.ndarray:
    """A device's block [b, 2C, ...] (chunks A, B) -> ``[halo_A, A, halo_B, B]`` (see the module
    docstring); the first chunk's halo is ``fill`` (zeros when None)."""
    c = x.shape[1] // 2
    a, b = x[:, :c], x[:, c:]
    d = jax.lax.axis_index(AXIS)
    # chunk d-1 is the first chunk of device d-1; chunk 2N-2-d the second chunk of device d+1
    halo_a = jax.lax.ppermute(a[:, -window:], AXIS, [(i, i + 1) for i in range(n - 1)])
    halo_b = jax.lax.ppermute(b[:, -window:], AXIS, [(i + 1, i) for i in range(n - 1)])
    halo_b = jnp.where(d == n - 1, a[:, -window:], halo_b)      # device N-1: its own first chunk
    if fill is not None:
        halo_a = jnp.where(d == 0, jnp.full_like(halo_a, fill), halo_a)
    return jnp.concatenate([halo_a, a, halo_b, b], axis=1)


def gathered_kv(k, v, seg, n: int, window: int | None):
    """Inside the per-device program: the keys, values and key segment ids a device's queries need,
    and how its queries index them: ``(k, v, seg_kv, q_coords, halo)``. ``q_coords`` [2C] int32
    (traced: it depends on the device) are the queries' positions in the returned key axis."""
    c = k.shape[1] // 2
    if uses_halo(window, c):
        coords = jnp.asarray(halo_query_coords(c, window), jnp.int32)
        return (_halo(k, n, window), _halo(v, n, window), _halo(seg, n, window, HALO_NONE),
                coords, True)
    t = 2 * c * n
    table = jnp.asarray(np.stack([device_positions(t, n, d) for d in range(n)]), jnp.int32)
    coords = table[jax.lax.axis_index(AXIS)]
    return _gather_natural(k, n), _gather_natural(v, n), _gather_natural(seg, n), coords, False


def reference_local(q, k, v, seg_q, seg_kv, q_coords, window: int | None, scale: float):
    """The ``xla`` reference on one device: queries at key-axis coordinates ``q_coords`` [Tq]
    against keys [Tk] (causal and windowed by coordinates, and within documents), with the
    arithmetic of :func:`olmax.model.attention_ref.xla_attention`."""
    qi = q_coords[:, None]
    kj = jnp.arange(k.shape[1])[None, :]
    mask = kj <= qi
    if window is not None:
        mask = mask & (kj > qi - window)
    mask = (mask[None] & same_segment(seg_q, seg_kv))[:, None, None]     # [b, 1, 1, Tq, Tk]
    return masked_attention(q, k, v, mask, scale)


def context_parallel_attention(q, k, v, window: int | None, scale: float, n: int,
                               segment_ids=None, *, local=None, head_stride: int | None = None):
    """Attention of q [B, T, Hq, D], k/v [B, T, Hkv, D] in the zig-zag layout over ``n`` context
    devices, each device computing its own queries (module docstring). ``local(q, k, v, seg_q,
    seg_kv, window=, halo=, n=)`` computes one device's part (default: :func:`reference_local`).

    ``head_stride`` (AI2's llama3 ``head_stride``): each device gathers the keys and values of that
    many of its key heads at a time (with their query heads), the groups one after the other in a
    loop, so that only one group's gathered keys and values are live; None, or a stride that does
    not divide the device's key heads: all at once."""
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)

    def heads(q, k, v, seg):
        kk, vv, seg_kv, coords, halo = gathered_kv(k, v, seg, n, window)
        if local is None:
            return reference_local(q, kk, vv, seg, seg_kv, coords, window, scale)
        return local(q, kk, vv, seg, seg_kv, window=window, halo=halo, n=n)

    def per_dev(q, k, v, seg):
        seg = seg.astype(jnp.int32)
        b, t, hq, d = q.shape
        hkv = k.shape[2]
        s = head_stride
        if s is None or s >= hkv or hkv % s:
            return heads(q, k, v, seg)
        # groups of s key heads and their s * (Hq / Hkv) query heads, leading: [G, b, t, ...]
        group = lambda x: jnp.moveaxis(x.reshape(b, t, hkv // s, -1, d), 2, 0)  # noqa: E731
        out = jax.lax.map(lambda x: heads(*x, seg), (group(q), group(k), group(v)))
        return jnp.moveaxis(out, 0, 2).reshape(b, t, hq, d)

    return per_device(per_dev, (q, k, v, segment_ids), QKV_SEQ_AXES + (SEGMENT_SEQ_AXES,))
