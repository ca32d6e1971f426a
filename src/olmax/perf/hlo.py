"""Reading a compiled XLA program (its optimized HLO text): how often each instruction runs, the
collectives by kind, the Pallas kernels, the FLOPs of its dots, the bytes each device op moves and
the source lines (stack frames) its instructions come from. The one HLO reader of olmax: ``olmax
plan``, ``olmax bench profile`` and ``benchmarks/tpu_hlo_bytes.py`` read programs through it.

XLA's own summaries (``cost_analysis``) count the body of a ``while`` loop once, whatever its trip
count; a scanned layer stack or micro-batch loop is then undercounted by its length. Here every
computation gets a *multiplier*: the number of times it runs per execution of the program, i.e.
the product of the trip counts of the loops around it. A loop's trip count is read from its
condition computation (``compare(induction variable, constant N), direction=LT`` with the
induction variable starting at 0, which is how XLA emits ``scan``/``fori_loop`` loops); a loop whose
count cannot be read is counted once and reported. Where XLA recorded the count
(``backend_config`` ``known_trip_count``, e.g. on CPU) that is used.

Bytes per device op (:func:`device_ops`): the ops that run on the device are the instructions of
the entry computation and of the computations it runs through control flow (``while`` bodies times
their trip count, ``conditional`` branches, ``call``s, async wrappers), not the insides of fusions.
Each gets a bytes-accessed *proxy* from the HLO shapes: the bytes of its operands plus the bytes of
its result. Inside a fusion, an operand read only through ``slice``/``dynamic-slice`` counts the
slices' bytes, and a fusion whose root is an in-place ``dynamic-update-slice`` counts the update
(not the whole buffer) as written and its aliased operand as not read, as XLA's own analysis does.
The result of an async SparseCore ``custom-call-update`` counts its output, not the operands it
echoes. Buffers in another memory space than HBM (layouts with ``S(n)``, n > 0) are left out.
Layout padding (TPU tiles) is not counted, so the proxy is close to, not equal to, XLA's
``bytes accessed`` (OLMo 3 7B parts on tpu7x: 94-97 % of it).
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

# Instructions that move no data of their own (or whose work is counted where it is started).
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
         "replica-id", "iota", "opt-barrier", "add-dependency", "domain", "get-dimension-size",
         "copy-done", "send-done", "recv-done", "async-done", "async-update", "all-gather-done",
         "all-reduce-done", "collective-permute-done", "custom-call-done", "fusion-done"}
_CONTROL = {"while", "conditional", "call"}
_ARRAY_RE = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) +
                       r")\[([0-9,]*)\](\{[^}]*\})?")
_SPACE_RE = re.compile(r"S\((\d+)\)")
_WRAPPERS = re.compile(r"^(jit|pjit|jvp|transpose|vmap|remat|checkpoint|rematted_computation|"
                       r"custom_jvp_call|custom_vjp_call|checkpoint_name|shard_map|xla_call|core_call)"
                       r"(\((.*)\))?$")


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


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dimensions) of every array in a shape text (a tuple's members in order)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _SHAPE_RE.findall(shape)]


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a shape text (tuples summed; layouts ignored)."""
    return int(sum(math.prod(dims) * DTYPE_BYTES[dtype] for dtype, dims in array_shapes(shape)))


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


