"""``olmax bench profile``: where the trainer's CPU step spends its time and memory, op by op.

Compiles the trainer's step (``olmax.perf.bench.TrainStepRunner``: chunked loss, SkipStep
AdamW, donated state) at a benchmark shape, reports the compiled program's memory analysis (XLA's
own figures: arguments, outputs, aliased, temporaries), runs ``--steps`` steps under
``jax.profiler.trace`` and attributes every XLA op event of the CPU executor threads to

- the HLO instruction (name, shape, kind: matmul/``ynn`` dot fusion, element-wise loop fusion,
  scatter, copy/transpose, reduction, ...),
- the innermost olmax (or optax) source line it was traced from (the compiled HLO's stack frames),
- the pass: ``fwd`` (forward), ``remat`` (a forward recomputed in the backward pass), ``bwd``
  (the transpose), ``update`` (everything after the gradient: clip, AdamW); ``unattributed``
  where neither the op nor its fusion's body carries the trace's metadata.

Each op's ms is its share of the step's wall time (see :func:`profile_events`), the median over the
profiled steps; on a loaded machine it includes time its thread was preempted -- compare
proportions within one run. Ops that run dots also get their achieved rate (the dots' FLOPs from
the compiled HLO over the op's ms) against the matmul ceiling measured in the same process
(``olmax.perf.bench.matmul_ceiling``: a 1024^3 GEMM in the same dtype); every other op its bytes
(result plus operands from the HLO shapes: :func:`olmax.perf.hlo.op_bytes`) per second against the bandwidth
ceiling measured at its size (:func:`bandwidth_ceilings`: an element-wise op looped over 1 to
256 MiB). The sum of every op at its own ceiling is the step's *floor estimate*.

Ops that overlap share the wall time between them, so a GEMM running beside an element-wise op is
credited with half of that time and can show a rate above the ceiling. ``--perf`` measures the
other way round: Linux ``perf`` samples the CPU time of the same number of steps and splits it by
code (:func:`_code_class`: the GEMM library's micro-kernels, its packing, the code XLA generated,
the kernel's page faults); the GEMMs' rate then comes from their CPU time over the cores.

    olmax bench profile benchmarks/shapes/A.yaml [train.compute_dtype=bfloat16] [--steps 3] [--perf]
"""

from __future__ import annotations

import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time

from olmax.config import RunConfig
from olmax.perf import hlo

_CONTAINER = re.compile(r"^(while|conditional|call)(\.\d+)?$")
_WRAPPERS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "Await", "WhileThunk", "PjRt")


def instruction_info(text: str) -> dict[str, dict]:
    """Instruction name -> {shape, kind, op_name, source} from a compiled module's text: ``kind``
    the opcode (a fusion's kind; ``ynn_fusion`` for the GEMM library's), ``source`` the innermost
    olmax (or optax) ``file:line function`` of its stack frames, else ``?``."""
    comps, _ = hlo.parse(text)
    frames = hlo.stack_frames(text)

    def source(frame_id: str | None) -> str:
        for path, line, fn in frames.get(int(frame_id), []) if frame_id else []:
            if "/olmax/" in path or "/optax/" in path:
                short = path.split("/olmax/")[-1] if "/olmax/" in path else "optax/" + path.split("/optax/")[-1]
                return f"{short}:{line} {fn.split('.')[-1]}"
        return "?"

    out = {}
    # A fusion XLA built itself (a reduction split in two, a weight cast) can carry no metadata; it
    # then takes that of the first instruction in its body that has some.
    comp_meta, unnamed = {}, {}
    for cname, instrs in comps.items():
        for ins in instrs:
            op_name = re.search(r'op_name="([^"]*)"', ins.text)
            frame = re.search(r"stack_frame_id=(\d+)", ins.text)
            if op_name and cname not in comp_meta:
                comp_meta[cname] = (op_name.group(1), frame.group(1) if frame else None)
            kind = ins.opcode
            if ins.opcode == "fusion":
                fk = re.search(r"kind=(\w+)", ins.text)
                kind = "ynn_fusion" if "__ynn" in ins.text else (fk.group(1) if fk else "fusion")
                called = hlo.called_computations(ins).get("calls", [])
                if not op_name and called:
                    unnamed[ins.name] = called[0]
            out[ins.name] = {"shape": ins.shape.strip(), "kind": kind,
                             "op_name": op_name.group(1) if op_name else "",
                             "source": source(frame.group(1) if frame else None)}
    for name, called in unnamed.items():
        if called in comp_meta:
            op_name, frame = comp_meta[called]
            out[name].update(op_name=op_name, source=source(frame))
    return out


