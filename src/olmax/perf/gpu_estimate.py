"""The step time of a program compiled for a GPU, estimated kernel by kernel from its HLO and a
table of measured rates (:mod:`olmax.perf.gpu_rates`). XLA's GPU latency estimator is not used:
it prices cuDNN's attention custom calls at almost nothing.

Every device op of the compiled step (each loop body's ops times the loop's trip count) is one
kernel, priced by what bounds it:

- a matrix product (cuBLAS ``__cublas$gemm`` / ``__cublas$lt$matmul`` custom calls, Triton GEMM
  fusions, any fusion around a ``dot``): its FLOPs (2 x batch x m x n x k) over the measured GEMM
  rate at its shape -- interpolated log-linearly in log2 of m (batch folded in), n and k on the
  measured grid, clamped at the grid's edges -- and never faster than its bytes at the HBM rate;
- cuDNN's fused attention (``__cudnn$fmha*``): the window-aware FLOPs (the (query, key) pairs the
  causal or sliding-window mask keeps: 4 x pairs x head_dim per head forward, 6 x backward) over
  the measured rate for that pass, head dimension and masking, interpolated over log2 of the
  sequence length;
- every other kernel (XLA's loop and input fusions, copies, updates in place): its bytes read and
  written over the measured bandwidth of an elementwise kernel (a reduction's, for input fusions);
- each kernel at least the measured per-kernel floor.

The GPU runs the kernels of one program one after another on one stream (XLA replays them as
CUDA graphs), so the compute time is their sum; collectives are timed by
:mod:`olmax.perf.network` and combined with it as on TPU (:func:`olmax.perf.network.overlap`).

Rates come from the table that the GPU's row of :mod:`olmax.hardware` names (``gpu_rates``:
``src/olmax/perf/gpu_tables/NAME.json``, written by ``olmax bench matmul --table`` on that GPU).
A GPU without a table of its own is priced from the table of a GPU with the same tensor cores, with its memory-bound rates scaled by the HBM bandwidth
of the hardware table (:mod:`olmax.hardware`: an H100 from the H200's table: the same SMs and
clocks, 3.35 against 4.8 TB/s); ``rates_source`` says which.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections import defaultdict
from importlib import resources
from typing import Any

from olmax.perf import hlo

_FMHA_FWD = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleMaskSoftmax",
             "__cudnn$fmhaSoftmaxDropout")
_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


METHOD = ("estimate: every kernel of the compiled step priced from a table of rates measured on the "
          "GPU (olmax bench matmul --table): matrix products at their FLOPs over the GEMM rate at "
          "their shape, cuDNN attention at its window-aware FLOPs over the measured rate of its pass, "
          "head dimension and sequence, other kernels at their bytes over the measured HBM rate, each "
          "at least the per-kernel floor; compute = their sum (one stream)")


class Rates:
    """A measured rates table (the JSON that :func:`olmax.perf.gpu_rates.measure` returns), with
    the memory-bound rates scaled by ``bandwidth_scale``."""

    def __init__(self, table: dict, bandwidth_scale: float = 1.0, source: str = ""):
        self.table = table
        self.source = source or f"measured on {table.get('device_kind')} ({table.get('date')})"
        self.bw_elementwise = table["hbm"]["elementwise_bytes_per_s"] * bandwidth_scale
        self.bw_reduce = table["hbm"]["reduce_bytes_per_s"] * bandwidth_scale
        self.kernel_s = table["kernel"]["per_kernel_s"]
        self._gemm: dict[tuple[int, int, int], float] = {
            (r["m"], r["n"], r["k"]): r["flops_per_s"] for r in table.get("gemm", [])}
        self._axes = [sorted({key[i] for key in self._gemm}) for i in range(3)]
        self._attn = [r for r in table.get("attention", []) if "error" not in r]

    def gemm(self, m: float, n: float, k: float) -> float:
        """FLOP/s of an ``m x k @ k x n`` product: trilinear in log2 sizes over the grid."""
        if not self._gemm:
            raise ValueError("the rates table has no GEMM rates")
        (i0, i1, wi), (j0, j1, wj), (l0, l1, wl) = (_bracket(axis, x) for axis, x in
                                                    zip(self._axes, (m, n, k)))
        total = 0.0
        for a, wa in ((i0, wi), (i1, 1 - wi)):
            for b, wb in ((j0, wj), (j1, 1 - wj)):
                for c, wc in ((l0, wl), (l1, 1 - wl)):
                    if wa * wb * wc:
                        total += wa * wb * wc * math.log(self._gemm[(a, b, c)])
        return math.exp(total)

    def attention(self, pas: str, seq: int, head_dim: int, windowed: bool) -> float:
        """FLOP/s of cuDNN's attention pass (``fwd`` or ``bwd``): the measured cases of the
        nearest head dimension and the same masking (a sliding window shorter than the sequence, or
        not: the table's windowed cases have OLMo 3's 4096), log-linear in log2 of the sequence."""
        if not self._attn:
            raise ValueError("the rates table has no attention rates")
        hd = min({r["head_dim"] for r in self._attn}, key=lambda d: abs(math.log2(d / head_dim)))
        rows = [r for r in self._attn if r["head_dim"] == hd and
                (r["window"] is not None and r["window"] < r["seq"]) == windowed]
        rows = rows or [r for r in self._attn if r["head_dim"] == hd]
        by_seq = {r["seq"]: r[f"{pas}_flops_per_s"] for r in rows}
        lo, hi, w = _bracket(sorted(by_seq), seq)
        return math.exp(w * math.log(by_seq[lo]) + (1 - w) * math.log(by_seq[hi]))


def _bracket(axis: list[int], x: float) -> tuple[int, int, float]:
    """(lower grid point, upper grid point, weight of the lower) for ``x`` in log2, clamped."""
    if x <= axis[0]:
        return axis[0], axis[0], 1.0
    if x >= axis[-1]:
        return axis[-1], axis[-1], 1.0
    i = bisect.bisect_right(axis, x)
    lo, hi = axis[i - 1], axis[i]
    if lo == x:
        return lo, lo, 1.0
    w = (math.log2(hi) - math.log2(x)) / (math.log2(hi) - math.log2(lo))
    return lo, hi, w


def shipped_tables() -> dict[str, dict]:
    """The rates tables in the package, by file stem."""
    out = {}
    for f in resources.files("olmax.perf").joinpath("gpu_tables").iterdir():
        if f.name.endswith(".json"):
            out[f.name[:-5]] = json.loads(f.read_text())
    return out


def rates_for(acc) -> Rates | None:
    """The rates to price a GPU with (an :class:`olmax.hardware.Accelerator`), or None."""
    if acc is None or acc.platform != "gpu" or acc.gpu_rates is None:
        return None
    name = acc.gpu_rates
    table = shipped_tables().get(name)
    if table is None:
        return None
    if name == acc.name:
        return Rates(table)
    from olmax.hardware import BY_NAME

    measured = BY_NAME[name]
    if not (acc.hbm_bw and measured.hbm_bw):
        return None
    scale = acc.hbm_bw / measured.hbm_bw
    return Rates(table, scale, f"{name}'s table ({table.get('device_kind')}, {table.get('date')}), "
                               f"memory-bound rates x {scale:.3f} ({acc.name}/{name} HBM bandwidth)")


# -- the program's kernels -----------------------------------------------------------------------

_DIMS_RE = re.compile(r"^\w+\[([0-9,]*)\]")


def _dims(shape: str) -> list[int]:
    m = _DIMS_RE.match(shape.strip().lstrip("("))
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _attr_dims(text: str, key: str) -> list[int]:
    """``lhs_contracting_dims={1,2}`` (HLO) or ``"lhs_contracting_dimensions":["1"]`` (JSON)."""
    m = re.search(key + r"_dims=\{([0-9,]*)\}", text)
    if m:
        return [int(d) for d in m.group(1).split(",") if d]
    m = re.search('"' + key + r'_dimensions":\[([^\]]*)\]', text)
    return [int(d.strip('"')) for d in m.group(1).split(",") if d.strip('"')] if m else []


def gemm_shape(lhs: list[int], rhs: list[int], text: str) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a dot from its operands' dimensions and its dimension numbers."""
    lb, lc = _attr_dims(text, "lhs_batch"), _attr_dims(text, "lhs_contracting")
    rb, rc = _attr_dims(text, "rhs_batch"), _attr_dims(text, "rhs_contracting")
    prod = lambda ds, idx: math.prod(ds[i] for i in idx)  # noqa: E731
    b = prod(lhs, lb)
    k = prod(lhs, lc)
    m = prod(lhs, [i for i in range(len(lhs)) if i not in lb and i not in lc])
    n = prod(rhs, [i for i in range(len(rhs)) if i not in rb and i not in rc])
    return b, m, n, k