def called_computations(instr: Instruction) -> dict[str, list[str]]:
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
    # computation -> (the computation that calls it, the calling instruction's opcode)
    callers: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

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
    callers: dict[str, tuple[str, str]] = {}
    unknown = 0

    def visit(cname: str, m: float, depth: int = 0) -> None:
        nonlocal unknown
        if depth > 64 or cname not in comps:
            return
        mult[cname] += m
        for ins in comps[cname]:
            called = called_computations(ins)
            if not called:
                continue
            target = re.search(r'custom_call_target="([^"]+)"', ins.text) if ins.opcode == "custom-call" else None
            for names in called.values():
                for c in names:
                    callers.setdefault(c, (cname, ins.opcode + (f":{target.group(1)}" if target else "")))
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
                for names in called.values():
                    for c in names:
                        visit(c, m, depth + 1)

    visit(entry, 1.0)
    return Program(comps, entry, dict(mult), unknown, callers)


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
    reduce-scatter, the buffer of an all-reduce / permute / all-to-all. An async ``-start`` other
    than all-reduce's returns a tuple (input, output, context scalars), where a combined
    collective's input and output are tuples themselves (XLA's GPU combiners put every layer's
    gathers or scatters into one: ``((in_1, ..., in_n), (out_1, ..., out_n))``): the gathered
    outputs of an all-gather count, the inputs of the others, each summed over the operands.
    An all-reduce's shape is its (possibly combined) buffers."""
    if not ins.opcode.endswith("-start") or kind == "all-reduce":
        return shape_bytes(ins.shape)
    parts = _tuple_parts(ins.shape)
    if len(parts) >= 2:
        return shape_bytes(parts[1] if kind == "all-gather" else parts[0])
    return int(max((math.prod(dims) * DTYPE_BYTES[d] for d, dims in array_shapes(ins.shape)), default=0))


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


_MESH_GROUPS_RE = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS_RE = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\s*\{\s*\d+\s*,\s*\d+\s*\}\s*,?)*)\}")
_PAIR_RE = re.compile(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}")


def replica_group(ins: Instruction) -> list[int] | None:
    """The device ids (positions in the program's device assignment) of the first replica group
    of a collective, in any of the forms XLA prints: a list ``{{0,1},{2,3}}``, an iota
    ``[2,2]<=[4]`` (optionally transposed, ``[2,2]<=[2,2]T(1,0)``), or a named mesh
    ``mesh['data'=2,'fsdp'=8] {'fsdp'}`` (the group varies the named axes, the others at 0).
    None: every device (``{}`` or no groups)."""
    import numpy as np

    text = ins.text.split(", metadata=")[0]
    m = _MESH_GROUPS_RE.search(text)
    if m:
        axes = [(a.split("=")[0].strip().strip("'"), int(a.split("=")[1])) for a in m.group(1).split(",")]
        named = {a.strip().strip("'") for a in m.group(2).split(",") if a.strip()}
        ids = np.arange(math.prod(n for _, n in axes)).reshape([n for _, n in axes])
        index = tuple(slice(None) if name in named else 0 for name, _ in axes)
        return [int(x) for x in ids[index].reshape(-1)]
    m = _IOTA_GROUPS_RE.search(text)
    if m:
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return [int(x) for x in ids.reshape(int(m.group(1)), int(m.group(2)))[0]]
    m = _LIST_GROUPS_RE.search(text)
    if m and m.group(1):
        return [int(x) for x in m.group(1).split(",")]
    return None


def permute_pairs(ins: Instruction) -> list[tuple[int, int]]:
    """Every (source, target) pair of a collective-permute, in the order the HLO lists them
    (``source_target_pairs={{0,1},{1,2},...}``); [] where it lists none."""
    m = _PAIRS_RE.search(ins.text)
    return [(int(a), int(b)) for a, b in _PAIR_RE.findall(m.group(1))] if m else []


def permute_pair(ins: Instruction) -> tuple[int, int] | None:
    """The first (source, target) pair of a collective-permute."""
    pairs = permute_pairs(ins)
    return pairs[0] if pairs else None


def _runs_async(prog: Program, ins: Instruction) -> bool:
    """Whether a collective runs asynchronously beside the computation that started it: an
    ``-start`` op, or a collective inside a computation started by one (``custom-call-start``,
    ``async-start``, ``call-start``: how TPU programs run collectives on their own threads) or by
    an ``AsyncCollectiveStart`` custom call (TPU's asynchronous collective fusions)."""
    if ins.opcode.endswith("-start"):
        return True
    cname = ins.computation
    for _ in range(8):             # up through fusions and wrappers, not out of a loop or branch
        if cname not in prog.callers:
            return False
        cname, op = prog.callers[cname]
        if op.endswith("-start") or op.endswith(":AsyncCollectiveStart"):
            return True
        if op in _CONTROL:
            return False
    return False


