"""``olmax plan``: compile a recipe's real training step ahead of time and report what the compiler
knows -- per-device memory and whether it fits, FLOPs, an estimated step time, the collectives.

The program compiled is the one ``olmax train`` runs: :func:`olmax.train.step.build_sharded_training`
with the recipe's model, optimizer (SkipStep AdamW, clipping), loss (z-loss, chunked head), remat
policy, attention implementation, micro-batch accumulation, mesh and sharding rules; its ``auto``
micro-batch and remat policy chosen to fit the target's memory as the trainer chooses them
(:mod:`olmax.train.fit`; ``details.fit`` lists the candidates compiled). Whether the step fits is
the step's own verdict (its compiled peak against the target's memory, or the compiler's
refusal), never that of a part compiled for the estimate below. Parameters,
optimizer state and batch are abstract (shapes and shardings only): nothing is allocated. The
target is a TPU topology (``--topology tpu7x:2x2x2``: libtpu compiles for it on any host, no TPU
needed) or the local devices.

FLOPs per step (per device) are reported three ways:

- ``olmo_core`` / ``causal``: olmax's analytic model FLOPs (:mod:`olmax.model.flops`);
- ``xla``: XLA's own count made comparable. A compiled program's ``cost_analysis`` counts a loop
  body once (a scanned layer stack, the micro-batch loop, the loss chunks) and gives Pallas kernels
  no cost. So the step is also compiled as unscanned parts for one device: (A1) the loss with one
  layer group (the window pattern's period) forward + backward, (A2) the same with two groups, (O)
  the optimizer update over the device's share of the state. One layer group is ``A2 - A1``,
  everything outside the layers (embedding, LM head, loss) ``2 A1 - A2``, and
  ``xla = n_micro * (groups * (A2 - A1) + 2 A1 - A2) + O``, plus the FLOPs the Pallas kernels
  execute, counted from the compiled step's HLO (each kernel call times its loop trip counts) at
  the blocks the kernel visits. An unscanned part holds every layer's activations at once, which
  the scanned step never does: where the micro-batch's rows do not fit that way, the layer parts
  are compiled for the most rows that do and scaled to the micro-batch (``details.parts_rows``;
  the estimate's method says so). It exceeds the analytic count by remat's recomputed forward, by
  attention computed densely (``xla``: the full T x T scores; ``chunked``: whole blocks; splash:
  whole 512-blocks on the mask's edge) and by the elementwise work (norms, softmax, optimizer)
  that model FLOPs leave out.

The step-time *estimate* (labelled as such, its method in ``estimate.method``):

- compute: XLA's cost model (``optimal_seconds``, TPU only) over the same parts, combined as the
  FLOPs are; the whole program's own ``optimal_seconds`` is not used (negative for scanned
  programs). Pallas kernels, which the cost model cannot see, at their FLOPs over the device's
  sustained matrix rate (:attr:`olmax.hardware.Accelerator.matmul_rate`: the lower of the cost
  model's own rate for a large bf16 dot and a published measurement of one) times the MXU
  occupancy of their matmuls' block shapes (a 128-wide head dimension fills half of a 256 x 256
  MXU): ``compute_s`` includes them, ``kernel_s`` is their part;
- collectives (``collective_s``): every collective of the compiled step, timed by the bandwidth
  model of the target's network in :mod:`olmax.perf.network` (bytes and groups from the program);
- ``step_s = max(compute_s, asynchronous collectives) + synchronous collectives`` (the compiled
  schedule runs the asynchronous ones beside compute), and ``step_s_no_overlap = compute_s +
  collective_s``. Tokens/s and MFU are of ``step_s``. Where the network is unknown (CPU, v4),
  collectives are not timed and ``step_s`` is the compute.

On a TPU whose generation has a rates table measured on its chip (``olmax bench matmul --table``;
v5e), the compute time is priced op by op from the whole compiled step instead, as on a GPU below
(:func:`olmax.perf.gpu_estimate.tpu_kernels`): XLA's cost model errs both ways on such a chip
(it takes a matmul fusion at the datasheet's peak and prices element-wise work slow), and the
parts miss what the scanned step does (a rolled scan's stacking of residuals). Its ``kernel_s``
is the splash kernels' part, and no parts are compiled (``flops_per_step.xla`` is not given).

On a GPU (a lent one, or a compile target such as ``--topology h100:8``) the compute time is
instead priced kernel by kernel from the whole compiled step (:mod:`olmax.perf.gpu_estimate`: XLA's
GPU backend has no usable cost-model time, and prices cuDNN attention at almost nothing): matrix
products and cuDNN attention at the rates measured on that GPU model, other kernels at its measured
memory bandwidth; ``kernel_s`` is then the attention kernels' part. Collectives and the step are
combined as above.

``estimate.calibration`` says how far the method has been checked on the target's accelerator
generation (:mod:`olmax.perf.calibration`: published peer runs put through the same method, their
measured / estimated step times), or ``"uncalibrated"``; it is reported beside the estimate, never
applied to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, cast

from olmax.config import RunConfig
from olmax.config.schema import Remat
from olmax.io import write_bytes_atomic
from olmax.perf import calibration, hlo, network
from olmax.device_memory import DoesNotFit, compiled_peak
from olmax.perf.costs import cost, kernel_flops, part_costs
from olmax.perf.step_price import step_collectives, step_pricer, topology_wrap
from olmax.hardware import GiB, accelerator_of
from olmax.perf.targets import (chips, filtered_stderr, hbm_bytes, tell_libtpu_no_tpu,
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

    from olmax.train.fit import fit_step, memory_hints
    from olmax.train.optim import build_optimizer
    from olmax.train.step import abstract_batch
    from olmax.parallel.mesh import make_mesh
    from olmax.platforms import backend_of, compiler_options

    tell_libtpu_no_tpu()
    devices = topology_devices(topology) if topology else jax.devices()
    mesh = make_mesh(cfg.mesh, devices)
    n = len(devices)
    dev = devices[0]
    model, train = cfg.model, cfg.train
    b, t = train.global_batch_size, train.seq_len
    packed = cfg.data.instances == "packed"   # the step packed rows run: padding, documents masked
    width = PLAN_DOC_LENS_WIDTH if packed and cfg.data.doc_lens else None
    where = (f"the step ({topology or dev.platform} x{n}, batch {b} x {t}, "
             f"micro-batch {train.micro_batch_size or 'whole'}, remat={train.remat})")
    quiet = filtered_stderr if topology and dev.platform == "tpu" else contextlib.nullcontext
    t0 = time.perf_counter()
    with quiet():
        # The step the trainer would run: auto settings chosen to fit the target's memory as the
        # trainer chooses them (olmax.train.fit), the verdict the step's own.
        fit = fit_step(model, train, build_optimizer(cfg.optim), mesh, jax.random.key(0),
                       lambda st: abstract_batch(st, b, t, packed=packed, doc_lens_width=width),
                       where=where, price=step_pricer(mesh, topology_wrap(mesh, topology)))
    compile_s = (time.perf_counter() - t0) / len(fit.trials)    # the step's own compile
    st, compiled = fit.training, fit.compiled
    assert st is not None
    train = dataclasses.replace(train, micro_batch_size=fit.micro_batch_size,
                                remat=cast(Remat, fit.remat))
    cfg = dataclasses.replace(cfg, train=train)
    batch_keys = sorted(abstract_batch(st, b, t, packed=packed, doc_lens_width=width))
    where = (f"the step ({topology or dev.platform} x{n}, batch {b} x {t}, remat={train.remat}, "
             f"attn={st.runtime.attn_impl}, profile={st.runtime.profile_name})")
    memory = _memory(compiled, dev, where, memory_hints(train, fit.micro_batch_size, fit.remat))
    memory["compiler_remat_ops"] = fit.compiler_remat_ops
    text = compiled.as_text()
    if hlo_out:
        write_bytes_atomic(hlo_out, text.encode())
    prog = hlo.analyse(text)
    acc = accelerator_of(dev)
    kernel, kernel_calls, kernel_effective = kernel_flops(prog, acc.mxu if acc else None)
    whole = cost(compiled)
    groups = model.n_layers // len(model.window_pattern)
    details: dict = {"mesh": dict(mesh.shape), "n_micro": st.n_micro, "layer_groups": groups,
                     "batch_keys": batch_keys,
                     "chips": chips(devices), "xla_whole_program_flops": whole.get("flops"),
                     "xla_whole_program_optimal_seconds": whole.get("optimal_seconds"),
                     "kernel_flops": kernel, "kernel_calls": kernel_calls,
                     "kernel_flops_at_mxu_occupancy": kernel_effective,
                     "loops_with_unknown_trip_count": prog.unknown_loops,
                     "compiler_options": compiler_options(backend_of(devices), devices,
                                                          train.compiler_options_dict()) or {}}
    if fit.auto:
        details["fit"] = fit.record()
    flops = _flops(model, b, t, n)
    estimate: dict = dict(_NO_ESTIMATE)
    coll = _time_collectives(prog, mesh, topology, details)
    if dev.platform == "gpu" or (dev.platform == "tpu" and _measured_rates(dev)):
        estimate = _estimate_kernels(text, dev, b * t, n, flops, coll, details)
    elif parts:
        estimate = _estimate(cfg, st, mesh, dev, n, flops, kernel, kernel_effective, coll, details)
    else:
        estimate.update(method="not computed (parts skipped)",
                        collective_s=None if coll is None else coll["collective_s"])
    estimate["calibration"] = calibration.for_device(dev)

    return Plan(topology=topology, num_devices=n, device_kind=dev.device_kind,
                profile=st.runtime.profile_name, attn_impl=st.runtime.attn_impl,
                remat=train.remat, global_batch_size=b, seq_len=t, memory=memory,
                flops_per_step=flops, estimate=estimate, collectives=hlo.collectives(prog),
                compile_s=compile_s, details=details)


def _memory(compiled, dev, where: str, hints: list[str]) -> dict:
    """Per-device memory of the compiled step against the device's usable memory; a step that
    compiled but needs more than there is raises :class:`DoesNotFit`, as an OOM at compile."""
    from olmax.platforms import backend_of

    ma = compiled.memory_analysis()
    hbm, hbm_fraction, hbm_source = usable_hbm(backend_of([dev]), *hbm_bytes(dev))
    arg, out, tmp = ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.temp_size_in_bytes
    alias, code = ma.alias_size_in_bytes, ma.generated_code_size_in_bytes
    peak = compiled_peak(compiled, dev.platform)
    memory = {"argument_bytes": int(arg), "output_bytes": int(out), "temp_bytes": int(tmp),
              "alias_bytes": int(alias), "code_bytes": int(code), "peak_bytes": int(peak),
              "hbm_bytes": hbm, "hbm_fraction": hbm_fraction,
              "fits": None if hbm is None else bool(peak <= hbm),
              "headroom": None if hbm is None else 1.0 - peak / hbm, "hbm_source": hbm_source}
    if memory["fits"] is False:
        raise DoesNotFit(int(peak), int(hbm), where, hints, source=hbm_source)
    return memory


def _flops(model, b: int, t: int, n: int) -> dict:
    """The analytic FLOPs per step per device; ``xla`` is filled in by :func:`_estimate`."""
    from olmax.model.flops import flops_per_token

    tokens = b * t
    return {"olmo_core": flops_per_token(model, t, "olmo_core") * tokens / n,
            "causal": flops_per_token(model, t, "causal") * tokens / n, "xla": None}


_NO_ESTIMATE = {"method": None, "compute_s": None, "kernel_s": None, "collective_s": None,
                "step_s": None, "step_s_no_overlap": None, "tokens_per_s_per_chip": None,
                "mfu_olmo_core": None, "mfu_causal": None}


def _time_collectives(prog, mesh, topology: str | None, details: dict) -> dict | None:
    """The compiled step's collectives timed by :mod:`olmax.perf.network` (into
    ``details["collective_time"]``), or None where the target's network is unknown or a link the
    step uses has no figure (``details["collective_time_unavailable"]`` says which)."""
    wrap = topology_wrap(mesh, topology)
    try:
        coll = step_collectives(prog, mesh, wrap)
    except network.Unpriced as e:     # a link the hardware table has no figure for
        details["collective_time_unavailable"] = str(e)
        return None
    if coll is None:
        return None
    details["collective_time"] = {"async_s": coll["async_s"], "sync_s": coll["sync_s"],
                                  "by_kind_s": coll["by_kind"], "wrap": list(wrap)}
    return coll


def _estimate(cfg: RunConfig, st, mesh, dev, n: int, flops: dict, kernel: float,
              kernel_effective: float, coll: dict | None, details: dict) -> dict:
    """XLA's FLOPs (into ``flops["xla"]``) and the step-time estimate from the unscanned parts
    (their costs into ``details["parts"]``) and the timed collectives; see the module docstring."""
    from olmax.model.flops import peak_flops
    from olmax.parallel.mesh import data_parallel_size

    b, t = cfg.train.global_batch_size, cfg.train.seq_len
    groups = details["layer_groups"]
    per_device = b // st.n_micro // data_parallel_size(mesh)
    # each device updates its 1/(fsdp x tensor) of the state: data replicas update the same part
    args = (cfg, dev, per_device, mesh.shape["tensor"], n // mesh.shape["data"], st.runtime)
    # under context parallelism a device holds 1/context of each of its rows' positions (the
    # attention kernels' work, which depends on the keys it sees too, is the compiled program's)
    ctx = mesh.shape["context"]
    positions = t // ctx
    o, o_share = _optimizer_part(args, positions)
    if o_share > 1:
        details["optimizer_part_share"] = o_share
    layers = _layer_parts(args, positions)
    if layers is None:
        details["parts"] = {"optimizer": o}
        return dict(_NO_ESTIMATE, collective_s=None if coll is None else coll["collective_s"],
                    method=("unavailable: the layer parts, compiled unscanned for the estimate, do "
                            "not fit the device even at one row (the step itself fits: see memory)"))
    rows, a1, a2 = layers
    scale = per_device / rows    # the layer parts were compiled for fewer rows: scaled to the step's
    details["parts_rows"] = rows
    m = st.n_micro

    def combine(key):
        if any(x.get(key) is None for x in (a1, a2, o)):
            return None
        group, rest = a2[key] - a1[key], 2 * a1[key] - a2[key]
        return m * scale * (groups * group + rest) + o[key]

    xla = combine("flops")
    flops["xla"] = None if xla is None else xla + kernel
    details["parts"] = {name: {k: part.get(k) for k in ("flops", "optimal_seconds", "optimal_seconds_raw",
                                                        "custom_calls", "bytes accessed")}
                        for name, part in (("one_layer_group", a1), ("two_layer_groups", a2),
                                           ("optimizer", o))}
    seconds = combine("optimal_seconds")
    peak_dev = peak_flops(dev)
    times = [x.get("optimal_seconds") for x in (a1, a2, o)]
    if not (seconds is not None and seconds > 0 and all(x > 0 for x in times) and times[1] > times[0]):
        return dict(_NO_ESTIMATE, collective_s=None if coll is None else coll["collective_s"],
                    method=(f"unavailable: XLA's {dev.platform} backend gives no usable cost-model "
                            f"time for the parts (optimal_seconds {times})"
                            + ("" if coll is None else "; collectives timed by olmax.perf.network")))
    acc = accelerator_of(dev)
    rate = acc.matmul_rate if acc else None
    kernel_s = kernel_effective / rate if (kernel_effective and rate) else 0.0
    compute_s = seconds + kernel_s
    method = (f"estimate: XLA {dev.platform.upper()} cost model (optimal_seconds) of unscanned "
              f"one-device parts, one layer group as (2 groups - 1 group): {m} micro-batch(es) x "
              f"({groups} layer groups + embedding/LM head/loss) + optimizer")
    if ctx > 1:
        method += f"; each row's {positions} positions on a device of its context group of {ctx}"
    if rows != per_device:
        method += (f"; the layer parts compiled for {rows} of the micro-batch's {per_device} rows "
                   f"(the {per_device} do not fit unscanned) and scaled x{per_device // rows}")
    if o_share > 1:
        method += (f"; the optimizer part compiled for 1/{o_share} of the device's state (the whole "
                   f"does not fit undonated) and scaled x{o_share}")
    if kernel:
        method += f"; {kernel_price(rate or 0)}"
    return _step(method, compute_s, kernel_s, coll, b * t, n, details["chips"], flops, peak_dev)


def _optimizer_part(args: tuple, positions: int) -> tuple[Any, int]:
    """The optimizer update's part (O) over the device's share of the state, and 1: or, where that
    share does not fit the device compiled apart (gradients, parameters and moments in and the new
    ones out, none donated, unlike in the step), over 1/k of it scaled by k (k = 2, 4, ...: the
    update is elementwise but for the global norm's sum), and k."""
    cfg, dev, per_device, tensor, n_devices, runtime = args
    share = 1
    while True:
        try:
            o = part_costs(cfg, dev, per_device, tensor, n_devices * share, runtime, only=("O",),
                           positions=positions)["O"]
        except DoesNotFit:
            if share >= 1024:
                raise
            share *= 2
            continue
        if share > 1:
            o = {k: (v * share if isinstance(v, (int, float)) and k in _SCALED else v)
                 for k, v in o.items()}
        return o, share


# the figures of a part that grow with the elements it updates
_SCALED = ("flops", "optimal_seconds", "optimal_seconds_raw", "bytes accessed")


def _layer_parts(args: tuple, positions: int) -> tuple[int, Any, Any] | None:
    """(rows, one layer group's part, two groups' part) compiled for the micro-batch's rows per
    device, or for the most rows dividing them whose unscanned parts fit the device (an unscanned
    part keeps every layer's activations at once, which the scanned step never does): the step's
    fit is the step's own verdict, never a part's. None when not even one row fits."""
    cfg, dev, per_device, *rest = args
    for rows in [d for d in range(per_device, 0, -1) if per_device % d == 0]:
        try:
            a1 = part_costs(cfg, dev, rows, *rest, only=("A",), positions=positions)["A"]
            a2 = part_costs(cfg, dev, rows, *rest, only=("A",), groups=2, positions=positions)["A"]
            return rows, a1, a2
        except DoesNotFit:
            continue
    return None


def kernel_price(rate: float) -> str:
    """How ``estimate.method`` says the Pallas kernels were priced, at ``rate`` FLOP/s."""
    return (f"Pallas kernels at their FLOPs / ({rate / 1e12:.1f} TFLOP/s, the device's sustained "
            "matrix rate, x the MXU occupancy of their block shapes)")


def _step(method: str, compute_s: float, kernel_s: float, coll: dict | None, tokens: int, n: int,
          chips: int, flops: dict, peak_dev: float | None) -> dict:
    """The estimate's step (compute and collectives combined), tokens/s per chip and MFU."""
    if coll is None:
        step_s = no_overlap = compute_s
        method += "; collectives not timed (no network model for this target; listed with their bytes)"
    else:
        step_s, no_overlap = network.overlap(compute_s, coll)
        method += ("; collectives timed by olmax.perf.network's bandwidth model (bytes and groups from "
                   "the compiled program); step = max(compute, asynchronous collectives) + "
                   "synchronous collectives")
    f_oc, f_c = flops["olmo_core"], flops["causal"]
    return {"method": method, "compute_s": compute_s, "kernel_s": kernel_s,
            "collective_s": None if coll is None else coll["collective_s"],
            "step_s": step_s, "step_s_no_overlap": no_overlap,
            "tokens_per_s_per_chip": tokens / n / step_s * (n / chips),
            "mfu_olmo_core": f_oc / step_s / peak_dev if peak_dev else None,
            "mfu_causal": f_c / step_s / peak_dev if peak_dev else None}


def _measured_rates(dev) -> bool:
    """Whether a table of rates measured on the device's own kind prices its step."""
    from olmax.perf import gpu_estimate

    return gpu_estimate.rates_for(accelerator_of(dev)) is not None


def _estimate_kernels(text: str, dev, tokens: int, n: int, flops: dict, coll: dict | None,
                      details: dict) -> dict:
    """The step time of a GPU, or of a TPU with a measured rates table: every kernel (op) of the
    compiled step at the measured rates of the table (:mod:`olmax.perf.gpu_estimate`),
    collectives timed as on any TPU."""
    from olmax.model.flops import peak_flops
    from olmax.perf import gpu_estimate

    acc = accelerator_of(dev)
    rates = gpu_estimate.rates_for(acc)
    if rates is None:
        return dict(_NO_ESTIMATE, collective_s=None if coll is None else coll["collective_s"],
                    method=f"unavailable: no measured rates table prices {dev.device_kind} "
                           "(olmax bench matmul --table on one, then a row's rates in olmax.hardware)")
    est = gpu_estimate.estimate(text, rates, dev.platform)
    details[f"{dev.platform}_kernels"] = {"by_kind": est["by_kind"], "kernels": est["kernels"],
                                          "rates_source": est["rates_source"]}
    method = (gpu_estimate.TPU_METHOD if dev.platform == "tpu" else gpu_estimate.METHOD) + \
        f"; rates: {est['rates_source']}"
    attn = est["by_kind"].get("attention", {})
    return _step(method, est["compute_s"], attn.get("seconds", 0.0), coll, tokens, n, details["chips"],
                 flops, peak_flops(dev))


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / GiB:.2f} GiB"


