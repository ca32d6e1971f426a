"""The step time of a program compiled for a GPU, or for a TPU whose rates were measured, estimated
kernel by kernel from its HLO and a table of measured rates (:mod:`olmax.perf.gpu_rates`). XLA's
GPU latency estimator is not used: it prices cuDNN's attention custom calls at almost nothing.

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

On a TPU (:func:`tpu_kernels`) the same holds with its own program's forms: the matmuls are
``convolution`` ops (alone or in fusions), the attention kernels olmax's splash (priced at the
FLOPs they execute over the table's measured splash rate for their pass and head dimension), and
an asynchronous copy (``copy-start``, ``slice-start``: DMAs the schedule runs beside the compute)
is listed but not added. The TPU runs one op at a time too, so the compute is their sum. Checked
against every step measured on a v5e chip (``benchmarks/calibration/olmax_*_v5e_1x1*.yaml``).

Rates come from the table that the accelerator's row of :mod:`olmax.hardware` names (``rates``:
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
from typing import Any, Sequence, TypeVar

from olmax.perf import hlo

_N = TypeVar("_N", int, float)

_FMHA_FWD = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleMaskSoftmax",
             "__cudnn$fmhaSoftmaxDropout")
_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


TPU_METHOD = ("estimate: every op of the compiled step priced from a table of rates measured on the "
              "chip (olmax bench matmul --table): matmuls (convolutions) at their FLOPs over the "
              "measured GEMM rate at their shape (at most their form's rate inside profiled steps, "
              "at the step's tokens per micro-batch), splash attention at its executed FLOPs over the "
              "measured rate of its pass and head dimension, other ops at their bytes over the "
              "measured HBM rate, each at least the per-op floor; asynchronous copies run beside "
              "them; compute = their sum")
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
        if table.get("platform") == "tpu" and self._gemm:
            self._undispatch(table)
        self._axes = [sorted({key[i] for key in self._gemm}) for i in range(3)]
        self._attn = [r for r in table.get("attention", []) if "error" not in r]
        # {form: FLOP/s} per profiled step by its tokens per micro-batch (a table of one profile,
        # written before the steps' sizes were kept, has its rates for steps of any size)
        in_step = table.get("gemm_in_step") or {}
        self._in_step: dict[float, dict[str, float]] = {
            float(p["rows"]): p["flops_per_s"] for p in in_step.get("by_rows", [])}
        self._in_step_any: dict[str, float] = in_step.get("flops_per_s", {})

    def _undispatch(self, table: dict) -> None:
        """A TPU runs a step as one program, with no dispatch between its ops: a grid product that
        took less than 1.5 calls of a tiny program (``kernel.one_call_s``) timed the host's
        dispatch, not the chip. It takes the rate of the same widths at the next larger row count
        that was not so bound (v5e: 4096 x 768 x 768 ran in 118 us, 41 TFLOP/s; with 32,768 rows
        185)."""
        floor = 1.5 * table.get("kernel", {}).get("one_call_s", 0.0)
        bound = {(r["m"], r["n"], r["k"]) for r in table["gemm"]
                 if r.get("dispatch_bound") or r["seconds"] < floor}
        for m, n, k in bound:
            larger = sorted(x for x, nn, kk in self._gemm if (nn, kk) == (n, k) and x > m
                            and (x, nn, kk) not in bound)
            if larger:
                self._gemm[(m, n, k)] = self._gemm[(larger[0], n, k)]

    def gemm_in_step(self, m: float, n: float, k: float, form: str | None,
                     rows: float | None = None) -> float:
        """FLOP/s of a product inside a step: the grid's rate at its shape, or where the table
        holds the rate measured for the product's form inside profiled steps (``gemm_in_step``:
        a weight gradient, the product with a transposed weight, a forward product), the lower.

        The table holds those rates per profiled step, by the step's tokens per micro-batch and
        device (``by_rows``): read at ``rows`` (the priced step's, :func:`step_rows`; where it is
        unknown, the product's own rows: its contracted dimension for a weight gradient, its
        output's rows otherwise), log-linearly in log2 of the rows between the profiled steps,
        clamped at the smallest and the largest."""
        rate = self.gemm(m, n, k)
        if form is None:
            return rate
        if form in self._in_step_any:
            return min(rate, self._in_step_any[form])
        by = {r: fps[form] for r, fps in self._in_step.items() if form in fps}
        if not by:
            return rate
        if rows is None:
            rows = k if form == "weight_grad" else m
        lo, hi, w = _bracket(sorted(by), rows)
        return min(rate, math.exp(w * math.log(by[lo]) + (1 - w) * math.log(by[hi])))

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


def _bracket(axis: Sequence[_N], x: float) -> tuple[_N, _N, float]:
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
    """The rates to price a GPU or TPU with (an :class:`olmax.hardware.Accelerator`), or None. A
    TPU is priced only by a table measured on its own generation."""
    if acc is None or acc.rates is None:
        return None
    name = acc.rates
    table = shipped_tables().get(name)
    if table is None:
        return None
    if name == acc.name:
        return Rates(table)
    if acc.platform != "gpu":
        return None
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


def _kernel_ops(text: str) -> tuple[hlo.Program, list[tuple[dict, hlo.Instruction]]]:
    """The program and its device ops (:func:`olmax.perf.hlo.device_ops`' rows) with their
    instructions; an asynchronous pair is one kernel, priced at its start."""
    prog = hlo.analyse(text)
    by_name = {ins.name: ins for instrs in prog.computations.values() for ins in instrs}
    return prog, [(row, by_name[row["name"]]) for row in hlo.device_ops(text, prog)
                  if not by_name[row["name"]].opcode.endswith("-done")]


def kernels(text: str, rates: Rates) -> list[dict]:
    """Every kernel of the program with its executions, class (gemm, attention, memory), FLOPs,
    bytes and estimated seconds (all executions)."""
    prog, ops = _kernel_ops(text)
    comps = prog.computations
    shapes = {ins.name: ins.shape for instrs in comps.values() for ins in instrs}
    out = []
    for row, ins in ops:
        nbytes = row["bytes"] / row["mult"]
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
        out.append(_priced(row, kind, flops, seconds, rates))
    return out


def _priced(row: dict, kind: str, flops: float, seconds: float, rates: Rates) -> dict:
    """One kernel's row of :func:`kernels` / :func:`tpu_kernels` (``flops`` and ``seconds`` per
    execution): a ``memory`` kernel at its bytes over the HBM rate (a reduction's for input
    fusions), every kernel at least the per-kernel floor, the totals over its executions."""
    mult = row["mult"]
    if kind == "memory":
        seconds = row["bytes"] / mult / (rates.bw_reduce if "kInput" in row["kind"] else rates.bw_elementwise)
    seconds = max(seconds, rates.kernel_s)
    return {"name": row["name"], "kind": kind, "op": row["kind"], "mult": mult, "flops": flops * mult,
            "bytes": row["bytes"], "seconds": seconds * mult, "line": row["line"], "pass": row["pass"]}


def _splash(ins) -> tuple[str, float, int, int, bool] | None:
    """(pass, FLOPs executed, sequence, head dim, windowed) of one call of olmax's splash kernels
    (:func:`olmax.perf.costs.splash_call`); the backward's kernels (dq, dkv, or the fused dkv) are
    pass ``bwd``."""
    from olmax.perf.costs import splash_call

    call = splash_call(ins)
    if call is None:
        return None
    p, shape, flops = call
    seq = shape["t"] * shape.get("context", 1)
    windowed = shape["window"] is not None and shape["window"] < seq
    return ("fwd" if p == "fwd" else "bwd"), flops, seq, shape["head_dim"], windowed


# the equation of the product, as JAX names it: ``.../ni,no->io/dot_general``, or inside the
# transforms that made it, ``.../transpose(jvp(...i,...o->io))/dot_general`` (a backward product
# in a loop body, as the per-layer accumulation's step writes them)
_EQUATION = re.compile(r"([\w.]+),([\w.]+)->([\w.]*)\)*/dot_general")


def gemm_form(op_name: str) -> str | None:
    """The form of a matrix product from the einsum equation JAX names it by (``...i,io->...o``):
    ``weight_grad`` where it contracts the rows (a letter or ``...`` of both operands that the
    output lacks, the first operand's leading one: ``...i,...o->io``, ``ni,no->io``),
    ``input_grad`` where it contracts the second operand's last letter (the transposed weight:
    ``...o,io->...i``, ``nv,dv->nd``), ``forward`` otherwise (``...i,io->...o``); None where the
    name holds no equation."""
    m = _EQUATION.search(op_name or "")
    if not m:
        return None
    split = lambda spec: ["..."] + list(spec[3:]) if spec.startswith("...") else list(spec)  # noqa: E731
    lhs, rhs, out = (split(x) for x in m.groups())
    contracted = (set(lhs) & set(rhs)) - set(out)
    if lhs and lhs[0] in contracted:
        return "weight_grad"
    if rhs and rhs[-1] in contracted:
        return "input_grad"
    return "forward"


def _conv_gemm(ins, flops: float) -> tuple[float, float, float]:
    """(m, n, k) of a TPU matmul written as a ``convolution``: k its contracted products, n its
    output's minor dimension, m the rest (the table's grid is read at that shape)."""
    dims = _dims(ins.shape)
    n = float(dims[-1]) if dims else 1.0
    out = float(math.prod(dims)) if dims else 1.0
    k = flops / (2.0 * out) if out else 1.0
    return out / n, n, max(k, 1.0)


# A TPU program's asynchronous copies (started, then waited for by a ``-done``)
_TPU_ASYNC = ("copy-start", "slice-start", "dynamic-slice-start", "dynamic-update-slice-start")


def step_rows(prog: hlo.Program) -> int | None:
    """Tokens per micro-batch and device of a compiled training step: those of its splash
    attention calls (batch x sequence of each call; the largest), None where it has none."""
    from olmax.perf.costs import splash_call

    calls = [call for ins, _ in hlo.custom_calls(prog, "tpu_custom_call") if (call := splash_call(ins))]
    return max(shape["batch"] * shape["t"] for _, shape, _ in calls) if calls else None


def tpu_kernels(text: str, rates: Rates) -> list[dict]:
    """:func:`kernels` of a program compiled for a TPU: its matmuls are ``convolution`` ops (alone
    or inside fusions), each priced at its FLOPs over the table's rate at its shape (bounded by
    its form's in-step rate at the step's tokens per micro-batch, :meth:`Rates.gemm_in_step`) and
    never faster than its bytes; olmax's splash kernels at their executed FLOPs over the table's
    rate for their pass and head dimension; every other op at its bytes over the measured
    bandwidth (a reduction's for input fusions); each at least the per-op floor."""
    prog, ops = _kernel_ops(text)
    dots = hlo.dot_flops(text)
    rows = step_rows(prog)
    comps = prog.computations
    out = []
    for row, ins in ops:
        mult = row["mult"]
        nbytes = row["bytes"] / mult
        kind, flops, seconds = "memory", 0.0, 0.0
        attn = _splash(ins)
        if attn:
            pas, flops, seq, hd, windowed = attn
            kind, seconds = "attention", flops / rates.attention(pas, seq, hd, windowed)
        elif ins.opcode in _TPU_ASYNC:
            # a DMA the schedule starts ahead and waits for later (prefetches into VMEM, layout
            # copies): it runs beside the compute, so it is listed, not added to the step
            kind, seconds = "async", row["written"] / mult / rates.bw_elementwise
        elif dots.get(ins.name):
            kind, flops = "gemm", dots[ins.name]
            conv = ins if ins.opcode == "convolution" else next(
                (c for name in hlo.called_computations(ins).get("calls", [])
                 for c in comps.get(name, []) if c.opcode == "convolution"), ins)
            m, n, k = _conv_gemm(conv, dots.get(conv.name) or dots[ins.name])
            names = hlo.op_names(conv)
            rate = rates.gemm_in_step(m, n, k, gemm_form(names[0] if names else ""), rows)
            seconds = max(flops / rate, nbytes / rates.bw_elementwise)
        out.append(_priced(row, kind, flops, seconds, rates))
    return out


def estimate(text: str, rates: Rates, platform: str = "gpu") -> dict:
    """The compute time of the program (the sum of its kernels) and its split by class."""
    rows = (tpu_kernels if platform == "tpu" else kernels)(text, rates)
    serial = [r for r in rows if r["kind"] != "async"]
    by: dict[str, dict[str, float]] = defaultdict(lambda: {"seconds": 0.0, "flops": 0.0,
                                                           "bytes": 0.0, "kernels": 0.0})
    for r in rows:
        acc = by[r["kind"]]
        acc["seconds"] += r["seconds"]
        acc["flops"] += r["flops"]
        acc["bytes"] += r["bytes"]
        acc["kernels"] += r["mult"]
    result: dict[str, Any] = {"compute_s": sum(r["seconds"] for r in serial),
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
