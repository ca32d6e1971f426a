"""One training step, in three named stages that :func:`make_train_step` composes:

1. :func:`batch_rows`: the batch's rows as the model reads them (labels, documents -> segment
   ids, the context-parallel layout);
2. :func:`accumulate_gradients`: forward/backward over the micro-batches, gradients summed;
3. :func:`apply_update`: SkipStep AdamW and the step's metrics.

The global batch ``tokens`` [B, T] (sharded by rows over ``data x fsdp``) is split into
``n_micro = B / (micro_batch_size * dp)`` micro-batches; micro-batch k holds rows
``k, k + n_micro, k + 2 n_micro, ...`` so that each device keeps its own rows. Every micro-batch's
loss is divided by the whole batch's scored-token count (OLMo-core normalisation), so the summed
gradients are the full-batch gradient. Gradients and sums accumulate in fp32; parameters and Adam
state stay fp32, the forward runs in ``train.compute_dtype`` (:class:`olmax.model.runtime.Runtime`).

The platform profile (``train.profile``, :mod:`olmax.platforms`) is resolved here, once, for the
devices the step compiles for (the mesh's), and the model reads it from the Runtime.

Packed sequences: a batch with ``doc_lens`` int32 [B, D] (OLMo-core's, zero-padded) trains with
intra-document masking: the step turns them into segment ids [B, T]
(:mod:`olmax.model.documents`), split into micro-batches and placed by rows like the tokens; the
model keeps attention inside documents and restarts RoPE positions at each document; labels are
unchanged (as OLMo-core's). Without ``doc_lens`` the step is the same program as before.

Context parallelism with an attention implementation that splits the queries (``splash``, ``xla``;
:func:`split_context`): the step trains on the load-balanced zig-zag layout
(:mod:`olmax.model.attention_cp`): tokens, labels, segment ids and RoPE positions are computed in
natural order, then permuted alike along the sequence, before the micro-batch split. The loss is a
sum over positions, so it is the same whatever the order.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial, wraps
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmax.config import ModelConfig, TrainConfig
from olmax.errors import ConfigError
from olmax.model.attention_cp import SPLIT_IMPLS, balanced, to_zigzag, zigzag_order
from olmax.model.documents import positions_in_documents, segment_ids_from_doc_lens
from olmax.model.params import abstract_params, init_params
from olmax.model.runtime import Runtime
from olmax.parallel.mesh import context_size, data_parallel_size
from olmax.parallel.sharding import (batch_sharding, like_params_shardings, param_shardings, placed_on,
                                     replicated)
from olmax.platforms import backend_of, compiler_options
from olmax.train.loss import LossSums, loss_and_sums, loss_denominator, make_labels
from olmax.train.optim import last_step_info
from olmax.train.state import TrainState, init_train_state


def micro_batch_size(train_cfg: TrainConfig, dp: int) -> int:
    """Sequences per device per micro-step on ``dp`` data-parallel devices (mesh data x fsdp):
    ``train.micro_batch_size`` as given (it must divide the per-device batch), the whole
    per-device batch when unset, or with ``auto`` the largest divisor of the per-device batch that
    is at most ``train.micro_batch_max`` (the given value wherever it divides: the same step)."""
    b = train_cfg.global_batch_size
    if b % dp:
        raise ConfigError(f"train.global_batch_size ({b}) must be divisible by the data-parallel "
                          f"size ({dp} = mesh data x fsdp)")
    per_device = b // dp
    mb = train_cfg.micro_batch_size
    if mb == "auto":
        cap = min(per_device, train_cfg.micro_batch_max or per_device)
        return max(d for d in range(1, cap + 1) if per_device % d == 0)
    mb = mb or per_device
    if per_device % mb:
        raise ConfigError(f"train.micro_batch_size ({mb}) must divide the per-device batch "
                          f"({per_device} = {b} / {dp}); train.micro_batch_size=auto "
                          f"train.micro_batch_max={mb} takes the largest divisor up to {mb}")
    return mb


def num_micro_batches(train_cfg: TrainConfig, dp: int) -> int:
    return train_cfg.global_batch_size // dp // micro_batch_size(train_cfg, dp)


def step_devices(mesh: Mesh | None) -> list:
    """The devices a step compiles for: the mesh's, else this process's first device."""
    return list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]


def loss_chunk(train_cfg: TrainConfig, n_micro: int, mesh: Mesh | None, runtime: Runtime) -> int:
    """Positions per loss chunk: the profile's rule (:meth:`olmax.platforms.Profile.loss_chunk`)
    for the rows of a micro-batch on each device and the devices of this host."""
    devices = step_devices(mesh)
    dp = 1 if mesh is None else data_parallel_size(mesh)
    local = [d for d in devices if d.process_index == jax.process_index()] or devices
    per_device = max(1, train_cfg.global_batch_size // (n_micro * dp))
    if train_cfg.loss_chunk_rows is not None:
        return max(1, train_cfg.loss_chunk_rows // per_device)
    return runtime.profile.loss_chunk(per_device, len(local))


def make_train_step(model_cfg: ModelConfig, train_cfg: TrainConfig, tx: optax.GradientTransformationExtraArgs,
                    *, n_micro: int = 1, mesh: Mesh | None = None, chunk_size: int | None = None,
                    runtime: Runtime | None = None) -> Callable:
    """``step(state, batch, lr) -> (state, metrics)`` (not jitted; see :func:`jit_train_step`).

    ``batch``: ``tokens`` int32 [B, T], ``instance_mask`` bool [B], optionally ``label_mask`` bool
    [B, T] (False: a position that is not scored, e.g. a packed instance's padding) and
    ``doc_lens`` int32 [B, D] (intra-document masking; see the module docstring). ``metrics``
    (fp32 scalars):
    ``loss`` (CE), ``z_loss``, ``grad_norm`` (pre-clip), ``skipped``, ``num_tokens`` (denominator).
    ``runtime``: how the model runs (default: ``train_cfg``'s, its profile resolved for the
    step's devices). ``chunk_size``: positions per loss chunk (default: :func:`loss_chunk`).
    """
    if runtime is None:
        runtime = Runtime.of(train_cfg, step_devices(mesh))
    if chunk_size is None:
        chunk_size = loss_chunk(train_cfg, n_micro, mesh, runtime)
    runtime = split_context(runtime, mesh, train_cfg.context_head_stride)

    def grad_fn_of(rt: Runtime):
        loss_fn = partial(loss_and_sums, cfg=model_cfg, runtime=rt,
                          z_loss_multiplier=train_cfg.z_loss_multiplier, chunk_size=chunk_size,
                          seq_shards=context_size(mesh))
        return jax.value_and_grad(loss_fn, has_aux=True)

    grad_fn = grad_fn_of(runtime)
    place = Placement.of(model_cfg, mesh)
    by_layer = bool(train_cfg.accumulate_by_layer) and runtime.unroll_layers
    embed_by_row = (by_layer and bool(train_cfg.accumulate_embedding_by_row)
                    and not model_cfg.tie_embeddings)

    def step(state: TrainState, batch: dict, lr: jax.Array):
        with placed_on(mesh):
            rows = batch_rows(batch, runtime.context)
            fn = grad_fn if rows.context == runtime.context else grad_fn_of(replace(runtime, context=1))
            grads, sums = accumulate_gradients(fn, state.params, rows, n_micro, place,
                                               by_layer=by_layer, embed_by_row=embed_by_row)
            return apply_update(tx, state, grads, sums, rows.denom, lr)

    return step


class Rows(NamedTuple):
    """A batch as the model reads it (:func:`batch_rows`), every per-position array in the layout
    the step trains on."""

    tokens: jax.Array                  # int32 [B, T]
    labels: jax.Array                  # int32 [B, T] (:func:`olmax.train.loss.make_labels`)
    segment_ids: jax.Array | None      # int32 [B, T]: documents (None: one document per row)
    positions: jax.Array | None        # RoPE positions: [T] for every row, [B, T] with documents;
                                       # None: natural order
    denom: jax.Array                   # the whole batch's scored-token count
    context: int                       # devices the layout is cut for (1: natural order)


def batch_rows(batch: dict, context: int) -> Rows:
    """The batch's rows: labels (the instance and label masks applied), documents -> segment ids,
    and, on ``context`` > 1 devices, the zig-zag layout (:mod:`olmax.model.attention_cp`): every
    per-position array computed in natural order, then permuted alike, RoPE reading the true
    positions. A sequence that does not cut into 2 x ``context`` chunks keeps the natural order
    (``Rows.context`` = 1) and whole-sequence attention."""
    tokens = batch["tokens"].astype(jnp.int32)
    instance_mask = batch.get("instance_mask")
    if instance_mask is None:
        instance_mask = jnp.ones(tokens.shape[:1], jnp.bool_)
    labels = make_labels(tokens, instance_mask, batch.get("label_mask"))
    denom = loss_denominator(labels, instance_mask)
    doc_lens = batch.get("doc_lens")
    seg = None if doc_lens is None else segment_ids_from_doc_lens(doc_lens, tokens.shape[1])
    n = context if balanced(tokens.shape[1], context) else 1
    positions = None
    if n > 1:
        positions = (zigzag_order(tokens.shape[1], n) if seg is None else
                     to_zigzag(positions_in_documents(seg), n))
        tokens, labels = to_zigzag(tokens, n), to_zigzag(labels, n)
        seg = None if seg is None else to_zigzag(seg, n)
    return Rows(tokens, labels, seg, positions, denom, n)


class Placement(NamedTuple):
    """Where the step's arrays live on a mesh (no mesh: nowhere in particular)."""

    mesh: Mesh | None
    grad_shardings: Any    # like the parameters

    @classmethod
    def of(cls, model_cfg: ModelConfig, mesh: Mesh | None) -> Placement:
        # Gradients placed like their parameters: left free, the partitioner may keep one whole
        # (e.g. gather the LM head's gradient for the global norm's sum of squares).
        return cls(mesh, None if mesh is None else param_shardings(model_cfg, mesh))

    def rows(self, x: jax.Array) -> jax.Array:
        """``x`` [B, ...] split by rows over data x fsdp."""
        return x if self.mesh is None else jax.lax.with_sharding_constraint(
            x, batch_sharding(self.mesh, x.ndim))

    def grads(self, g: Any) -> Any:
        return g if self.mesh is None else jax.lax.with_sharding_constraint(g, self.grad_shardings)

    def grads_by_layer(self, g: Any) -> Any:
        """Gradients whose ``layers`` are one tree per layer (:func:`accumulate_gradients`), each
        placed like its weights: a layer like one layer of the stack. ``g`` may hold some of the
        parameters' keys only."""
        if self.mesh is None:
            return g
        shardings = {k: self.grad_shardings[k] for k in g}
        if "layers" in g:
            layer = jax.tree.map(lambda s: NamedSharding(s.mesh, PartitionSpec(*s.spec[1:])),
                                 self.grad_shardings["layers"])
            shardings["layers"] = (layer,) * len(g["layers"])
        return jax.lax.with_sharding_constraint(g, shardings)


def accumulate_gradients(grad_fn: Callable, params: Any, rows: Rows, n_micro: int,
                         place: Placement, by_layer: bool = False,
                         embed_by_row: bool = False) -> tuple[Any, LossSums]:
    """The whole batch's gradients (fp32) and loss sums, over ``n_micro`` micro-batches:
    micro-batch k holds rows ``k, k + n_micro, ...`` (each device keeps its own rows).
    ``grad_fn(params, tokens, labels, denom, **kw)`` -> ``((loss, sums), grads)``: every
    micro-batch's loss is divided by the whole batch's ``denom``, so the summed gradients are the
    full-batch gradient.

    ``by_layer`` (``train.accumulate_by_layer``, with the layers unrolled): the gradients are
    taken with respect to each layer's weights apart (the stack ``layers`` split into one weight
    tree per layer outside the micro-batch loop) and summed into one accumulator per layer, which
    are stacked once, after the last micro-batch. The same sums in the same order (on one device
    the same numbers, bit for bit). In the compiled loop a layer's weight gradient is then added
    to its accumulator where it is produced, instead of being gathered with all the other layers'
    into a stacked gradient that a separate pass adds to a stacked accumulator: on a v5e, the
    olmo3-370m step (micro-batch 2) moves 41.7 GB less through the accumulation's adds, 12.4 GB
    less through concatenations and 9.8 GB less through broadcasts, and the compiler needs less
    of its own rematerialisation to fit the olmo3-600m at micro-batch 1 without remat
    (benchmarks/notes/2026-12-07-one-v5e-chip-round-seven.md).

    ``embed_by_row`` (``train.accumulate_embedding_by_row``, with ``by_layer`` and untied
    embeddings): each micro-batch reads the embedding rows of its own tokens and the gradient
    with respect to those rows is added into the table's accumulator row by row, a scatter-add of
    the micro-batch's positions. Autodiff of the lookup instead writes a whole table per
    micro-batch (zeros, then the rows scattered into them in the compute dtype), which is then
    added to the accumulator whole. The same sums, in fp32 and in another order: a token that
    occurs more than once in a micro-batch has its rows' gradients summed in fp32, not in the
    compute dtype."""
    per_row = (rows.tokens, rows.labels)
    if rows.segment_ids is not None:
        per_row += (place.rows(rows.segment_ids),)
        if rows.positions is not None:
            per_row += (place.rows(rows.positions),)
    shared_positions = rows.positions if rows.segment_ids is None else None

    def grads_of(tok, lab, seg=None, pos=None, weights=None):
        kw = {} if seg is None else {"segment_ids": seg}
        pos = shared_positions if pos is None else pos
        if pos is not None:
            kw["positions"] = pos
        return grad_fn(params if weights is None else weights, tok, lab, rows.denom, **kw)

    if n_micro == 1:
        (_, sums), grads = grads_of(*per_row)
        return place.grads(grads), sums
    b, t = rows.tokens.shape

    def split(x):
        return x.reshape(b // n_micro, n_micro, t).swapaxes(0, 1)

    if by_layer:
        stack = params["layers"]
        n_layers = jax.tree.leaves(stack)[0].shape[0]
        params = {**params, "layers": tuple(jax.tree.map(lambda x, i=i: x[i], stack)
                                            for i in range(n_layers))}

    placed = place.grads_by_layer if by_layer else place.grads

    def add(acc, g):
        return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, placed(g))

    def micro(carry, xs):
        g_acc, ce_acc, z_acc = carry
        tok, *rest = map(place.rows, xs)
        if not embed_by_row:
            (_, sums), g = grads_of(tok, *rest)
            return (add(g_acc, g), ce_acc + sums.ce, z_acc + sums.z), None
        # The model looks its tokens up in a table of this micro-batch's own rows: position n
        # reads row n, so the gradient of row n is that of position n.
        ids = tok.reshape(-1)
        table = jnp.take(params["embed"], ids, axis=0)
        (_, sums), g = grads_of(jnp.arange(ids.size, dtype=jnp.int32).reshape(tok.shape), *rest,
                                weights={**params, "embed": table})
        d_rows = g.pop("embed").astype(jnp.float32)
        g_acc = {**add({k: v for k, v in g_acc.items() if k != "embed"}, g),
                 **placed({"embed": g_acc["embed"].at[ids].add(d_rows)})}
        return (g_acc, ce_acc + sums.ce, z_acc + sums.z), None

    zeros = placed(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    zero = jnp.zeros((), jnp.float32)
    (grads, ce, z), _ = jax.lax.scan(micro, (zeros, zero, zero), tuple(map(split, per_row)))
    if by_layer:
        grads = place.grads({**grads, "layers": jax.tree.map(lambda *xs: jnp.stack(xs),
                                                             *grads["layers"])})
    return grads, LossSums(ce, z)


def apply_update(tx: optax.GradientTransformationExtraArgs, state: TrainState, grads: Any,
                 sums: LossSums, denom: jax.Array, lr: jax.Array) -> tuple[TrainState, dict]:
    """SkipStep AdamW on the batch's gradients at ``lr`` (it sees the loss, to judge a spike):
    the next state and the step's metrics."""
    ce_loss = sums.ce / denom
    updates, opt_state = tx.update(grads, state.opt_state, state.params, lr=lr, loss=ce_loss)
    params = optax.apply_updates(state.params, updates)
    info = last_step_info(opt_state)
    metrics = {"loss": ce_loss, "z_loss": sums.z / denom, "grad_norm": info["grad_norm"],
               "skipped": info["skipped"], "num_tokens": denom}
    return TrainState(params, opt_state, state.step + 1), metrics


def split_context(runtime: Runtime, mesh: Mesh | None, head_stride: int | None = None) -> Runtime:
    """``runtime`` with attention split over the mesh's context devices where its implementation
    can (:data:`olmax.model.attention_cp.SPLIT_IMPLS`; the step then trains on the zig-zag layout),
    gathering the keys and values of ``head_stride`` key heads at a time
    (``train.context_head_stride``); else (no mesh, no context parallelism, another
    implementation) with ``context`` = 1."""
    n = context_size(mesh)
    n = n if n > 1 and runtime.attn_impl in SPLIT_IMPLS else 1
    return replace(runtime, context=n, context_head_stride=head_stride if n > 1 else None)


def traced_under_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` traced with ``mesh`` as the context (abstract) mesh, so that code that must place
    itself on the mesh (e.g. a kernel in ``shard_map``) sees it."""
    @wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)
    return wrapped


def jit_train_step(step: Callable, state_shardings: Any = None, batch_shardings: Any = None,
                   mesh: Mesh | None = None, run_options: dict[str, str] | None = None) -> Callable:
    """jit with the state donated and, on a mesh, explicit in/out shardings for state and batch;
    with the compiler options of the backend that compiles it and the run's own
    (``run_options``: ``train.compiler_options``; :func:`olmax.platforms.compiler_options`)."""
    devices = step_devices(mesh)
    options = compiler_options(backend_of(devices), devices, run_options)
    if state_shardings is None:
        return jax.jit(step, donate_argnums=(0,), compiler_options=options)
    rep = replicated(mesh)
    if isinstance(batch_shardings, dict):
        # One placement for every array of the batch (rows over data x fsdp, the rest whole), so
        # the step takes batches with or without ``doc_lens``.
        batch_shardings = batch_sharding(mesh, 1)
    return jax.jit(traced_under_mesh(step, mesh), donate_argnums=(0,),
                   in_shardings=(state_shardings, batch_shardings, rep),
                   out_shardings=(state_shardings, rep), compiler_options=options)


class ShardedTraining(NamedTuple):
    """Everything a loop needs to train on a mesh (built by :func:`build_sharded_training`)."""

    step_fn: Any                 # jitted (state, batch, lr) -> (state, metrics); .lower(...) for AOT
    fresh_state: Callable        # params | None -> TrainState at step 0 (None: fresh params from ``key``)
    state_shardings: Any         # TrainState of NamedShardings
    abstract_state: Any          # TrainState of ShapeDtypeStructs carrying those shardings
    batch_shardings: dict        # every batch key (tokens, label_mask, ...): rows over data x fsdp
    n_micro: int
    runtime: Runtime             # how the model runs: profile resolved, ``auto`` attention resolved


def build_sharded_training(model_cfg: ModelConfig, train_cfg: TrainConfig,
                           tx: optax.GradientTransformationExtraArgs, mesh: Mesh,
                           key: jax.Array) -> ShardedTraining:
    """Shard parameters by the logical-axis rules, optimizer moments like their parameters,
    counters/skip windows replicated, the batch by rows; jit the step with those shardings.
    ``train.profile`` (and with it ``train.attn_impl=auto``) is resolved for the mesh's devices."""
    n_micro = num_micro_batches(train_cfg, data_parallel_size(mesh))
    runtime = Runtime.of(train_cfg, step_devices(mesh))
    p_sh = param_shardings(model_cfg, mesh)
    abs_params = abstract_params(model_cfg)
    abs_opt = jax.eval_shape(tx.init, abs_params)
    o_sh = like_params_shardings(abs_opt, abs_params, p_sh, mesh)
    state_sh = TrainState(p_sh, o_sh, replicated(mesh))
    abs_state = TrainState(abs_params, abs_opt, jax.ShapeDtypeStruct((), jnp.int32))
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abs_state, state_sh)
    b_sh = {"tokens": batch_sharding(mesh, 2), "instance_mask": batch_sharding(mesh, 1),
            "doc_lens": batch_sharding(mesh, 2), "label_mask": batch_sharding(mesh, 2)}
    init_p = jax.jit(lambda k: init_params(model_cfg, k), out_shardings=p_sh)
    make_state = jax.jit(lambda p: init_train_state(p, tx), out_shardings=state_sh)

    def fresh_state(params=None):
        return make_state(init_p(key) if params is None else params)

    step = make_train_step(model_cfg, train_cfg, tx, n_micro=n_micro, mesh=mesh, runtime=runtime)
    jitted = jit_train_step(step, state_sh, b_sh, mesh, train_cfg.compiler_options_dict())
    return ShardedTraining(jitted, fresh_state, state_sh, abstract_state, b_sh, n_micro, runtime)


def abstract_batch(st: ShardedTraining, batch_size: int, seq_len: int, *, packed: bool = False,
                   doc_lens_width: int | None = None) -> dict:
    """The batch a step of ``st`` takes, as ``jax.ShapeDtypeStruct`` with its shardings: tokens and
    the instance mask; packed rows (``data.instances=packed``) also their label mask, and with
    documents masked (``data.doc_lens``) their document lengths, ``doc_lens_width`` columns."""
    def spec(key: str, shape: tuple, dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=st.batch_shardings[key])

    batch = {"tokens": spec("tokens", (batch_size, seq_len), jnp.int32),
             "instance_mask": spec("instance_mask", (batch_size,), jnp.bool_)}
    if packed:
        batch["label_mask"] = spec("label_mask", (batch_size, seq_len), jnp.bool_)
        if doc_lens_width:
            batch["doc_lens"] = spec("doc_lens", (batch_size, doc_lens_width), jnp.int32)
    return batch


ABSTRACT_LR = jax.ShapeDtypeStruct((), jnp.float32)