BANDWIDTH_MIB = (1, 4, 16, 64, 256)


def bandwidth_ceilings(sizes_mib=BANDWIDTH_MIB, min_bytes: float = 4e9) -> list[dict]:
    """The best rate of an element-wise op on this host at each working set in ``sizes_mib``:
    ``x = a * x + b`` over that many MiB of fp32, repeated inside one compiled loop (so small sizes
    measure the caches, not dispatch), counted as bytes read plus bytes written per second; the
    ceiling of an op that does little arithmetic per byte and moves that much data."""
    import jax
    import jax.numpy as jnp

    out = []
    for mib in sizes_mib:
        n = mib * 2**18
        reps = max(1, int(min_bytes // (8 * n)))
        f = jax.jit(lambda v, r=reps: jax.lax.fori_loop(0, r, lambda _, u: u * 1.0009765625 + 0.25, v))
        x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
        f(x).block_until_ready()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            best = min(best, time.perf_counter() - t0)
        out.append({"mib": mib, "traffic_bytes": 8 * n, "bytes_per_s": 8 * n * reps / best})
    return out


def bandwidth_for(nbytes: float, ceilings: list[dict]) -> float:
    """The ceiling for an op moving ``nbytes`` in one run: that of the smallest measured working set
    whose traffic is at least as large (the largest for a bigger op)."""
    for c in ceilings:
        if nbytes <= c["traffic_bytes"]:
            return c["bytes_per_s"]
    return ceilings[-1]["bytes_per_s"]


def phase(op_name: str) -> str:
    if "rematted_computation" in op_name:
        return "remat"
    if "transpose(jvp" in op_name:
        return "bwd"
    if "jvp(" in op_name:
        return "fwd"
    return "update" if op_name else "unattributed"


def component(source: str, op_name: str) -> str:
    """A coarse label of the step's part an op belongs to, from its source line."""
    s = source
    if s.startswith("optax/") or "optim.py" in s:
        return "optimizer (clip, AdamW)"
    if "loss.py" in s or "logits_from_hidden" in s or "lm_head" in s or "lse_and_target" in s:
        return "LM head + loss"
    if "attention" in s or "splash" in s:
        return "attention"
    if "hidden_states" in s and ("take" in op_name or "scatter" in op_name or "gather" in op_name):
        return "embedding"
    if "hidden_states" in s:
        return "embedding" if "_take" in op_name else "other model"
    if "dense" in s or "_mlp_block" in s:
        return "layer matmuls"
    if "rms_norm" in s or "rope" in s or "_layer" in s or "_attention_block" in s:
        return "norms/rope/residual"
    if "step.py" in s:
        return "step (grad accumulation, metrics)"
    return "other"


def profile_events(trace_dir: str) -> tuple[dict[str, list], float]:
    """Op name -> [runs, ms] over the XLA executor threads, and the executor's wall time (ms).

    An op runs from its event's start to its ``end: NAME`` marker: XLA's CPU runtime completes some
    ops asynchronously (Eigen's dots among them), so the event alone can close long before the
    work does. The step's wall time is then shared out: every interval between two span boundaries
    goes in equal parts to the ops running in it (an interval with none to the op that finished
    last), so the ms column sums to the executor's wall time."""
    from jax.profiler import ProfileData

    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    planes = list(ProfileData.from_file(path).planes)
    device = device_op_events(planes)
    if device is not None:
        return device
    starts: dict[str, list] = collections.defaultdict(list)
    ends: dict[str, list] = collections.defaultdict(list)
    exec_ms = 0.0
    window = None
    for plane in planes:
        for line in plane.lines:
            for ev in line.events:
                if line.name.startswith("tf_XLAPjRtCpuClient") and ev.name.startswith(
                        "ThunkExecutor::Execute (wait"):
                    exec_ms += ev.duration_ns / 1e6
                    w = (ev.start_ns, ev.start_ns + ev.duration_ns)
                    window = w if window is None else (min(window[0], w[0]), max(window[1], w[1]))
                if not line.name.startswith("tf_XLA") or ev.name.startswith(_WRAPPERS):
                    continue
                if _CONTAINER.match(ev.name.removeprefix("end: ")):
                    continue                # a loop/conditional: its body's ops are the events
                if ev.name.startswith("end: "):
                    ends[ev.name[5:]].append(ev.start_ns + ev.duration_ns)
                else:
                    starts[ev.name].append((ev.start_ns, ev.start_ns + ev.duration_ns))
    spans = []
    for name, ss in starts.items():
        ss.sort()
        ee = sorted(ends.get(name, []))
        for k, (s0, s1) in enumerate(ss):
            spans.append((s0, max(s1, ee[k]) if k < len(ee) else s1, name))
    count = collections.Counter(n for _, _, n in spans)
    ms: dict[str, float] = collections.defaultdict(float)
    bounds = sorted({t for s0, s1, _ in spans for t in (s0, s1)} | set(window or ()))
    spans.sort()
    active: list = []
    last_ended = None
    i = 0
    for a, b in zip(bounds, bounds[1:]):
        while i < len(spans) and spans[i][0] <= a:
            active.append(spans[i])
            i += 1
        done = [sp for sp in active if sp[1] <= a]
        if done:
            last_ended = max(done, key=lambda sp: sp[1])[2]
            active = [sp for sp in active if sp[1] > a]
        if window and (b <= window[0] or a >= window[1]):
            continue
        if active:
            for sp in active:
                ms[sp[2]] += (b - a) / 1e6 / len(active)
        elif last_ended is not None:
            ms[last_ended] += (b - a) / 1e6
    return {n: [count[n], ms[n]] for n in count}, exec_ms


_DEVICE_PLANE = re.compile(r"^/device:TPU:(\d+)$")


def _op_name(event_name: str) -> str:
    """The HLO instruction's name of a device op event: a TPU's events are named by the
    instruction's whole text (``fusion.12 = bf16[...] fusion(...), kind=kOutput, ...``)."""
    return event_name.split(" = ", 1)[0].strip().lstrip("%")


def device_op_events(planes) -> tuple[dict[str, list], float] | None:
    """Op name -> [runs, ms] from an accelerator's own timeline, and the time its programs ran
    (ms); None where the trace has none (a CPU run).

    A TPU's plane (``/device:TPU:0``; the first device when there are several: every device
    runs the same program) has a line ``XLA Ops``, one event per HLO instruction the chip ran, and
    ``XLA Modules``, one per program run. The chip runs one op at a time on its core, so each op's
    ms is its own time on that line, less the time of the ops nested inside it (a loop or a
    conditional is an event around its body's ops); the ms column then sums to the modules' time
    less the gaps between ops."""
    found = sorted(((int(m.group(1)), plane) for plane in planes
                    if (m := _DEVICE_PLANE.match(plane.name))), key=lambda kv: kv[0])
    for _, plane in found:
        lines = {line.name: line for line in plane.lines}
        if "XLA Ops" not in lines:
            continue
        events = sorted(((ev.start_ns, ev.start_ns + ev.duration_ns, _op_name(ev.name))
                         for ev in lines["XLA Ops"].events), key=lambda e: (e[0], -e[1]))
        count: collections.Counter = collections.Counter()
        ms: dict[str, float] = collections.defaultdict(float)
        stack: list[list] = []            # [end_ns, name, exclusive ns]
        for s0, s1, name in [*events, (float("inf"), float("inf"), "")]:
            while stack and stack[-1][0] <= s0:     # ops that ended before this one starts
                _, done, own = stack.pop()
                ms[done] += own / 1e6
            if not name:
                break
            if stack:                     # nested: the parent's own time loses the child's
                stack[-1][2] -= min(s1, stack[-1][0]) - s0
            stack.append([s1, name, s1 - s0])
            count[name] += 1
        modules = lines.get("XLA Modules")
        exec_ms = sum(ev.duration_ns for ev in modules.events) / 1e6 if modules is not None else sum(ms.values())
        return {n: [count[n], ms[n]] for n in count}, exec_ms
    return None


GEMM_KERNELS = "GEMM micro-kernels (ynn::dot_*)"


def _code_class(dso: str, sym: str) -> str:
    if dso.startswith("[kernel"):
        return "kernel (page faults, zeroing, scheduling)"
    if dso.startswith("[JIT]") or dso == "[unknown]" or sym.startswith("0x"):
        return "XLA-generated code (element-wise, reductions, copies)"
    if sym.startswith("ynn::dot_"):
        return GEMM_KERNELS
    if sym.startswith("ynn::") or "slinky" in sym:
        return "GEMM library: packing, transposes, other"
    if "libpython" in dso or dso.startswith("python"):
        return "Python"
    return "runtime and other libraries"


def perf_split(runner, steps: int, hz: int = 999) -> dict | None:
    """CPU time of ``steps`` steps by code (:func:`_code_class`), from ``perf record`` attached to
    this process; None (with a line saying why) where perf is missing or not allowed."""
    import shutil
    import subprocess

    if not shutil.which("perf"):
        print("perf: not on PATH; no CPU-time split", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "perf.data")
        rec = subprocess.Popen(["perf", "record", "-F", str(hz), "-p", str(os.getpid()), "-o", data],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)                    # perf attaches to every thread before the steps start
        if rec.poll() is not None:
            why = (rec.stderr.read().strip().splitlines() or ["no message"])[-1]
            print(f"perf record failed ({why}); no CPU-time split", file=sys.stderr)
            return None
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.run()
        wall = time.perf_counter() - t0
        rec.send_signal(2)
        rec.wait(timeout=120)
        rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", "dso,sym", "-F",
                              "sample,dso,sym", "--percent-limit", "0"], capture_output=True, text=True)
    share, total = parse_perf_report(rep.stdout)
    if not total:
        print("perf report: no samples", file=sys.stderr)
        return None
    # The second before the steps adds few samples: the process is idle then (perf samples CPU
    # time, not wall time).
    cores = len(os.sched_getaffinity(0))
    return {"hz": hz, "samples": total, "cores": cores, "steps": steps, "wall_s": wall,
            "cpu_s_per_step": total / hz / steps,
            "share": dict(sorted(((k, v / total) for k, v in share.items()), key=lambda kv: -kv[1]))}