def collective_ops(prog: Program) -> list[dict]:
    """Every collective of the program: ``kind``, ``bytes`` per execution per device (as
    :func:`collective_bytes`), ``count`` (executions per program run), ``group`` (the device ids of
    its first replica group; None: all devices), ``pairs`` (a permute's every source and target:
    :func:`permute_pairs`), ``pair`` (the first of them) and ``async`` (:func:`_runs_async`)."""
    out = []
    for ins, m in prog.instructions():
        kind = collective_kind(ins)
        if kind:
            out.append({"kind": kind, "bytes": collective_bytes(ins, kind), "count": m,
                        "group": replica_group(ins), "async": _runs_async(prog, ins),
                        "pairs": permute_pairs(ins) if kind == "collective-permute" else [],
                        "pair": permute_pair(ins) if kind == "collective-permute" else None,
                        "name": ins.name})
    return out


def op_names(ins: Instruction) -> list[str]:
    return re.findall(r'op_name="([^"]*)"', ins.text)


def custom_calls(prog: Program, target: str) -> list[tuple[Instruction, float]]:
    return [(ins, m) for ins, m in prog.instructions()
            if ins.opcode == "custom-call" and f'custom_call_target="{target}"' in ins.text]


def array_bytes(text: str) -> float:
    """Bytes of the HBM arrays in a shape text (tuples summed; other memory spaces skipped)."""
    total = 0.0
    for dtype, dims, layout in _ARRAY_RE.findall(text):
        space = _SPACE_RE.search(layout or "")
        if space and space.group(1) != "0":
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * DTYPE_BYTES[dtype]
    return total


def _args_text(ins: Instruction) -> str:
    """The text between the opcode's parentheses (the operands with their shapes)."""
    head = ins.text.split(", metadata=")[0]
    start = head.find(ins.opcode + "(", len(ins.name))
    if start < 0:
        return ""
    i, depth = start + len(ins.opcode), 0
    for j in range(i, len(head)):
        if head[j] == "(":
            depth += 1
        elif head[j] == ")":
            depth -= 1
            if depth == 0:
                return head[i + 1:j]
    return head[i + 1:]


def _split_top(args: str) -> list[str]:
    """Operands at the top level of an argument list (commas inside brackets/braces/parens kept)."""
    out, depth, cur = [], 0, []
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return [a.strip() for a in out if a.strip()]


def _operand_bytes(operand: str, shapes: dict[str, str]) -> float:
    """Bytes of one operand: its inline shape where the printer wrote one, else its definition's."""
    if _ARRAY_RE.search(operand):
        return array_bytes(operand)
    return array_bytes(shapes.get(operand.split()[-1].lstrip("%"), "")) if operand else 0.0


def _first_operand(ins: Instruction) -> str:
    ops = _split_top(_args_text(ins))
    return ops[0].split()[-1].lstrip("%") if ops else ""


def _params_and_users(fused: list[Instruction]) -> tuple[dict[int, str], dict[str, list[Instruction]]]:
    params: dict[int, str] = {}
    users: dict[str, list[Instruction]] = defaultdict(list)
    for f in fused:
        if f.opcode == "parameter":
            m = re.search(r"parameter\((\d+)\)", f.text)
            if m:
                params[int(m.group(1))] = f.name
        for ref in re.findall(r"%([\w.\-]+)", _args_text(f)):
            users[ref].append(f)
    return params, users