def _operand_dims(ins, shapes: dict[str, str]) -> list[list[int]]:
    out = []
    for a in hlo._split_top(hlo._args_text(ins)):
        inline = _DIMS_RE.match(a.strip())
        out.append(_dims(a) if inline else _dims(shapes.get(a.split()[-1].lstrip("%"), "")))
    return out


def _dots_in(comp: str, comps: dict, depth: int = 0) -> list[tuple[int, int, int, int]]:
    """The dots a fusion's computation runs (nested fusions included)."""
    if depth > 8:
        return []
    shapes = {i.name: i.shape for i in comps.get(comp, [])}
    out = []
    for ins in comps.get(comp, []):
        if ins.opcode == "dot":
            lhs, rhs = (_operand_dims(ins, shapes) + [[], []])[:2]
            out.append(gemm_shape(lhs, rhs, ins.text))
        elif ins.opcode == "fusion":
            for c in hlo.called_computations(ins).get("calls", []):
                out += _dots_in(c, comps, depth + 1)
    return out


_INTERMEDIATE = re.compile(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*'
                           r'\[\s*"(\d+)",\s*"(\d+)",\s*"(\d+)",\s*"(\d+)"\s*\]')


def _attention(ins) -> tuple[str, float, int, int, bool] | None:
    """(pass, FLOPs, sequence, head dim, windowed) of a cuDNN attention custom call."""
    target = re.search(r'custom_call_target="([^"]+)"', ins.text)
    if not target or not target.group(1).startswith("__cudnn$fmha"):
        return None
    from olmax.model.flops import causal_attention_pairs
    from olmax.perf.gpu_rates import ATTENTION_BWD_FLOPS, ATTENTION_FWD_FLOPS

    # the backend config's JSON, printed compact or with spaces (and other keys first) by XLA versions
    inter = _INTERMEDIATE.search(ins.text)
    out = _dims(ins.shape)
    if not inter or not out:
        return None
    b, h, t, s = (int(x) for x in inter.groups())
    head_dim = out[-1]
    window = re.search(r'"sliding_window_length":\s*(\d+)', ins.text)
    w = int(window.group(1)) if window and int(window.group(1)) > 0 else None
    causal = re.search(r'"mask_type":\s*"(PADDING_)?CAUSAL"', ins.text) is not None
    pairs = causal_attention_pairs(t, w) if causal else t * s
    bwd = "Backward" in target.group(1)
    flops = (ATTENTION_BWD_FLOPS if bwd else ATTENTION_FWD_FLOPS) * b * h * pairs * head_dim
    return ("bwd" if bwd else "fwd"), flops, t, head_dim, w is not None and w < t


