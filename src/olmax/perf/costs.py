"""What the compiler says a step costs: compiling with an out-of-HBM error explained
(:class:`DoesNotFit`), XLA's cost analysis corrected for custom calls its TPU cost model cannot
price, the step's parts compiled unscanned so that the cost model sees every layer
(:func:`part_costs`), and the FLOPs of the Pallas kernels XLA does not count (:func:`kernel_flops`).
How :mod:`olmax.perf.plan` combines them is described there.
"""

from __future__ import annotations

import os
import re

from olmax.config import RunConfig
from olmax.device_memory import raising_does_not_fit
from olmax.io import write_bytes_atomic
from olmax.perf import hlo


def compile_or_explain(lowered, where: str, hints=()):
    """``lowered.compile()``; an out-of-memory error of the compiler as :class:`DoesNotFit`."""
    with raising_does_not_fit(where, hints):
        return lowered.compile()


# XLA-internal custom calls that XLA's TPU cost model enters into ``optimal_seconds`` as -1 s each
# ("unknown"): an optimizer update whose only custom calls were two ConcatBitcast came out at
# -2 s + its positive time. A ConcatBitcast joins slices by relabelling memory (no arithmetic) and
# is taken as free. (AssumeGatherIndicesInBound, seen in a part with a positive time, is not.)
# A part whose corrected time is still not positive gives no estimate.
_MINUS_ONE_CUSTOM_CALLS = ("ConcatBitcast",)


def cost(compiled) -> dict:
    """``cost_analysis`` of a compiled program, with ``optimal_seconds`` corrected for the -1 s that
    each custom call unknown to the cost model contributes (they are data-layout rewrites, taken
    as free); ``custom_calls`` counts the custom calls by target."""
    cost = compiled.cost_analysis()
    cost = dict((cost[0] if isinstance(cost, (list, tuple)) else cost) or {})
    if cost.get("optimal_seconds") is not None:
        comps, _ = hlo.parse(compiled.as_text())
        targets: dict[str, int] = {}
        for instrs in comps.values():
            for ins in instrs:
                m = re.search(r'custom_call_target="([^"]+)"', ins.text) if ins.opcode == "custom-call" else None
                if m:
                    targets[m.group(1)] = targets.get(m.group(1), 0) + 1
        unknown = sum(targets.get(t, 0) for t in _MINUS_ONE_CUSTOM_CALLS)
        cost["optimal_seconds_raw"] = cost["optimal_seconds"]
        cost["optimal_seconds"] = cost["optimal_seconds"] + unknown
        cost["custom_calls"] = targets
    return cost


# ----------------------------------------------------------------------------------------------
# The parts XLA can cost (unscanned)


def local_model(model, tensor: int):
    """The model as one device of a ``tensor``-way tensor-parallel mesh computes it: heads, MLP and
    vocabulary divided by ``tensor`` where they divide (the rules shard them the same way)."""
    if tensor == 1:
        return model
    div = lambda x: x // tensor if x % tensor == 0 else x  # noqa: E731
    v = div(model.padded_vocab_size)
    return model.replace(n_heads=div(model.n_heads), n_kv_heads=div(model.n_kv_heads),
                         mlp_hidden=div(model.mlp_hidden), padded_vocab_size=v,
                         vocab_size=min(model.vocab_size, v))