def _sliced_read(name: str, users: dict[str, list[Instruction]], comps: dict, depth: int = 0) -> float | None:
    """Bytes read of a value used only through slices -- directly, through bitcasts, or as the
    parameter of a nested fusion that does the same -- else None (read whole)."""
    us = users.get(name, [])
    if not us or depth > 8:
        return None
    total = 0.0
    for u in us:
        if u.opcode in ("slice", "dynamic-slice") and _first_operand(u) == name:
            total += array_bytes(u.shape)
            continue
        if u.opcode == "bitcast":
            part = _sliced_read(u.name, users, comps, depth + 1)
        elif u.opcode == "fusion":
            called = called_computations(u).get("calls", [])
            inner = comps.get(called[0], []) if called else []
            iparams, iusers = _params_and_users(inner)
            refs = [a.split()[-1].lstrip("%") for a in _split_top(_args_text(u))]
            part = 0.0
            for i, r in enumerate(refs):
                if r == name:
                    got = _sliced_read(iparams.get(i, ""), iusers, comps, depth + 1)
                    part = None if got is None or part is None else part + got
        else:
            part = None
        if part is None:
            return None
        total += part
    return total


def _tuple_parts(shape: str) -> list[str]:
    """The top-level members of a tuple shape text (none for an array's)."""
    return _split_top(shape.strip()[1:-1]) if shape.strip().startswith("(") else []


def _async_result(shape: str) -> str:
    """The result part of an async op's shape ``((operands...), result, context...)`` (the shape
    itself where it is no such tuple)."""
    parts = _tuple_parts(shape)
    return parts[1] if len(parts) > 1 else shape


def _fusion_io(ins: Instruction, fused: list[Instruction], shapes: dict[str, str],
               comps: dict | None = None) -> tuple[float, float]:
    """(bytes read, bytes written) of a fusion: an operand read only through slices counts their
    bytes; a root dynamic-update-slice of a parameter writes its update, reads not the buffer."""
    operands = _split_top(_args_text(ins))
    params, users = _params_and_users(fused)
    root = next((f for f in fused if f.text.lstrip().startswith("ROOT")), fused[-1] if fused else None)
    written = array_bytes(ins.shape)
    aliased: set[str] = set()
    inner = {f.name: f for f in fused}
    inner_shapes = {f.name: f.shape for f in fused}
    # the results: the root, or each member of a root tuple (a multi-output fusion)
    results, parts = [root], [ins.shape]
    if root is not None and root.opcode == "tuple":
        results = [inner.get(a.split()[-1].lstrip("%")) for a in _split_top(_args_text(root))]
        parts = _tuple_parts(ins.shape)
    if len(parts) == len(results):
        written = 0.0
        for res, part in zip(results, parts):
            ops = _split_top(_args_text(res)) if res is not None and res.opcode == "dynamic-update-slice" else []
            buf = ops[0].split()[-1].lstrip("%") if ops else ""
            if buf in params.values():    # updated in place: writes its update, reads not the buffer
                aliased.add(buf)
                written += _operand_bytes(ops[1], {**shapes, **inner_shapes}) if len(ops) > 1 else 0.0
            else:
                written += array_bytes(part)
    read = 0.0
    for idx, operand in enumerate(operands):
        pname = params.get(idx)
        if pname is not None and pname in aliased:
            continue
        sliced = _sliced_read(pname, users, comps or {}) if pname else None
        read += _operand_bytes(operand, shapes) if sliced is None else sliced
    return read, written


def op_kind(ins: Instruction) -> str:
    op = ins.opcode
    if op == "fusion":
        m = re.search(r"kind=(k\w+)", ins.text)
        kind = m.group(1) if m else "?"
        cfg = re.search(r'"kind":"([\w\-]+)"', ins.text)   # TPU backend_config fusion kind
        if cfg:
            kind += f"/{cfg.group(1)}"
        return f"fusion {kind}"
    if op in ("custom-call", "custom-call-start"):
        m = re.search(r'custom_call_target="([^"]+)"', ins.text)
        return f"custom-call {m.group(1) if m else '?'}"
    if op.endswith("-start"):
        return op[:-6]
    return op