def parse_perf_report(text: str) -> tuple[dict[str, int], int]:
    """Samples per :func:`_code_class` from ``perf report --stdio --sort dso,sym -F sample,dso,sym``,
    and their total."""
    share: dict[str, int] = collections.defaultdict(int)
    total = 0
    for line in text.splitlines():
        m = re.match(r"^\s*(\d+)\s+(\S+(?: tid \d+)?)\s+\[(.)\]\s+(.*)$", line)
        if not m:
            continue
        n, dso, kind, sym = int(m.group(1)), m.group(2), m.group(3), m.group(4).strip()
        total += n
        share[_code_class("[kernel]" if kind == "k" else dso, sym)] += n
    return dict(share), total




def profile_step(cfg: RunConfig, steps: int = 3, *, hlo_out: str | None = None,
                 perf: bool = False) -> dict:
    """Compile the trainer's step for ``cfg`` on one device, run one warm-up step and ``steps``
    profiled steps (one trace each: per-op medians over steps resist load spikes), and attribute
    the time op by op (see the module docstring); ``perf``: also split ``steps`` more steps' CPU
    time by code. Returns the figures :func:`format_profile` prints."""
    import jax

    from olmax.io import write_bytes_atomic
    from olmax.perf.bench import TrainStepRunner, matmul_ceiling

    dtype = cfg.train.compute_dtype
    runner = TrainStepRunner(cfg)
    ma = runner.compiled.memory_analysis()
    mem = {k: int(getattr(ma, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                            "alias_size_in_bytes", "temp_size_in_bytes")}
    text = runner.compiled.as_text()
    if hlo_out:
        write_bytes_atomic(hlo_out, text.encode())
    info_of = instruction_info(text)
    flops = hlo.dot_flops(text)
    nbytes = hlo.op_bytes(text)
    runner.run()
    per_step, walls, execs = [], [], []
    for _ in range(steps):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            with jax.profiler.trace(d):
                runner.run()
            walls.append(time.perf_counter() - t0)
            agg, ex = profile_events(d)
        per_step.append(agg)
        execs.append(ex)
    wall, exec_ms = statistics.median(walls), statistics.median(execs)
    agg = {n: [per_step[0].get(n, [0, 0.0])[0], statistics.median(st.get(n, [0, 0.0])[1] for st in per_step)]
           for n in set().union(*per_step)}

    rows = []
    for name, (count, ms) in agg.items():
        info = info_of.get(name, {"shape": "?", "kind": "?", "op_name": "", "source": "?"})
        f = flops.get(name, 0.0) * count
        b = 0 if f else nbytes.get(name, 0) * count
        rows.append({"op": name, "ms": ms, "count": count, **info, "dot_flops": f,
                     "gflops_per_s": f / ms / 1e6 if f and ms else None, "bytes": b,
                     "gbytes_per_s": b / ms / 1e6 if b and ms else None,
                     "phase": phase(info["op_name"]), "component": component(info["source"], info["op_name"])})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    ceil = matmul_ceiling(dtype=dtype)      # the platform's size: 8192^3 on accelerators, 1024^3 on CPU
    bws = bandwidth_ceilings()
    for r in rows:
        if not r["dot_flops"]:
            r["bandwidth_ceiling"] = bandwidth_for(r["bytes"] / max(r["count"], 1), bws) if r["bytes"] else None
    floor_dots = sum(r["dot_flops"] for r in rows) / ceil["flops_per_s"]
    floor_rest = sum(r["bytes"] / r["bandwidth_ceiling"] for r in rows if not r["dot_flops"] and r["bytes"])
    cycles = perf_split(runner, steps) if perf else None
    return {"jax": jax.__version__, "batch": cfg.train.global_batch_size, "seq_len": cfg.train.seq_len,
            "micro_batch_size": runner.fit.micro_batch_size, "dtype": dtype, "attn": cfg.train.attn_impl, "steps": steps, "step_wall_s": wall,
            "executor_ms": exec_ms, "op_ms_total": total, "memory": mem, "ops": rows,
            "matmul_ceiling": ceil, "bandwidth_ceilings": bws,
            "floor_s": {"dots": floor_dots, "other": floor_rest}, "perf": cycles,
            "loadavg": os.getloadavg()[0]}


def format_profile(p: dict, top: int = 25) -> str:
    """The report of :func:`profile_step`: step wall time, compiled memory, the ceilings and the
    floor estimate, the CPU time by code (``perf``), then markdown tables of the ``top`` ops and
    the time by component, pass and kind."""
    rows, total, steps, ceil = p["ops"], p["op_ms_total"], p["steps"], p["matmul_ceiling"]
    out = [f"batch {p['batch']} x seq {p['seq_len']}, {p['dtype']}, attn={p['attn']}; jax {p['jax']}; "
           f"load {p['loadavg']:.1f}",
           f"step wall {p['step_wall_s']:.2f} s (median of {steps}; executor {p['executor_ms'] / 1e3:.2f} s); "
           f"per-op medians sum to {total / 1e3:.2f} s"]
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    out.append("compiled memory: " + ", ".join(f"{k.replace('_size_in_bytes', '')} {gib(v)}"
                                               for k, v in p["memory"].items()))
    ceil_g = ceil["flops_per_s"] / 1e9
    dots = [r for r in rows if r["dot_flops"]]
    dot_ms, dot_f = sum(r["ms"] for r in dots), sum(r["dot_flops"] for r in dots)
    if dot_ms:
        out.append(f"matmul ceiling ({ceil['size']}^3 {ceil['dtype']}, fp32 accumulation): {ceil_g:.1f} GFLOP/s; "
                   f"ops with dots: {dot_f / 1e9:.1f} GFLOP in {dot_ms:.0f} ms = {dot_f / dot_ms / 1e6:.1f} "
                   f"GFLOP/s ({100 * dot_f / dot_ms / 1e6 / ceil_g:.0f} % of the ceiling), "
                   f"{100 * dot_ms / total:.0f} % of the step")
    rest = [r for r in rows if not r["dot_flops"]]
    rest_ms, rest_b = sum(r["ms"] for r in rest), sum(r["bytes"] for r in rest)
    out.append("bandwidth ceilings (x = a*x + b in fp32, looped in one program; read + written): " +
               ", ".join(f"{c['mib']} MiB {c['bytes_per_s'] / 1e9:.1f} GB/s" for c in p["bandwidth_ceilings"]))
    floor_dots, floor_rest = p["floor_s"]["dots"], p["floor_s"]["other"]
    if rest_ms:
        out.append(f"the other ops: {rest_b / 1e9:.2f} GB read + written (HLO shapes) in {rest_ms:.0f} ms = "
                   f"{rest_b / rest_ms / 1e6:.1f} GB/s; at the ceiling of each op's size: {floor_rest:.2f} s")
    floor = floor_dots + floor_rest
    out.append(f"floor estimate (every op with dots at the matmul ceiling, every other op at its bandwidth "
               f"ceiling, nothing overlapping): {floor_dots:.2f} + {floor_rest:.2f} = "
               f"{floor:.2f} s per step; measured {total / 1e3:.2f} s"
               + (f" ({total / 1e3 / floor:.2f}x the floor)" if floor else ""))
    cycles = p["perf"]
    if cycles:
        out.append(f"\nCPU time by code, sampled by perf ({cycles['samples']} samples at {cycles['hz']} Hz "
                   f"over {steps} steps, {cycles['cpu_s_per_step']:.2f} CPU-s per step):\n"
                   "\n| code | % of CPU time | CPU-s per step |\n|---|---|---|")
        for k, v in cycles["share"].items():
            out.append(f"| {k} | {100 * v:.1f} | {v * cycles['cpu_s_per_step']:.2f} |")
        gemm_s = cycles["share"].get(GEMM_KERNELS, 0.0) * cycles["cpu_s_per_step"] / cycles["cores"]
        if gemm_s:
            out.append(f"GEMM micro-kernels: {gemm_s:.2f} s per step on {cycles['cores']} cores = "
                       f"{dot_f / gemm_s / 1e9:.1f} GFLOP/s ({100 * dot_f / gemm_s / 1e9 / ceil_g:.0f} % of "
                       f"the matmul ceiling, whose own run includes its packing)")
    out.append("\n| # | op | kind | shape | pass | source | ms | % | GFLOP/s or GB/s (% of its ceiling) |\n"
               "|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows[:top], 1):
        g, gb = r["gflops_per_s"], r["gbytes_per_s"]
        rate = (f"{g:.1f} GFLOP/s ({100 * g / ceil_g:.0f} %)" if g else
                f"{gb:.1f} GB/s ({100 * gb * 1e9 / r['bandwidth_ceiling']:.0f} %)" if gb else "-")
        out.append(f"| {i} | {r['op']} | {r['kind']} | {r['shape']} | {r['phase']} | {r['source']} | "
                   f"{r['ms']:.0f} | {100 * r['ms'] / total:.1f} | {rate} |")
    for key in ("component", "phase", "kind"):
        by: dict[str, float] = collections.defaultdict(float)
        for r in rows:
            by[r[key]] += r["ms"]
        out.append(f"\n| {key} | ms | % |\n|---|---|---|")
        out += [f"| {k} | {v:.0f} | {100 * v / total:.1f} |" for k, v in sorted(by.items(), key=lambda kv: -kv[1])]
    return "\n".join(out)
