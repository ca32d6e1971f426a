"""``olmax plan``: compile a recipe's real training step ahead of time and report what the compiler
knows -- per-device memory and whether it fits, FLOPs, an estimated step time, the collectives.

The program compiled is the one ``olmax train`` runs: :func:`olmax.train.step.build_sharded_training`
with the recipe's model, optimizer (SkipStep AdamW, clipping), loss (z-loss, chunked head), remat
policy, attention implementation, micro-batch accumulation, mesh and sharding rules. Parameters,
optimizer state and batch are abstract (shapes and shardings only): nothing is allocated. The
target is a TPU topology (``--topology tpu7x:2x2x2``: libtpu compiles for it on any host, no TPU
needed) or the local devices.

FLOPs per step (per device) are reported three ways:

- ``olmo_core`` / ``causal``: olmax's analytic model FLOPs (:mod:`olmax.model.flops`);
- ``xla``: XLA's own count made comparable. A compiled program's ``cost_analysis`` counts a loop
  body once (a scanned layer stack, the micro-batch loop, the loss chunks) and gives Pallas kernels
  no cost. So the step is also compiled as unscanned parts on the same mesh: (A) the loss with one
  layer group (the window pattern's period) forward + backward, (H) the LM head + loss alone
  forward + backward, (O) the optimizer update; then ``xla = n_micro * (groups * (A - H) + H) + O``,
  plus the FLOPs the Pallas kernels execute, counted from the compiled step's HLO (each kernel call
  times its loop trip counts) at the blocks the kernel visits. It exceeds the analytic count by
  remat's recomputed forward, by attention computed densely (``xla``: the full T x T scores;
  ``chunked``: whole blocks; splash: whole 512-blocks on the mask's edge) and by the elementwise
  work (norms, softmax, optimizer) that model FLOPs leave out.

The step-time *estimate* sums XLA's cost model (``optimal_seconds``, TPU only) over the same parts;
kernels XLA cannot see are added at their FLOPs over the device's peak. It is labelled as such; the
whole program's own ``optimal_seconds`` is not used (negative for scanned programs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from olmax.config import RunConfig
from olmax.io import write_bytes_atomic
from olmax.perf import hlo
from olmax.perf.costs import DoesNotFit, compile_or_explain, cost, kernel_flops, part_costs
from olmax.perf.targets import (GiB, chips, filtered_stderr, hbm_bytes, tell_libtpu_no_tpu,
                                topology_devices, usable_hbm)


# The documents a packed row may hold, for the step's doc_lens input: the real width is the data's
# (the most documents in any row), known only once it is packed; it changes one small input, not
# the attention (segment ids of the row's positions).
PLAN_DOC_LENS_WIDTH = 256


@dataclasses.dataclass
class Plan:
    topology: str | None
    num_devices: int
    device_kind: str
    profile: str
    attn_impl: str
    remat: str
    global_batch_size: int
    seq_len: int
    memory: dict
    flops_per_step: dict
    estimate: dict
    collectives: list
    compile_s: float
    details: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan(cfg: RunConfig, topology: str | None = None, *, parts: bool = True,
         hlo_out: str | None = None) -> Plan:
    """Compile the training step of ``cfg`` for ``topology`` (or the local devices); see module.
    ``hlo_out``: also write the compiled step's optimized HLO text there."""
    import jax
    import jax.numpy as jnp

    from olmax.train.optim import build_optimizer
    from olmax.train.step import build_sharded_training
    from olmax.parallel.mesh import make_mesh

    tell_libtpu_no_tpu()
    devices = topology_devices(topology) if topology else jax.devices()
    mesh = make_mesh(cfg.mesh, devices)
    n = len(devices)
    dev = devices[0]
    model, train = cfg.model, cfg.train
    st = build_sharded_training(model, train, build_optimizer(cfg.optim), mesh, jax.random.key(0))
    b, t = train.global_batch_size, train.seq_len
    batch = {"tokens": jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=st.batch_shardings["tokens"]),
             "instance_mask": jax.ShapeDtypeStruct((b,), jnp.bool_,
                                                   sharding=st.batch_shardings["instance_mask"])}
    if cfg.data.instances == "packed":   # the step packed rows run: padding, and documents masked
        batch["label_mask"] = jax.ShapeDtypeStruct((b, t), jnp.bool_,
                                                   sharding=st.batch_shardings["label_mask"])
        if cfg.data.doc_lens:
            batch["doc_lens"] = jax.ShapeDtypeStruct((b, PLAN_DOC_LENS_WIDTH), jnp.int32,
                                                     sharding=st.batch_shardings["doc_lens"])
    lr = jax.ShapeDtypeStruct((), jnp.float32)
    where = (f"{topology or dev.platform} x{n}, batch {b} x {t}, remat={train.remat}, "
             f"attn={st.runtime.attn_impl}, profile={st.runtime.profile_name}")
    t0 = time.perf_counter()
    with filtered_stderr() if topology and dev.platform == "tpu" else contextlib.nullcontext():
        compiled = compile_or_explain(st.step_fn.lower(st.abstract_state, batch, lr), f"the step ({where})")
    compile_s = time.perf_counter() - t0

    memory = _memory(compiled, dev, where)
    text = compiled.as_text()
    if hlo_out:
        write_bytes_atomic(hlo_out, text.encode())
    prog = hlo.analyse(text)
    kernel, kernel_calls = kernel_flops(prog)
    whole = cost(compiled)
    groups = model.n_layers // len(model.window_pattern)
    details: dict = {"mesh": dict(mesh.shape), "n_micro": st.n_micro, "layer_groups": groups,
                     "batch_keys": sorted(batch),
                     "chips": chips(devices), "xla_whole_program_flops": whole.get("flops"),
                     "xla_whole_program_optimal_seconds": whole.get("optimal_seconds"),
                     "kernel_flops": kernel, "kernel_calls": kernel_calls,
                     "loops_with_unknown_trip_count": prog.unknown_loops}
    flops = _flops(model, b, t, n)
    estimate = {"method": None, "step_s": None, "tokens_per_s_per_chip": None,
                "mfu_olmo_core": None, "mfu_causal": None}
    if parts:
        estimate = _estimate(cfg, st, mesh, dev, n, flops, kernel, details)
    else:
        estimate["method"] = "not computed (parts skipped)"

    return Plan(topology=topology, num_devices=n, device_kind=dev.device_kind,
                profile=st.runtime.profile_name, attn_impl=st.runtime.attn_impl,
                remat=train.remat, global_batch_size=b, seq_len=t, memory=memory,
                flops_per_step=flops, estimate=estimate, collectives=hlo.collectives(prog),
                compile_s=compile_s, details=details)