def op_scope(op_name: str) -> tuple[str, str, str]:
    """(primitive, scope, pass) of an ``op_name``: the last path component, the named scopes in
    between without function-transformation wrappers and with numbers replaced by N, and whether
    it is the forward, the backward (``transpose(...)``) or a rematerialized forward."""
    if not op_name:
        return "(no metadata)", "(no metadata)", "?"
    parts = op_name.split("/")
    prim = re.sub(r"\[.*", "", parts[-1]) if parts else "?"
    pas = ("remat fwd" if "rematted_computation" in op_name else
           "bwd" if "transpose(" in op_name else "fwd")
    scopes = [re.sub(r"\d+", "N", p) for p in parts[:-1] if not _WRAPPERS.match(p)]
    return prim, "/".join(scopes) or "(top)", pas


def stack_frames(text: str) -> dict[int, list[tuple[str, int, str]]]:
    """Stack frame id -> [(file path, line, function), ...] innermost first, from the tables XLA
    prints before the computations (FileNames, FunctionNames, FileLocations, StackFrames). A
    printed ``parent_frame_id`` is the parent's id + 1 (1: no parent)."""
    head = text[:text.find("\nENTRY ")] if "\nENTRY " in text else text
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in head.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if current is not None and m:
            current[int(m.group(1))] = m.group(2)
        elif not line.strip():
            current = None
    files, funcs = sections.get("FileNames", {}), sections.get("FunctionNames", {})
    locs: dict[int, tuple[str, int, str]] = {}
    for i, v in sections.get("FileLocations", {}).items():
        m = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", v)
        if m:
            locs[i] = (files.get(int(m.group(1)), "?").strip('"'), int(m.group(3)),
                       funcs.get(int(m.group(2)), "?").strip('"'))
    raw = {}
    for i, v in sections.get("StackFrames", {}).items():
        m = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", v)
        if m:
            raw[i] = (int(m.group(1)), int(m.group(2)) - 1)
    out: dict[int, list[tuple[str, str]]] = {}
    for i in raw:
        chain, j, seen = [], i, set()
        while j in raw and j not in seen:
            seen.add(j)
            loc, j = raw[j]
            if loc in locs:
                chain.append(locs[loc])
        out[i] = chain
    return out


def _source(frames: list[tuple[str, int, str]], depth: int = 3) -> tuple[str, str]:
    """(innermost ``file:line function`` with the file's base name, the innermost ``depth``
    functions joined by ``<``)."""
    if not frames:
        return "(no stack frame)", "(no stack frame)"
    path, line, fn = frames[0]
    return f"{path.rsplit('/', 1)[-1]}:{line} {fn}", "<".join(f for _, _, f in frames[:depth])