def kernels(text: str, rates: Rates) -> list[dict]:
    """Every kernel of the program with its executions, class (gemm, attention, memory), FLOPs,
    bytes and estimated seconds (all executions)."""
    prog = hlo.analyse(text)
    comps = prog.computations
    by_name = {ins.name: ins for instrs in comps.values() for ins in instrs}
    shapes = {ins.name: ins.shape for ins in by_name.values()}
    out = []
    for row in hlo.device_ops(text, prog):
        ins = by_name[row["name"]]
        if ins.opcode.endswith("-done"):     # an async pair is one kernel: priced at its start
            continue
        mult = row["mult"]
        nbytes = row["bytes"] / mult
        kind, flops, seconds = "memory", 0.0, 0.0
        attn = _attention(ins) if ins.opcode == "custom-call" else None
        if attn:
            pas, flops, seq, hd, windowed = attn
            kind, seconds = "attention", flops / rates.attention(pas, seq, hd, windowed)
        else:
            dots: list[tuple[int, int, int, int]] = []
            if ins.opcode == "custom-call" and any(f'"{t}"' in ins.text for t in _GEMM_CALLS):
                lhs, rhs = (_operand_dims(ins, shapes) + [[], []])[:2]
                dots = [gemm_shape(lhs, rhs, ins.text)]
            elif ins.opcode == "fusion":
                for c in hlo.called_computations(ins).get("calls", []):
                    dots += _dots_in(c, comps)
            if dots:
                kind = "gemm"
                for b, m, n, k in dots:
                    f = 2.0 * b * m * n * k
                    flops += f
                    seconds += f / rates.gemm(b * m, n, k)
                seconds = max(seconds, nbytes / rates.bw_elementwise)
            else:
                bw = rates.bw_reduce if "kInput" in row["kind"] else rates.bw_elementwise
                seconds = nbytes / bw
        seconds = max(seconds, rates.kernel_s)
        out.append({"name": row["name"], "kind": kind, "op": row["kind"], "mult": mult,
                    "flops": flops * mult, "bytes": row["bytes"], "seconds": seconds * mult,
                    "line": row["line"], "pass": row["pass"]})
    return out


