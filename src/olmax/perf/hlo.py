"""Reading a compiled XLA program (its optimized HLO text): how often each instruction runs, the
collectives by kind, and the Pallas kernels.

XLA's own summaries (``cost_analysis``) count the body of a ``while`` loop once, whatever its trip
count; a scanned layer stack or micro-batch loop is then undercounted by its length. Here every
computation gets a *multiplier*: the number of times it runs per execution of the program, i.e.
the product of the trip counts of the loops around it. A loop's trip count is read from its
condition computation (``compare(induction variable, constant N), direction=LT`` with the
induction variable starting at 0, which is how XLA emits ``scan``/``fori_loop`` loops); a loop whose
count cannot be read is counted once and reported. Where XLA recorded the count
(``backend_config`` ``known_trip_count``, e.g. on CPU) that is used.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
               "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
               "f8e4m3fn": 1, "f8e5m2": 1, "c64": 8, "c128": 16}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_SHAPE_RE = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) +
                       r")\[([0-9,]*)\]")
_OPCODE_RE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_CALLS_RE = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|called_computations)="
                       r"\{?([^,}\s]+(?:,\s*%[\w.\-]+)*)\}?")


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    shape: str        # the result shape text (before the opcode)
    text: str         # the whole instruction, continuation lines included
    computation: str


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a shape text (tuples summed; layouts ignored)."""
    total = 0.0
    for dtype, dims in _SHAPE_RE.findall(shape):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * DTYPE_BYTES[dtype]
    return int(total)


def parse(text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """Computations (name -> instructions) and the entry computation's name."""
    comps: dict[str, list[Instruction]] = {}
    entry = None
    current: list[Instruction] | None = None
    cname = ""
    for line in text.splitlines():
        if current is None or (line and not line.startswith(" ") and line.rstrip().endswith("{")):
            m = _COMP_RE.match(line)
            if m:
                cname = m.group(2)
                current = comps.setdefault(cname, [])
                if m.group(1):
                    entry = cname
            continue
        if line.rstrip() == "}":
            current = None
            continue
        m = _INSTR_RE.match(line)
        if m and line.startswith("  ") and not line.startswith("   "):
            rest = m.group(3)
            op = _OPCODE_RE.search(" " + rest)
            opcode = op.group(1) if op else ""
            shape = rest[:op.start()] if op else rest
            current.append(Instruction(m.group(2), opcode, shape, line, cname))
        elif current:
            current[-1].text += "\n" + line
    return comps, entry


def _called(instr: Instruction) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for kind, names in _CALLS_RE.findall(instr.text.split(", metadata=")[0]):
        out[kind] += [n.strip().lstrip("%") for n in names.split(",")]
    return out


def trip_count(condition: list[Instruction]) -> int | None:
    """N of a loop whose condition is ``i < N`` (constant N), else None."""
    consts = {}
    for ins in condition:
        m = re.search(r"constant\((-?\d+)\)", ins.text)
        if ins.opcode == "constant" and m:
            consts[ins.name] = int(m.group(1))
    for ins in condition:
        if ins.opcode == "compare" and "direction=LT" in ins.text:
            args = re.search(r"compare\(([^)]*)\)", ins.text)
            names = [a.strip().split()[-1].lstrip("%") for a in args.group(1).split(",")] if args else []
            if len(names) == 2 and names[1] in consts:
                return consts[names[1]]
    return None


@dataclasses.dataclass
class Program:
    computations: dict[str, list[Instruction]]
    entry: str
    multiplier: dict[str, float]          # computation -> executions per program run
    unknown_loops: int                     # loops whose trip count could not be read

    def instructions(self):
        """(instruction, multiplier) over every computation that runs."""
        for cname, instrs in self.computations.items():
            mult = self.multiplier.get(cname, 0)
            if mult:
                for ins in instrs:
                    yield ins, mult


def analyse(text: str) -> Program:
    comps, entry = parse(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    mult: dict[str, float] = defaultdict(float)
    unknown = 0

    def visit(cname: str, m: float, depth: int = 0) -> None:
        nonlocal unknown
        if depth > 64 or cname not in comps:
            return
        mult[cname] += m
        for ins in comps[cname]:
            called = _called(ins)
            if not called:
                continue
            if ins.opcode == "while":
                known = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.text)
                n = int(known.group(1)) if known else None
                for c in called.get("condition", []) if n is None else ():
                    n = trip_count(comps.get(c, []))
                if n is None:
                    unknown += 1
                    n = 1
                for c in called.get("body", []):
                    visit(c, m * n, depth + 1)
                for c in called.get("condition", []):
                    visit(c, m * (n + 1), depth + 1)
            else:
                for kind, names in called.items():
                    for c in names:
                        visit(c, m, depth + 1)

    visit(entry, 1.0)
    return Program(comps, entry, dict(mult), unknown)


def collective_kind(ins: Instruction) -> str | None:
    """The collective an instruction performs (its ``-start`` half for async pairs), else None.
    TPU programs also run collectives inside other computations -- fusions started by
    ``AsyncCollectiveStart`` custom calls, or (tpu7x) SparseCore ``custom-call-start`` ops with
    ``called_computations`` -- which are counted through the collective inside them."""
    op = ins.opcode
    if op.endswith("-done"):
        return None
    base = op[:-6] if op.endswith("-start") else op
    return base if base in COLLECTIVES else None


def collective_bytes(ins: Instruction, kind: str) -> int:
    """Bytes one execution moves per device: the gathered result of an all-gather, the input of a
    reduce-scatter, the buffer of an all-reduce / permute / all-to-all. An async ``-start`` returns
    a tuple (input, output, context scalars): there the largest buffer is the one that counts,
    except for all-reduce, whose (possibly combined) operands are all reduced."""
    if not ins.opcode.endswith("-start") or kind == "all-reduce":
        return shape_bytes(ins.shape)
    return max((shape_bytes(f"{d}[{dims}]") for d, dims in _SHAPE_RE.findall(ins.shape)), default=0)


def collectives(prog: Program) -> list[dict]:
    """Per kind: executions per program run and bytes moved (result size of each execution)."""
    count: dict[str, float] = defaultdict(float)
    size: dict[str, float] = defaultdict(float)
    for ins, m in prog.instructions():
        kind = collective_kind(ins)
        if kind:
            count[kind] += m
            size[kind] += m * collective_bytes(ins, kind)
    return [{"kind": k, "count": int(round(count[k])), "bytes": int(round(size[k]))}
            for k in COLLECTIVES if count.get(k)]


def op_names(ins: Instruction) -> list[str]:
    return re.findall(r'op_name="([^"]*)"', ins.text)


def custom_calls(prog: Program, target: str) -> list[tuple[Instruction, float]]:
    return [(ins, m) for ins, m in prog.instructions()
            if ins.opcode == "custom-call" and f'custom_call_target="{target}"' in ins.text]