def device_ops(text: str, prog: Program | None = None) -> list[dict]:
    """Every device op of the program, once per execution-site, with its multiplier and bytes
    (``prog``: the text's :func:`analyse`, where the caller has it already)."""
    prog = prog or analyse(text)
    comps = prog.computations
    # computations reached through control flow (bodies, branches, calls, async wrappers) run
    # their instructions as device ops; fusion bodies and reducers do not.
    control: set[str] = {prog.entry}
    stack = [prog.entry]
    while stack:
        for ins in comps.get(stack.pop(), []):
            called = called_computations(ins)
            if ins.opcode in _CONTROL or ins.opcode in ("async-start",) or (
                    ins.opcode.endswith("-start") and ins.opcode != "custom-call-start"
                    and "calls" in called):
                for names in called.values():
                    for c in names:
                        if c not in control and c in comps:
                            control.add(c)
                            stack.append(c)
    shapes = {ins.name: ins.shape for instrs in comps.values() for ins in instrs}
    frames = stack_frames(text)
    rows = []
    for cname in control:
        mult = prog.multiplier.get(cname, 0)
        if not mult:
            continue
        for ins in comps[cname]:
            if ins.opcode in _FREE or ins.opcode in _CONTROL or ins.opcode == "async-start":
                continue
            if ins.opcode in ("fusion", "fusion-start"):
                called = called_computations(ins).get("calls", [])
                # an async fusion (GPU) returns ((operands...), result, context): its result is
                # what it writes, and its body is read as a fusion's (slices, in-place updates)
                body = ins if ins.opcode == "fusion" else dataclasses.replace(ins, shape=_async_result(ins.shape))
                read, written = _fusion_io(body, comps.get(called[0], []) if called else [], shapes, comps)
            else:
                args = _split_top(_args_text(ins))
                read, written = sum(_operand_bytes(a, shapes) for a in args), array_bytes(ins.shape)
                if ins.opcode == "dynamic-slice":      # reads its slice (and the indices), not the buffer
                    read = written + sum(_operand_bytes(a, shapes) for a in args[1:])
                elif ins.opcode == "dynamic-update-slice":
                    written = _operand_bytes(args[1], shapes) if len(args) > 1 else written
                    read = sum(_operand_bytes(a, shapes) for a in args[1:])
                elif ins.opcode == "copy-start":   # result: (destination, source, context)
                    written = array_bytes(_tuple_parts(ins.shape)[0])
                elif ins.opcode == "custom-call-update":   # result: ((operands), output, context)
                    written = array_bytes(_async_result(ins.shape))
            names = op_names(ins)
            prim, scope, pas = op_scope(names[0] if names else "")
            fid = re.search(r"stack_frame_id=(\d+)", ins.text)
            line, stack = _source(frames.get(int(fid.group(1)), []) if fid else [])
            dtypes = sorted({d for d, _, _ in _ARRAY_RE.findall(ins.shape)}) or ["-"]
            rows.append({"name": ins.name, "computation": cname, "kind": op_kind(ins), "prim": prim,
                         "scope": scope, "line": line, "stack": stack, "pass": pas,
                         "dtype": ",".join(dtypes), "mult": mult,
                         "bytes": mult * (read + written), "read": mult * read, "written": mult * written,
                         "shape": ins.shape.strip()[:120], "op_name": names[0] if names else ""})
    return rows


def op_bytes(text: str) -> dict[str, float]:
    """Instruction name -> the bytes one run of it reads and writes (:func:`device_ops`' proxy,
    per execution of the op)."""
    return {r["name"]: (r["read"] + r["written"]) / r["mult"] for r in device_ops(text)}


_ARRAY_DIMS_RE = re.compile(r"^\w+\[([0-9,]*)\]")
_CONTRACTING_RE = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


_DIM_LABELS_RE = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
_WINDOW_SIZE_RE = re.compile(r"window=\{size=([0-9x]+)")
_FEATURE_GROUPS_RE = re.compile(r"feature_group_count=(\d+)")


def _window_taps(ins, dims: dict[str, list[int]], lhs_label: str, out_label: str) -> float:
    """The window taps an output element of a ``convolution`` multiplies on average: per spatial
    dimension, those that land on the input rather than its padding (a TPU writes a matmul over
    16 heads as a window of 16 padded by 15 on each side of a one-element input: one tap, not 16),
    times the other dimensions'. The window's size where the text holds what this does not read
    (dilation)."""
    w = _WINDOW_SIZE_RE.search(ins.text)
    if not w:
        return 1.0
    sizes = [int(x) for x in w.group(1).split("x")]
    window = re.search(r"window=\{([^}]*)\}", ins.text)
    spec = window.group(1) if window else ""
    lhs, out = dims.get(_first_operand(ins)), dims.get(ins.name)
    if "dilate" in spec or lhs is None or out is None:
        return float(math.prod(sizes))
    pad = re.search(r"pad=([0-9_x\-]+)", spec)
    pads = [tuple(int(v) for v in p.split("_")) for p in pad.group(1).split("x")] if pad else []
    stride = re.search(r"stride=([0-9x]+)", spec)
    strides = [int(v) for v in stride.group(1).split("x")] if stride else []
    taps = 1.0
    for i, size in enumerate(sizes):
        if str(i) not in lhs_label or str(i) not in out_label:
            return float(math.prod(sizes))
        n_in, n_out = lhs[lhs_label.index(str(i))], out[out_label.index(str(i))]
        lo = pads[i][0] if i < len(pads) else 0
        s = strides[i] if i < len(strides) else 1
        valid = sum(max(0, min(size, n_in + lo - o * s) - max(0, lo - o * s)) for o in range(n_out))
        taps *= valid / max(1, n_out)
    return taps