def part_costs(cfg: RunConfig, device, per_device_batch: int, tensor: int, n_devices: int,
                runtime, *, only: tuple[str, ...] = ("A", "H", "O"),
                hlo_dir: str | None = None, groups: int = 1, positions: int | None = None) -> dict:
    """Cost analyses of the step's parts as one device runs them, compiled unscanned for that
    device alone (no collectives: XLA's cost model gives collectives no usable time): (A) the loss
    with one layer group, forward + backward; (H) LM head + loss, forward + backward; (O) the
    optimizer update over this device's 1/n of the state, with the model run as ``runtime`` says
    (an :class:`olmax.model.runtime.Runtime`, its profile resolved). ``only``: the parts to compile;
    ``hlo_dir``: also write each part's optimized HLO text there as ``part_<name>.hlo.txt``;
    ``groups``: layer groups in (A) (two give one group's cost as the difference from one);
    ``positions``: each row's positions on the device (default: the whole sequence; under context
    parallelism a device holds ``seq_len / context`` of each row's)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from olmax.model.params import abstract_params
    from olmax.parallel.mesh import MESH_AXES
    from olmax.platforms import backend_of, compiler_options
    from olmax.train.loss import lm_loss, loss_and_sums
    from olmax.train.optim import build_optimizer
    from olmax.train.step import traced_under_mesh

    model, train = local_model(cfg.model, tensor), cfg.train
    dtype = runtime.compute_dtype
    t, b = positions or train.seq_len, per_device_batch
    mesh = Mesh(np.asarray([device]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    one = NamedSharding(mesh, P())
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=one)  # noqa: E731
    tok = spec((b, t), jnp.int32)

    # the step's own (jit_train_step)
    options = compiler_options(backend_of([device]), [device], train.compiler_options_dict())

    def part(name, fn, *args):
        compiled = compile_or_explain(jax.jit(traced_under_mesh(fn, mesh), compiler_options=options)
                                      .lower(*args), "a part of the step")
        if hlo_dir:
            write_bytes_atomic(os.path.join(hlo_dir, f"part_{name}.hlo.txt"), compiled.as_text().encode())
        return cost(compiled)

    out = {}
    # ``groups`` periods of the window pattern as one group: a loop of one trip, which XLA's cost
    # analysis sees whole (it counts a loop body once, whatever the trip count)
    group = model.replace(n_layers=groups * len(model.window_pattern),
                          window_pattern=tuple(model.window_pattern) * groups)
    p_group = jax.tree.map(lambda a: spec(a.shape, a.dtype), abstract_params(group))
    loss_a = lambda p, x, y: loss_and_sums(  # noqa: E731
        p, x, y, jnp.float32(b * t), group, runtime, z_loss_multiplier=train.z_loss_multiplier,
        chunk_size=t)[0]
    if "A" in only:
        out["A"] = part("A", jax.grad(loss_a), p_group, tok, tok)

    def loss_h(h, w, y):
        return lm_loss(h, w, y, z_loss_multiplier=train.z_loss_multiplier, chunk_size=t,
                       kernels=runtime.kernels)[0] / (b * t)
    if "H" in only:
        out["H"] = part("H", jax.grad(loss_h, argnums=(0, 1)), spec((b, t, model.d_model), dtype),
                        spec((model.d_model, model.padded_vocab_size), dtype), tok)
    if "O" not in only:
        return out

    # The update is elementwise (plus the global norm): this device's share of every tensor.
    tx = build_optimizer(cfg.optim)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct((-(-a.size // n_devices),), a.dtype),
                          abstract_params(cfg.model))
    opt = jax.tree.map(lambda a: spec(a.shape, a.dtype), jax.eval_shape(tx.init, params))
    params = jax.tree.map(lambda a: spec(a.shape, a.dtype), params)
    scalar = spec((), jnp.float32)

    def update(g, o, p, lr, loss):
        import optax

        u, o = tx.update(g, o, p, lr=lr, loss=loss)
        return optax.apply_updates(p, u), o
    out["O"] = part("O", update, params, opt, params, scalar, scalar)
    return out


# The matmuls of one visited (query block, key block) pair of each splash kernel, as
# (contraction width, output width) with D the head dimension and K the block: forward QK^T, PV;
# dq kernel QK^T, dO V^T, dS K; dkv kernel QK^T, P^T dO, dO V^T, dS^T Q (olmax.model.splash.MATMULS).
SPLASH_MATMULS = {"fwd": (("D", "K"), ("K", "D")),
                  "dq": (("D", "K"), ("D", "K"), ("K", "D")),
                  "dkv": (("D", "K"), ("K", "D"), ("D", "K"), ("K", "D")),
                  # the backward in one kernel: dkv's four and dS K for dq
                  "dkv_fused": (("D", "K"), ("K", "D"), ("D", "K"), ("K", "D"), ("K", "D"))}


def mxu_occupancy(contraction: int, width: int, mxu: int | None) -> float:
    """The share of a ``mxu x mxu`` systolic array a matmul keeps busy: its contraction and output
    widths against the array's (a narrower one leaves the rest of the array idle). 1 without a
    known array."""
    if not mxu:
        return 1.0
    return min(1.0, contraction / mxu) * min(1.0, width / mxu)


def splash_call(ins) -> tuple[str, dict, float] | None:
    """(phase -- ``fwd``, ``dq`` or ``dkv`` --, its scope's shape, the FLOPs one execution runs:
    every visited block pair) of a call of olmax's splash kernels (a ``tpu_custom_call`` in an
    ``olmax_splash`` scope, :func:`olmax.model.splash.parse_scope`), else None."""
    from olmax.model.splash import kernel_flops as splash_flops, parse_scope

    if ins.opcode != "custom-call" or 'custom_call_target="tpu_custom_call"' not in ins.text:
        return None
    names = hlo.op_names(ins)
    shape = next((s for s in map(parse_scope, names) if s), None)
    phase = re.search(r"splash_m[hq]a_(fwd|dq|dkv)", ins.name + " " + " ".join(names))
    if shape is None or phase is None:
        return None
    p = phase.group(1)
    split = {k: v for k, v in shape.items() if k in ("kv_len", "kv_block", "context", "halo", "fused")}
    return p, shape, float(splash_flops(shape["t"], shape["window"], shape["heads"], shape["head_dim"],
                                        shape["batch"], p, shape["block"], **split))


def kernel_flops(prog, mxu: int | None = None) -> tuple[float, dict, float]:
    """FLOPs the splash kernels execute per step (per device), from the compiled HLO: (FLOPs,
    calls per phase, FLOPs divided by the MXU occupancy of each phase's matmuls on a ``mxu``-wide
    array -- the peak-rate FLOPs the same time would have done)."""
    total, effective, calls = 0.0, 0.0, {}
    for ins, mult in hlo.custom_calls(prog, "tpu_custom_call"):
        call = splash_call(ins)
        if call is None:
            continue
        p, shape, once = call
        f = once * mult
        widths = {"D": shape["head_dim"], "K": min(shape["block"], shape.get("kv_block") or shape["block"])}
        matmuls = SPLASH_MATMULS["dkv_fused" if p == "dkv" and shape.get("fused") else p]
        occ = [mxu_occupancy(widths[c], widths[w], mxu) for c, w in matmuls]
        total += f
        effective += f * sum(1 / o for o in occ) / len(occ)   # the matmuls are of equal FLOPs
        calls[p] = calls.get(p, 0) + int(mult)
    return total, calls, effective
