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
import os
import re
import sys
import tempfile
import time
from typing import Any

from olmax.config import ConfigError, OlmaxError, RunConfig
from olmax.io import write_bytes_atomic

GiB = 2 ** 30

# HBM per device (bytes), matched as lower-case substrings of ``device_kind``, most specific first.
# tpu7x (Ironwood): 192 GiB per chip shared by its 2 devices (TensorCores).
HBM_BYTES: tuple[tuple[str, int], ...] = (
    ("tpu7x", 96 * GiB),
    ("tpu v6 lite", 32 * GiB),
    ("tpu v6e", 32 * GiB),
    ("tpu v5 lite", 16 * GiB),
    ("tpu v5e", 16 * GiB),
    ("tpu v5p", 95 * GiB),
    ("tpu v5", 95 * GiB),          # v5p reports itself as "TPU v5"
    ("tpu v4", 32 * GiB),
    ("h200", 141 * GiB),
    ("h100", 80 * GiB),
)

_LIBTPU_NOISE = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "Failed to find host bounds",
                 "Logging before InitGoogle", "libtpu_init_utils", "Source Location Trace",
                 "could not determine TPU")


def hbm_bytes(device: Any) -> tuple[int | None, str]:
    """(bytes, source) of one device's memory: the runtime's limit where a real device reports one,
    else the table above, else (CPU) the host's physical memory shared by its devices."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # topology devices and some backends have none
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "runtime"
    kind = str(getattr(device, "device_kind", "")).lower()
    for key, value in HBM_BYTES:
        if key in kind:
            return value, "table"
    if getattr(device, "platform", "") == "cpu":
        import jax

        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return host // max(1, len(jax.local_devices(backend="cpu"))), "host memory / devices"
    return None, "unknown"


def usable_hbm(backend: str, hbm: int | None, source: str,
               environ=os.environ) -> tuple[int | None, float, str]:
    """(bytes a step may use, the share of the device's memory that is, where it comes from). On
    GPUs JAX's allocator takes ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the memory (0.90 in the jobs
    ``olmax launch`` writes: :data:`olmax.perf.gpu_targets.MEM_FRACTION`); a real GPU's runtime
    limit has it applied already. Elsewhere the whole memory."""
    if backend != "gpu":
        return hbm, 1.0, source
    from olmax.perf.gpu_targets import MEM_FRACTION_ENV, mem_fraction

    fraction = mem_fraction(environ)
    if hbm is None or source != "table":
        return hbm, fraction, source
    return int(hbm * fraction), fraction, f"{source} x {MEM_FRACTION_ENV} {fraction:g}"


def _no_tpu_attached() -> bool:
    import glob

    return not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


@contextlib.contextmanager
def _filtered_stderr():
    """Drop libtpu's start-up warnings (file-descriptor level: they come from C++)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (some test runners)
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines():
                if line.strip() and not any(n in line for n in _LIBTPU_NOISE):
                    print(line, file=sys.stderr)