def _conv_contracted(ins, dims: dict[str, list[int]]) -> float:
    """The products each output element of a ``convolution`` sums: the input features (the
    lhs's ``f`` dimension, per feature group) times the window taps that land on the input
    (:func:`_window_taps`). A matmul written as a convolution (``dim_labels=bf_io->bf``, no
    window) contracts its lhs's ``f``."""
    m = _DIM_LABELS_RE.search(ins.text)
    lhs = dims.get(_first_operand(ins))
    if m is None or lhs is None or "f" not in m.group(1):
        return 1
    k = lhs[m.group(1).index("f")]
    g = _FEATURE_GROUPS_RE.search(ins.text)
    if g:
        k //= max(1, int(g.group(1)))
    return k * _window_taps(ins, dims, m.group(1), m.group(3))


def dot_flops(text: str) -> dict[str, float]:
    """Instruction name -> the FLOPs (2 x output elements x contracted elements) of the dots it
    runs once: a ``dot``'s or ``convolution``'s own, a fusion's those of the computation it
    calls."""
    comps, _ = parse(text)
    own: dict[str, float] = {}
    calls: dict[str, str] = {}
    comp_dots: dict[str, float] = defaultdict(float)
    for cname, instrs in comps.items():
        dims: dict[str, list[int]] = {}
        for ins in instrs:
            m = _ARRAY_DIMS_RE.match(ins.shape.strip())
            if m is not None:        # not a tuple
                dims[ins.name] = [int(d) for d in m.group(1).split(",") if d]
            if ins.opcode == "fusion":   # its dots are its body's, whatever its result (a tuple too)
                called = called_computations(ins).get("calls", [])
                if called:
                    calls[ins.name] = called[0]
                continue
            if m is None:
                continue
            if ins.opcode == "dot":
                lhs = _first_operand(ins)
                cd = _CONTRACTING_RE.search(ins.text)
                k = 1
                for c in (cd.group(1).split(",") if cd and cd.group(1) else []):
                    k *= dims.get(lhs, [1] * (int(c) + 1))[int(c)]
                own[ins.name] = 2.0 * math.prod(dims[ins.name]) * k
                comp_dots[cname] += own[ins.name]
            elif ins.opcode == "convolution":   # a TPU's compiled matmuls are convolutions
                own[ins.name] = 2.0 * math.prod(dims[ins.name]) * _conv_contracted(ins, dims)
                comp_dots[cname] += own[ins.name]
    return {**own, **{n: comp_dots[c] for n, c in calls.items() if comp_dots.get(c)}}


# What :func:`summary` groups a program's device ops by (the keys of :func:`device_ops`' rows).
GROUPS = ("kind", "prim", "scope", "line", "stack", "pass", "dtype")


def summary(rows: list[dict]) -> dict:
    """The bytes and op counts of :func:`device_ops`' rows, in all and per value of each of
    :data:`GROUPS`, largest first."""
    out: dict = {"total_bytes": sum(r["bytes"] for r in rows), "ops": int(sum(r["mult"] for r in rows))}
    for g in GROUPS:
        acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for r in rows:
            acc[r[g]][0] += r["bytes"]
            acc[r[g]][1] += r["mult"]
        out[g] = {k: {"bytes": v[0], "ops": int(v[1])}
                  for k, v in sorted(acc.items(), key=lambda kv: -kv[1][0])}
    return out