def _memory(compiled, dev, where: str) -> dict:
    """Per-device memory of the compiled step against the device's usable memory; a step that
    compiled but needs more than there is raises :class:`DoesNotFit`, as an OOM at compile."""
    from olmax.platforms import backend_of

    ma = compiled.memory_analysis()
    hbm, hbm_fraction, hbm_source = usable_hbm(backend_of([dev]), *hbm_bytes(dev))
    arg, out, tmp = ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.temp_size_in_bytes
    alias, code = ma.alias_size_in_bytes, ma.generated_code_size_in_bytes
    # XLA's buffer-assignment peak (live buffers at the worst point) on TPU/GPU; the CPU backend's
    # figure is not one (it reports the arguments), so there: everything, as if all live at once.
    xla_peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0) if dev.platform != "cpu" else 0
    peak = xla_peak or arg + out - alias + tmp + code
    memory = {"argument_bytes": int(arg), "output_bytes": int(out), "temp_bytes": int(tmp),
              "alias_bytes": int(alias), "code_bytes": int(code), "peak_bytes": int(peak),
              "hbm_bytes": hbm, "hbm_fraction": hbm_fraction,
              "fits": None if hbm is None else bool(peak <= hbm),
              "headroom": None if hbm is None else 1.0 - peak / hbm, "hbm_source": hbm_source}
    if memory["fits"] is False:
        raise DoesNotFit(int(peak), int(hbm), f"the step ({where})")
    return memory


def _flops(model, b: int, t: int, n: int) -> dict:
    """The analytic FLOPs per step per device; ``xla`` is filled in by :func:`_estimate`."""
    from olmax.model.flops import flops_per_token

    tokens = b * t
    return {"olmo_core": flops_per_token(model, t, "olmo_core") * tokens / n,
            "causal": flops_per_token(model, t, "causal") * tokens / n, "xla": None}


