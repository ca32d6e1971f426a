"""Where the trainer's CPU step spends its time and memory: per-op XLA profile of one step.

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
(result plus operands from the HLO shapes: :func:`op_bytes`) per second against the bandwidth
ceiling measured at its size (:func:`bandwidth_ceilings`: an element-wise op looped over 1 to
256 MiB). The sum of every op at its own ceiling is the step's *floor estimate*.

Ops that overlap share the wall time between them, so a GEMM running beside an element-wise op is
credited with half of that time and can show a rate above the ceiling. ``--perf`` measures the
other way round: Linux ``perf`` samples the CPU time of the same number of steps and splits it by
code (:func:`_code_class`: the GEMM library's micro-kernels, its packing, the code XLA generated,
the kernel's page faults); the GEMMs' rate then comes from their CPU time over the cores.

    python benchmarks/cpu_profile.py --shape A [--dtype bfloat16] [--steps 1] [--perf] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_side_by_side import apply_host_malloc  # noqa: E402
from shapes import SHAPES, run_config  # noqa: E402

from olmax.perf.hlo import dot_flops, op_bytes  # noqa: E402,F401

_CONTAINER = re.compile(r"^(while|conditional|call)(\.\d+)?$")
_WRAPPERS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "Await", "WhileThunk", "PjRt")


def parse_hlo(text: str) -> dict[str, dict]:
    """Instruction name -> {shape, kind, op_name, source} from a compiled module's text."""
    files = dict(re.findall(r'^(\d+) "([^"]*)"$', _section(text, "FileNames"), re.M))
    funcs = dict(re.findall(r'^(\d+) "([^"]*)"$', _section(text, "FunctionNames"), re.M))
    locs = {i: (f, fn, int(line)) for i, f, fn, line in re.findall(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", _section(text, "FileLocations"),
        re.M)}
    frames = {i: (loc, parent) for i, loc, parent in re.findall(
        r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", _section(text, "StackFrames"), re.M)}

    def source(frame_id: str | None) -> str:
        seen = set()
        while frame_id and frame_id in frames and frame_id not in seen:
            seen.add(frame_id)
            loc, parent = frames[frame_id]
            f, fn, line = locs[loc]
            path = files[f]
            if "/olmax/" in path or "/optax/" in path:
                short = path.split("/olmax/")[-1] if "/olmax/" in path else "optax/" + path.split("/optax/")[-1]
                return f"{short}:{line} {funcs[fn].split('.')[-1]}"
            frame_id = parent
        return "?"

    out = {}
    # A fusion XLA built itself (a reduction split in two, a weight cast) can carry no metadata; it
    # then takes that of the first instruction in its body that has some.
    comp, comp_meta, unnamed = None, {}, {}
    inst = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?(?:\{[^}]*\})?) ([\w\-]+)\(")
    for line in text.splitlines():
        c = _COMP.match(line)
        if c:
            comp = c.group(1)
            continue
        m = inst.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        if op_name and comp not in comp_meta:
            comp_meta[comp] = (op_name.group(1), frame.group(1) if frame else None)
        kind = opcode
        if opcode == "fusion":
            fk = re.search(r"kind=(\w+)", line)
            kind = "ynn_fusion" if "__ynn" in line else (fk.group(1) if fk else "fusion")
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if not op_name and called:
                unnamed[name] = called.group(1)
        out[name] = {"shape": shape, "kind": kind, "op_name": op_name.group(1) if op_name else "",
                     "source": source(frame.group(1) if frame else None)}
    for name, called in unnamed.items():
        if called in comp_meta:
            op_name, frame = comp_meta[called]
            out[name].update(op_name=op_name, source=source(frame))
    return out


_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")


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


def _section(text: str, name: str) -> str:
    m = re.search(rf"^{name}\n(.*?)(?:\n\n|\n[A-Z][A-Za-z]+\n|\Z)", text, re.S | re.M)
    return m.group(1) if m else ""


def phase(op_name: str) -> str:
    if "rematted_computation" in op_name:
        return "remat"
    if "transpose(jvp" in op_name:
        return "bwd"
    if "jvp(" in op_name:
        return "fwd"
    return "update" if op_name else "unattributed"


def component(source: str, op_name: str) -> str:
    """A coarse label from the source line (what the issue asks to separate)."""
    s = source
    if s.startswith("optax/") or "optim.py" in s:
        return "optimizer (clip, AdamW)"
    if "loss.py" in s or "logits_from_hidden" in s or "lm_head" in s or "lse_and_target" in s:
        return "LM head + loss"
    if "attention" in s:
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
    starts: dict[str, list] = collections.defaultdict(list)
    ends: dict[str, list] = collections.defaultdict(list)
    exec_ms = 0.0
    window = None
    for plane in ProfileData.from_file(path).planes:
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="A", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attn", default="chunked")
    p.add_argument("--steps", type=int, default=3,
                   help="profiled steps after one warm-up (per-op figures: the median over them)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--hlo", help="also write the compiled HLO text here")
    p.add_argument("--host-malloc", choices=("system", "keep"), default="system",
                   help="keep: large host blocks kept mapped between steps, as the olmax command "
                        "does with OLMAX_HOST_MALLOC=keep (olmax.host_memory); system: glibc's defaults")
    p.add_argument("--perf", action="store_true",
                   help="also sample the CPU time of --steps more steps with Linux perf (perf record "
                        "on this process) and split it by code: GEMM micro-kernels, the GEMM library's "
                        "packing, XLA-generated code, the kernel (page faults)")
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    apply_host_malloc(a.host_malloc)

    import jax

    from olmax.perf.bench import TrainStepRunner

    cfg = run_config(a.shape, a.dtype, a.attn)
    runner = TrainStepRunner(cfg)
    ma = runner.compiled.memory_analysis()
    mem = {k: int(getattr(ma, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                            "alias_size_in_bytes", "temp_size_in_bytes")}
    text = runner.compiled.as_text()
    if a.hlo:
        Path(a.hlo).write_text(text)
    hlo = parse_hlo(text)
    flops = dot_flops(text)
    nbytes = op_bytes(text)
    runner.run()
    per_step, walls, execs = [], [], []
    for _ in range(a.steps):       # one trace per step: per-op medians over steps resist load spikes
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
        info = hlo.get(name, {"shape": "?", "kind": "?", "op_name": "", "source": "?"})
        f = flops.get(name, 0.0) * count
        b = 0 if f else nbytes.get(name, 0) * count
        rows.append({"op": name, "ms": ms, "count": count, **info, "dot_flops": f,
                     "gflops_per_s": f / ms / 1e6 if f and ms else None, "bytes": b,
                     "gbytes_per_s": b / ms / 1e6 if b and ms else None,
                     "phase": phase(info["op_name"]), "component": component(info["source"], info["op_name"])})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    s = SHAPES[a.shape]
    print(f"shape {a.shape}: {s['label']}; batch {cfg.train.global_batch_size} x seq {cfg.train.seq_len}, "
          f"{a.dtype}, attn={a.attn}; jax {jax.__version__}; load {os.getloadavg()[0]:.1f}")
    print(f"step wall {wall:.2f} s (median of {a.steps}; executor {exec_ms / 1e3:.2f} s); per-op "
          f"medians sum to {total / 1e3:.2f} s")
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    print("compiled memory: " + ", ".join(f"{k.replace('_size_in_bytes', '')} {gib(v)}" for k, v in mem.items()))
    from olmax.perf.bench import matmul_ceiling

    ceil = matmul_ceiling(1024, a.dtype)
    ceil_g = ceil["flops_per_s"] / 1e9
    dots = [r for r in rows if r["dot_flops"]]
    dot_ms, dot_f = sum(r["ms"] for r in dots), sum(r["dot_flops"] for r in dots)
    print(f"matmul ceiling (1024^3 {a.dtype}, fp32 accumulation, best of 10): {ceil_g:.1f} GFLOP/s; ops "
          f"with dots: {dot_f / 1e9:.1f} GFLOP in {dot_ms:.0f} ms = {dot_f / dot_ms / 1e6:.1f} GFLOP/s "
          f"({100 * dot_f / dot_ms / 1e6 / ceil_g:.0f} % of the ceiling), {100 * dot_ms / total:.0f} % of the step")
    bws = bandwidth_ceilings()
    rest = [r for r in rows if not r["dot_flops"]]
    rest_ms, rest_b = sum(r["ms"] for r in rest), sum(r["bytes"] for r in rest)
    for r in rest:
        r["bandwidth_ceiling"] = bandwidth_for(r["bytes"] / max(r["count"], 1), bws) if r["bytes"] else None
    print("bandwidth ceilings (x = a*x + b in fp32, looped in one program; read + written): " +
          ", ".join(f"{c['mib']} MiB {c['bytes_per_s'] / 1e9:.1f} GB/s" for c in bws))
    floor_dots = dot_f / ceil["flops_per_s"]
    floor_rest = sum(r["bytes"] / r["bandwidth_ceiling"] for r in rest if r["bytes"])
    print(f"the other ops: {rest_b / 1e9:.2f} GB read + written (HLO shapes) in {rest_ms:.0f} ms = "
          f"{rest_b / rest_ms / 1e6:.1f} GB/s; at the ceiling of each op's size: {floor_rest:.2f} s")
    print(f"floor estimate (every op with dots at the matmul ceiling, every other op at its bandwidth "
          f"ceiling, nothing overlapping): {floor_dots:.2f} + {floor_rest:.2f} = "
          f"{floor_dots + floor_rest:.2f} s per step; measured {total / 1e3:.2f} s "
          f"({total / 1e3 / (floor_dots + floor_rest):.2f}x the floor)")
    cycles = perf_split(runner, a.steps) if a.perf else None
    if cycles:
        print(f"\nCPU time by code, sampled by perf ({cycles['samples']} samples at {cycles['hz']} Hz "
              f"over {a.steps} steps, {cycles['cpu_s_per_step']:.2f} CPU-s per step):\n"
              "\n| code | % of CPU time | CPU-s per step |\n|---|---|---|")
        for k, v in cycles["share"].items():
            print(f"| {k} | {100 * v:.1f} | {v * cycles['cpu_s_per_step']:.2f} |")
        gemm_s = cycles["share"].get(GEMM_KERNELS, 0.0) * cycles["cpu_s_per_step"] / cycles["cores"]
        if gemm_s:
            print(f"GEMM micro-kernels: {gemm_s:.2f} s per step on {cycles['cores']} cores = "
                  f"{dot_f / gemm_s / 1e9:.1f} GFLOP/s ({100 * dot_f / gemm_s / 1e9 / ceil_g:.0f} % of the "
                  f"matmul ceiling, whose own run includes its packing)")
    print("\n| # | op | kind | shape | pass | source | ms | % | GFLOP/s or GB/s (% of its ceiling) |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows[:a.top], 1):
        g, gb = r["gflops_per_s"], r["gbytes_per_s"]
        rate = (f"{g:.1f} GFLOP/s ({100 * g / ceil_g:.0f} %)" if g else
                f"{gb:.1f} GB/s ({100 * gb * 1e9 / r['bandwidth_ceiling']:.0f} %)" if gb else "-")
        print(f"| {i} | {r['op']} | {r['kind']} | {r['shape']} | {r['phase']} | {r['source']} | "
              f"{r['ms']:.0f} | {100 * r['ms'] / total:.1f} | {rate} |")
    for key in ("component", "phase", "kind"):
        by: dict[str, float] = collections.defaultdict(float)
        for r in rows:
            by[r[key]] += r["ms"]
        print(f"\n| {key} | ms | % |\n|---|---|---|")
        for k, v in sorted(by.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v:.0f} | {100 * v / total:.1f} |")
    if a.json_out:
        from cpu_side_by_side import write_json

        write_json(a.json_out, {"args": vars(a), "jax": jax.__version__, "step_wall_s": wall,
                                "op_ms_total": total, "memory": mem, "ops": rows, "matmul_ceiling": ceil,
                                "bandwidth_ceilings": bws, "floor_s": {"dots": floor_dots, "other": floor_rest},
                                "perf": cycles,
                                "loadavg": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