def estimate(text: str, rates: Rates) -> dict:
    """The compute time of the program (the sum of its kernels) and its split by class."""
    rows = kernels(text, rates)
    by: dict[str, dict[str, float]] = defaultdict(lambda: {"seconds": 0.0, "flops": 0.0,
                                                           "bytes": 0.0, "kernels": 0.0})
    for r in rows:
        acc = by[r["kind"]]
        acc["seconds"] += r["seconds"]
        acc["flops"] += r["flops"]
        acc["bytes"] += r["bytes"]
        acc["kernels"] += r["mult"]
    result: dict[str, Any] = {"compute_s": sum(r["seconds"] for r in rows),
                              "by_kind": {k: dict(v) for k, v in sorted(by.items())},
                              "kernels": int(sum(r["mult"] for r in rows)),
                              "rates_source": rates.source}
    return result


def kernel_class(name: str) -> str:
    """The kind (:func:`kernels`' ``kind``) of a GPU kernel from its name in a profile: cuBLAS's
    (``nvjet``, ``sm90_xmma``, CUTLASS) and XLA's Triton GEMM fusions are ``gemm``, cuDNN's fused
    attention ``attention``, everything else ``memory``."""
    low = name.lower()
    if "fmha" in low or "sdpa" in low or "flash" in low or low.startswith("cudnn"):
        return "attention"
    if low.startswith(("nvjet", "sm90_xmma", "gemm_fusion", "cutlass", "ampere_", "sm80_xmma")) or \
            "gemm" in low:
        return "gemm"
    return "memory"


def profile_by_kind(trace: dict, steps: int) -> dict[str, float]:
    """Seconds per step of GPU kernels by kind, from a Perfetto trace that JAX's profiler wrote
    (``jax.profiler.trace(..., create_perfetto_trace=True)``) over ``steps`` steps."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "/device:GPU" in str(e.get("args", {}).get("name"))}
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            out[kernel_class(e["name"])] += e["dur"] * 1e-6 / steps
    return dict(out)