def cuda_plugin_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def gpu_topology_devices(kind: str, count: int) -> list:
    """``count`` compile-only GPUs described by ``olmax.perf.gpu_targets`` (no GPU needed; the CUDA
    PJRT plugin must be installed)."""
    import glob

    from olmax.perf.gpu_targets import TARGETS

    if not cuda_plugin_installed():
        import jax

        raise OlmaxError(f"--topology {kind}:{count}: compiling for GPUs needs JAX's CUDA plugin: "
                         f"pip install 'jax[cuda12]=={jax.__version__}'")
    if not glob.glob("/dev/nvidia[0-9]*"):  # no driver to check the CUDA libraries against
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[kind],
                                            topology=f"1x1x{count}")
    except (RuntimeError, NotImplementedError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OlmaxError(f"--topology {kind}:{count}: the CUDA plugin cannot compile without a GPU "
                         f"here ({msg})") from None
    return list(desc.devices)


TPU_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e", "tpu7x")   # libtpu's topology names
_TPU_SHAPE = re.compile(r"[1-9]\d*(x[1-9]\d*){1,2}")
_TOPOLOGY_EXAMPLES = ("examples: v5e:2x2, v5p:2x2x1, v5p:4x4x4 or v5p-128, v6e:4x4, tpu7x:2x2x1, "
                      "tpu7x:4x4x4 or tpu7x-128 (GPUs: h100:8, h200:8)")


def libtpu_topology(name: str) -> str:
    """The libtpu name of a TPU ``--topology``: an accelerator type (``v5p-128``, as ``olmax
    launch`` takes it) becomes its generation and shape (``v5p:4x4x4``); other names are kept."""
    from olmax.topology import parse_tpu

    return parse_tpu(name).libtpu_name if ":" not in name else name


def check_topology_name(name: str) -> None:
    """Refuse a ``--topology`` that names no TPU topology or GPU target, by its spelling alone,
    before any plugin is looked for (so a typo is not answered with "install libtpu")."""
    from olmax.perf import gpu_targets
    from olmax.topology import is_tpu_name

    if gpu_targets.parse(name) is not None:
        return
    if ":" not in name and is_tpu_name(name):
        try:
            libtpu_topology(name)
        except ConfigError as e:
            raise OlmaxError(str(e)) from None
        return
    gen, colon, shape = name.partition(":")
    if gen.lower() not in TPU_GENERATIONS:
        why = f"no TPU generation '{gen}'; known: {', '.join(TPU_GENERATIONS)}"
    elif not colon or not _TPU_SHAPE.fullmatch(shape):
        why = f"the shape '{shape}' is not AxB or AxBxC in positive whole numbers"
    else:
        return
    raise OlmaxError(f"unknown TPU topology '{name}' ({why}); {_TOPOLOGY_EXAMPLES}")


def _tell_libtpu_no_tpu() -> None:
    """On a host without TPUs, tell libtpu so before it loads, whatever the plan's target (JAX
    initialises every installed backend, libtpu's too, for a CPU or GPU plan): no metadata-server
    lookups, no warnings about accelerator type or worker hostnames, several compiling processes
    allowed. Variables already set are kept."""
    if _no_tpu_attached():
        for key, value in {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
                           "TPU_ACCELERATOR_TYPE": "v5litepod-4",  # any valid type: only silences a warning
                           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}.items():
            os.environ.setdefault(key, value)


def topology_devices(name: str) -> list:
    """The devices of a TPU topology such as ``v5p:4x4x4`` or ``tpu7x:2x2x2`` or a GPU target
    such as ``h100:8`` (compilation only; :func:`check_topology_name` first)."""
    from olmax.perf import gpu_targets

    check_topology_name(name)
    _tell_libtpu_no_tpu()
    gpu = gpu_targets.parse(name)
    if gpu is not None:
        return gpu_topology_devices(*gpu)
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - every supported jax has it
        raise OlmaxError(f"this jax has no ahead-of-time topology support ({e})") from None
    try:
        with _filtered_stderr():
            desc = topologies.get_topology_desc(platform="tpu", topology_name=libtpu_topology(name))
    except RuntimeError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "not installed" in msg or "libtpu" in msg.lower() and "lockfile" not in msg:
            raise OlmaxError(f"--topology {name}: compiling for TPUs needs libtpu: install the tpu "
                             f"extra on Python >= 3.12 (PYTHON=python3.12 scripts/bootstrap tpu)") from None
        if "INVALID_ARGUMENT" in msg or "Invalid" in msg or "not divisible" in msg:
            detail = msg.split("INVALID_ARGUMENT:")[-1].strip()
            raise OlmaxError(f"unknown TPU topology '{name}' ({detail}); {_TOPOLOGY_EXAMPLES}") from None
        raise OlmaxError(f"--topology {name}: {msg}") from None
    return list(desc.devices)


def _chips(devices: list) -> int:
    coords = {tuple(c) for d in devices if (c := getattr(d, "coords", None)) is not None}
    return len(coords) or len(devices)


_OOM_PATTERNS = (
    re.compile(r"\(([\d.]+)([KMGT]?)\)\s*exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
    re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
)
_UNIT = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def parse_hbm_oom(message: str) -> tuple[int, int] | None:
    """(bytes needed, bytes available) from XLA's compile-time out-of-HBM error, else None."""
    for pat in _OOM_PATTERNS:
        m = pat.search(message)
        if m:
            need = float(m.group(1)) * _UNIT[m.group(2)]
            have = float(m.group(3)) * _UNIT[m.group(4)]
            return int(need), int(have)
    return None


class DoesNotFit(OlmaxError):
    """The step needs more device memory than there is (found at compile time)."""

    def __init__(self, needed: int, available: int, where: str):
        self.needed, self.available = needed, available
        super().__init__(f"does not fit: {where} needs {needed / GiB:.2f} GiB per device of HBM "
                         f"temporaries, {available / GiB:.2f} GiB available")


def _compile(lowered, where: str):
    try:
        return lowered.compile()
    except Exception as e:  # XLA raises its runtime error type; only an HBM OOM is ours to explain
        oom = parse_hbm_oom(str(e))
        if oom is None:
            raise
        raise DoesNotFit(*oom, where) from None


# XLA-internal custom calls that XLA's TPU cost model enters into ``optimal_seconds`` as -1 s each
# ("unknown"): an optimizer update whose only custom calls were two ConcatBitcast came out at
# -2 s + its positive time. A ConcatBitcast joins slices by relabelling memory (no arithmetic) and
# is taken as free. (AssumeGatherIndicesInBound, seen in a part with a positive time, is not.)
# A part whose corrected time is still not positive gives no estimate.
_MINUS_ONE_CUSTOM_CALLS = ("ConcatBitcast",)


def _cost(compiled) -> dict:
    """``cost_analysis`` of a compiled program, with ``optimal_seconds`` corrected for the -1 s that
    each custom call unknown to the cost model contributes (they are data-layout rewrites, taken
    as free); ``custom_calls`` counts the custom calls by target."""
    from olmax.perf import hlo

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


def _part_costs(cfg: RunConfig, device, per_device_batch: int, tensor: int, n_devices: int,
                runtime, *, only: tuple[str, ...] = ("A", "H", "O"),
                hlo_dir: str | None = None, groups: int = 1) -> dict:
    """Cost analyses of the step's parts as one device runs them, compiled unscanned for that
    device alone (no collectives: XLA's cost model gives collectives no usable time): (A) the loss
    with one layer group, forward + backward; (H) LM head + loss, forward + backward; (O) the
    optimizer update over this device's 1/n of the state, with the model run as ``runtime`` says
    (an :class:`olmax.model.runtime.Runtime`, its profile resolved). ``only``: the parts to compile;
    ``hlo_dir``: also write each part's optimized HLO text there as ``part_<name>.hlo.txt``;
    ``groups``: layer groups in (A) (two give one group's cost as the difference from one)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from olmax.model.params import abstract_params
    from olmax.parallel.mesh import MESH_AXES
    from olmax.train.loss import lm_loss, loss_and_sums
    from olmax.train.optim import build_optimizer
    from olmax.train.step import traced_under_mesh

    model, train = local_model(cfg.model, tensor), cfg.train
    dtype = runtime.compute_dtype
    t, b = train.seq_len, per_device_batch
    mesh = Mesh(np.asarray([device]).reshape(1, 1, 1), MESH_AXES)
    one = NamedSharding(mesh, P())
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=one)  # noqa: E731
    tok = spec((b, t), jnp.int32)

    def cost(name, fn, *args):
        compiled = _compile(jax.jit(traced_under_mesh(fn, mesh)).lower(*args), "a part of the step")
        if hlo_dir:
            write_bytes_atomic(os.path.join(hlo_dir, f"part_{name}.hlo.txt"), compiled.as_text().encode())
        return _cost(compiled)

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
        out["A"] = cost("A", jax.grad(loss_a), p_group, tok, tok)

    def loss_h(h, w, y):
        return lm_loss(h, w, y, z_loss_multiplier=train.z_loss_multiplier, chunk_size=t,
                       kernels=runtime.kernels)[0] / (b * t)
    if "H" in only:
        out["H"] = cost("H", jax.grad(loss_h, argnums=(0, 1)), spec((b, t, model.d_model), dtype),
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
    out["O"] = cost("O", update, params, opt, params, scalar, scalar)
    return out


# ----------------------------------------------------------------------------------------------
# Plan


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


def _kernel_flops(prog) -> tuple[float, dict]:
    """FLOPs the splash kernels execute per step (per device), from the compiled HLO."""
    from olmax.model.splash import kernel_flops, parse_scope
    from olmax.perf import hlo

    total, calls = 0.0, {}
    for ins, mult in hlo.custom_calls(prog, "tpu_custom_call"):
        names = hlo.op_names(ins)
        shape = next((s for s in map(parse_scope, names) if s), None)
        phase = re.search(r"splash_m[hq]a_(fwd|dq|dkv)", ins.name + " " + " ".join(names))
        if shape is None or phase is None:
            continue
        f = kernel_flops(shape["t"], shape["window"], shape["heads"], shape["head_dim"],
                         shape["batch"], phase.group(1), shape["block"])
        total += f * mult
        calls[phase.group(1)] = calls.get(phase.group(1), 0) + int(mult)
    return total, calls


def plan(cfg: RunConfig, topology: str | None = None, *, parts: bool = True,
         hlo_out: str | None = None) -> Plan:
    """Compile the training step of ``cfg`` for ``topology`` (or the local devices); see module.
    ``hlo_out``: also write the compiled step's optimized HLO text there."""
    import jax
    import jax.numpy as jnp

    from olmax.model.flops import flops_per_token, peak_flops
    from olmax.parallel.mesh import data_parallel_size, make_mesh
    from olmax.platforms import backend_of
    from olmax.perf import hlo
    from olmax.train.optim import build_optimizer
    from olmax.train.step import build_sharded_training

    _tell_libtpu_no_tpu()
    devices = topology_devices(topology) if topology else jax.devices()
    mesh = make_mesh(cfg.mesh, devices)
    n = len(devices)
    dev = devices[0]
    model, train = cfg.model, cfg.train
    if train.seq_len > model.max_seq_len and model.rope_scaling is None:
        raise ConfigError(f"train.seq_len {train.seq_len} exceeds model.max_seq_len {model.max_seq_len}")
    st = build_sharded_training(model, train, build_optimizer(cfg.optim), mesh, jax.random.key(0))
    b, t = train.global_batch_size, train.seq_len
    batch = {"tokens": jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=st.batch_shardings["tokens"]),
             "instance_mask": jax.ShapeDtypeStruct((b,), jnp.bool_,
                                                   sharding=st.batch_shardings["instance_mask"])}
    lr = jax.ShapeDtypeStruct((), jnp.float32)
    where = (f"{topology or dev.platform} x{n}, batch {b} x {t}, remat={train.remat}, "
             f"attn={st.runtime.attn_impl}, profile={st.runtime.profile_name}")
    t0 = time.perf_counter()
    with _filtered_stderr() if topology and dev.platform == "tpu" else contextlib.nullcontext():
        compiled = _compile(st.step_fn.lower(st.abstract_state, batch, lr), f"the step ({where})")
    compile_s = time.perf_counter() - t0

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
    if memory["fits"] is False:   # compiled, but more than the devices have: as an OOM at compile
        raise DoesNotFit(int(peak), int(hbm), f"the step ({where})")

    text = compiled.as_text()
    if hlo_out:
        write_bytes_atomic(hlo_out, text.encode())
    prog = hlo.analyse(text)
    kernel, kernel_calls = _kernel_flops(prog)
    whole = _cost(compiled)

    tokens = b * t
    f_oc = flops_per_token(model, t, "olmo_core") * tokens / n
    f_c = flops_per_token(model, t, "causal") * tokens / n
    groups = model.n_layers // len(model.window_pattern)
    flops = {"olmo_core": f_oc, "causal": f_c, "xla": None}
    details: dict = {"mesh": dict(mesh.shape), "n_micro": st.n_micro, "layer_groups": groups,
                     "chips": _chips(devices), "xla_whole_program_flops": whole.get("flops"),
                     "xla_whole_program_optimal_seconds": whole.get("optimal_seconds"),
                     "kernel_flops": kernel, "kernel_calls": kernel_calls,
                     "loops_with_unknown_trip_count": prog.unknown_loops}
    estimate = {"method": None, "step_s": None, "tokens_per_s_per_chip": None,
                "mfu_olmo_core": None, "mfu_causal": None}
    if parts:
        per_device = b // st.n_micro // data_parallel_size(mesh)
        pc = _part_costs(cfg, dev, per_device, mesh.shape["tensor"], n, st.runtime)
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
        if seconds is not None and seconds > 0 and all(x["optimal_seconds"] > 0 for x in (a, h, o)):
            kernel_s = kernel / peak_dev if (kernel and peak_dev) else 0.0
            step_s = seconds + kernel_s
            per_chip = n / details["chips"]
            tps_dev = tokens / n / step_s
            method = (f"estimate: XLA {dev.platform.upper()} cost model (optimal_seconds) summed over "
                      f"unscanned one-device parts: {m} micro-batch(es) x ({groups} layer groups + "
                      f"LM head/loss) + optimizer")
            if kernel:
                method += "; Pallas kernels at their FLOPs / peak"
            method += "; collectives not timed (assumed overlapped; listed with their bytes)"
            estimate = {"method": method, "step_s": step_s,
                        "tokens_per_s_per_chip": tps_dev * per_chip,
                        "mfu_olmo_core": f_oc / step_s / peak_dev if peak_dev else None,
                        "mfu_causal": f_c / step_s / peak_dev if peak_dev else None}
        else:
            estimate["method"] = (f"unavailable: XLA's {dev.platform} backend gives no usable cost-model "
                                  f"time for the parts (optimal_seconds "
                                  f"{[x.get('optimal_seconds') for x in (a, h, o)]})")
    else:
        estimate["method"] = "not computed (parts skipped)"

    return Plan(topology=topology, num_devices=n, device_kind=dev.device_kind,
                profile=st.runtime.profile_name, attn_impl=st.runtime.attn_impl,
                remat=train.remat, global_batch_size=b, seq_len=t, memory=memory,
                flops_per_step=flops, estimate=estimate, collectives=hlo.collectives(prog),
                compile_s=compile_s, details=details)


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