def _estimate(cfg: RunConfig, st, mesh, dev, n: int, flops: dict, kernel: float,
              details: dict) -> dict:
    """XLA's FLOPs (into ``flops["xla"]``) and the step-time estimate from the unscanned parts
    (their costs into ``details["parts"]``); see the module docstring for the sum."""
    from olmax.model.flops import peak_flops
    from olmax.parallel.mesh import data_parallel_size

    b, t = cfg.train.global_batch_size, cfg.train.seq_len
    groups = details["layer_groups"]
    per_device = b // st.n_micro // data_parallel_size(mesh)
    # each device updates its 1/(fsdp x tensor) of the state: data replicas update the same part
    pc = part_costs(cfg, dev, per_device, mesh.shape["tensor"], n // mesh.shape["data"], st.runtime)
    a, h, o = pc["A"], pc["H"], pc["O"]
    m = st.n_micro

    def combine(key):
        if any(x.get(key) is None for x in (a, h, o)):
            return None
        return m * (groups * (a[key] - h[key]) + h[key]) + o[key]

    xla = combine("flops")
    flops["xla"] = None if xla is None else xla + kernel
    details["parts"] = {name: {k: part.get(k) for k in ("flops", "optimal_seconds", "optimal_seconds_raw",
                                                        "custom_calls", "bytes accessed")}
                        for name, part in (("layer_group_plus_head", a), ("head_and_loss", h),
                                           ("optimizer", o))}
    seconds = combine("optimal_seconds")
    peak_dev = peak_flops(dev)
    if not (seconds is not None and seconds > 0 and all(x["optimal_seconds"] > 0 for x in (a, h, o))):
        return {"method": (f"unavailable: XLA's {dev.platform} backend gives no usable cost-model "
                           f"time for the parts (optimal_seconds "
                           f"{[x.get('optimal_seconds') for x in (a, h, o)]})"),
                "step_s": None, "tokens_per_s_per_chip": None, "mfu_olmo_core": None, "mfu_causal": None}
    kernel_s = kernel / peak_dev if (kernel and peak_dev) else 0.0
    step_s = seconds + kernel_s
    per_chip = n / details["chips"]
    tps_dev = b * t / n / step_s
    method = (f"estimate: XLA {dev.platform.upper()} cost model (optimal_seconds) summed over "
              f"unscanned one-device parts: {m} micro-batch(es) x ({groups} layer groups + "
              f"LM head/loss) + optimizer")
    if kernel:
        method += "; Pallas kernels at their FLOPs / peak"
    method += "; collectives not timed (assumed overlapped; listed with their bytes)"
    f_oc, f_c = flops["olmo_core"], flops["causal"]
    return {"method": method, "step_s": step_s, "tokens_per_s_per_chip": tps_dev * per_chip,
            "mfu_olmo_core": f_oc / step_s / peak_dev if peak_dev else None,
            "mfu_causal": f_c / step_s / peak_dev if peak_dev else None}


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / GiB:.2f} GiB"


def _num(x, unit="") -> str:
    return "n/a" if x is None else f"{x:.4g}{unit}"


def format_plan(p: Plan) -> str:
    m, f, e, d = p.memory, p.flops_per_step, p.estimate, p.details
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    fit = ("n/a" if m["fits"] is None else
           ("fits" if m["fits"] else "DOES NOT FIT") + f", headroom {pct(m['headroom'])}")
    rows = [
        ("target", f"{p.topology or 'local devices'}: {p.num_devices} x {p.device_kind} "
                   f"({d['chips']} chips), mesh {d['mesh']}"),
        ("step", f"batch {p.global_batch_size} x seq {p.seq_len}, {d['n_micro']} micro-batch(es), "
                 f"profile={p.profile}, attn={p.attn_impl}, remat={p.remat}"),
        ("compile", f"{p.compile_s:.1f} s"),
        ("memory / device", f"arguments {_gib(m['argument_bytes'])}, outputs {_gib(m['output_bytes'])}, "
                            f"temporaries {_gib(m['temp_bytes'])}, aliased {_gib(m['alias_bytes'])}, "
                            f"code {_gib(m['code_bytes'])}"),
        ("peak vs HBM", f"{_gib(m['peak_bytes'])} of {_gib(m['hbm_bytes'])} ({m['hbm_source']}): {fit}"),
        ("FLOPs / device", f"olmo_core {_num(f['olmo_core'])}, causal {_num(f['causal'])}, "
                           f"xla {_num(f['xla'])}" + (f" (x{f['xla'] / f['causal']:.2f} of causal)"
                                                      if f["xla"] and f["causal"] else "")),
        ("estimate", e["method"] or "n/a"),
    ]
    if e["step_s"]:
        rows.append(("  step time", f"{e['step_s'] * 1e3:.1f} ms, {e['tokens_per_s_per_chip']:,.0f} "
                                    f"tokens/s/chip, MFU {pct(e['mfu_olmo_core'])} (olmo_core), "
                                    f"{pct(e['mfu_causal'])} (causal)"))
    coll = ", ".join(f"{c['kind']} {c['count']}x {_gib(c['bytes'])}" for c in p.collectives) or "none"
    rows.append(("collectives", coll))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