def _num(x, unit="") -> str:
    return "n/a" if x is None else f"{x:.4g}{unit}"


def format_plan(p: Plan) -> str:
    m, f, e, d = p.memory, p.flops_per_step, p.estimate, p.details
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    fit = ("n/a" if m["fits"] is None else
           ("fits" if m["fits"] else "DOES NOT FIT") + f", headroom {pct(m['headroom'])}")
    if m.get("compiler_remat_ops"):
        fit += (f", with {m['compiler_remat_ops']} instructions recomputed by the compiler "
                "(XLA's rematerialization: slower than its FLOPs say)")
    rows = [
        ("target", f"{p.topology or 'local devices'}: {p.num_devices} x {p.device_kind} "
                   f"({d['chips']} chips), mesh {d['mesh']}"),
        ("step", f"batch {p.global_batch_size} x seq {p.seq_len}, {d['n_micro']} micro-batch(es), "
                 f"profile={p.profile}, attn={p.attn_impl}, remat={p.remat}"),
        ("compile", f"{p.compile_s:.1f} s" + "".join(
            f", {k}={v}" for k, v in sorted((d.get("compiler_options") or {}).items()))),
        ("memory / device", f"arguments {_gib(m['argument_bytes'])}, outputs {_gib(m['output_bytes'])}, "
                            f"temporaries {_gib(m['temp_bytes'])}, aliased {_gib(m['alias_bytes'])}, "
                            f"code {_gib(m['code_bytes'])}"),
        ("peak vs HBM", f"{_gib(m['peak_bytes'])} of {_gib(m['hbm_bytes'])} ({m['hbm_source']}): {fit}"),
        ("FLOPs / device", f"olmo_core {_num(f['olmo_core'])}, causal {_num(f['causal'])}, "
                           f"xla {_num(f['xla'])}" + (f" (x{f['xla'] / f['causal']:.2f} of causal)"
                                                      if f["xla"] and f["causal"] else "")),
        ("estimate", e["method"] or "n/a"),
    ]
    if e.get("collective_s") is not None and not e["step_s"]:
        rows.append(("  collectives", f"{e['collective_s'] * 1e3:.1f} ms (timed by the network model)"))
    if e["step_s"]:
        rows.append(("  step time", f"{e['step_s'] * 1e3:.1f} ms, {e['tokens_per_s_per_chip']:,.0f} "
                                    f"tokens/s/chip, MFU {pct(e['mfu_olmo_core'])} (olmo_core), "
                                    f"{pct(e['mfu_causal'])} (causal)"))
        parts = [f"compute {e['compute_s'] * 1e3:.1f} ms (kernels {e['kernel_s'] * 1e3:.1f})"]
        if e.get("collective_s") is not None:
            parts += [f"collectives {e['collective_s'] * 1e3:.1f} ms",
                      f"no overlap {e['step_s_no_overlap'] * 1e3:.1f} ms"]
        rows.append(("  parts", ", ".join(parts)))
    if "calibration" in e:
        rows.append(("  calibration", calibration.summary(e["calibration"])))
    coll = ", ".join(f"{c['kind']} {c['count']}x {_gib(c['bytes'])}" for c in p.collectives) or "none"
    rows.append(("collectives", coll))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
