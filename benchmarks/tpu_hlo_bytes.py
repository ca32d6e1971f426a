"""Where the bytes of a compiled XLA program go: a per-op breakdown of its optimized HLO text.

XLA's TPU cost model reports one ``bytes accessed`` figure per program. This script splits a
program into the ops that run on the device -- the instructions of the entry computation and of
the computations it runs through control flow (``while`` bodies times their trip count,
``conditional`` branches, ``call``s, async wrappers), not the insides of fusions -- and gives each
a bytes-accessed *proxy* from the HLO shapes: the bytes of its operands plus the bytes of its
result. Inside a fusion, an operand read only through ``slice``/``dynamic-slice`` counts the
slices' bytes, and a fusion whose root is an in-place ``dynamic-update-slice`` counts the update
(not the whole buffer) as written and its aliased operand as not read, as XLA's own analysis does.
The result of an async SparseCore ``custom-call-update`` counts its output, not the operands it
echoes. Buffers in another memory space than HBM (layouts with ``S(n)``, n > 0) are left out.
Layout padding (TPU tiles) is not counted, so the proxy is close to, not equal to, XLA's
``bytes accessed`` (OLMo 3 7B parts on tpu7x: 94-97 % of it).

The ops are grouped by kind (fusion kind -- kLoop / kInput / kOutput / convolution fusions -- copy,
transpose, the target of a custom call, dot, collectives ...), by the jax primitive that named
them (the last component of the ``op_name`` metadata: ``dot_general``, ``mul``,
``convert_element_type`` ...), by their scope (``op_name`` without ``jit``/``jvp``/``transpose``
wrappers and layer numbers), by the source line that made them and its three innermost calling
functions (from the stack frames XLA records: where in the model code they come from), by pass
(forward / backward / rematerialized forward) and by the dtype of the result::

    python benchmarks/tpu_hlo_bytes.py show FILE.hlo.txt [--top 25] [--json OUT]
    python benchmarks/tpu_hlo_bytes.py compare A.hlo.txt B.hlo.txt [--top 25]

and writes the HLO of ``olmax plan``'s unscanned parts (the same programs whose cost model times
the plan sums; needs the 3.12 environment with libtpu for a TPU topology)::

    python benchmarks/tpu_hlo_bytes.py olmax-parts olmo3_7b_stage1 train.global_batch_size=16 \\
        train.micro_batch_size=1 train.remat=full --topology tpu7x:2x2x2 --out-dir /tmp/hlo --parts A,H

(part_A: the loss with one layer group + the LM head, forward + backward; part_H: the LM head and
loss alone; part_O: the optimizer update). ``--groups 2`` compiles part A with two layer groups:
one group is then A at 2 minus A at 1, without the embedding and the LM head's weight casts that
A - H holds. Keep the HLO files outside the repository.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from olmax.perf import hlo  # noqa: E402

GB = 1e9
# Instructions that move no data of their own (or whose work is counted where it is started).
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
         "replica-id", "iota", "opt-barrier", "add-dependency", "domain", "get-dimension-size",
         "copy-done", "send-done", "recv-done", "async-done", "async-update", "all-gather-done",
         "all-reduce-done", "collective-permute-done", "custom-call-done"}
_CONTROL = {"while", "conditional", "call"}
_ARRAY_RE = re.compile(r"\b(" + "|".join(sorted(hlo.DTYPE_BYTES, key=len, reverse=True)) +
                       r")\[([0-9,]*)\](\{[^}]*\})?")
_SPACE_RE = re.compile(r"S\((\d+)\)")
_WRAPPERS = re.compile(r"^(jit|pjit|jvp|transpose|vmap|remat|checkpoint|rematted_computation|"
                       r"custom_jvp_call|custom_vjp_call|checkpoint_name|shard_map|xla_call|core_call)"
                       r"(\((.*)\))?$")


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
        total += n * hlo.DTYPE_BYTES[dtype]
    return total


def _args_text(ins: hlo.Instruction) -> str:
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


def _first_operand(ins: hlo.Instruction) -> str:
    ops = _split_top(_args_text(ins))
    return ops[0].split()[-1].lstrip("%") if ops else ""


def _params_and_users(fused: list[hlo.Instruction]) -> tuple[dict[int, str], dict[str, list[hlo.Instruction]]]:
    params: dict[int, str] = {}
    users: dict[str, list[hlo.Instruction]] = defaultdict(list)
    for f in fused:
        if f.opcode == "parameter":
            m = re.search(r"parameter\((\d+)\)", f.text)
            if m:
                params[int(m.group(1))] = f.name
        for ref in re.findall(r"%([\w.\-]+)", _args_text(f)):
            users[ref].append(f)
    return params, users


def _sliced_read(name: str, users: dict[str, list[hlo.Instruction]], comps: dict, depth: int = 0) -> float | None:
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
            called = hlo._called(u).get("calls", [])
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


def _fusion_io(ins: hlo.Instruction, fused: list[hlo.Instruction], shapes: dict[str, str],
               comps: dict | None = None) -> tuple[float, float]:
    """(bytes read, bytes written) of a fusion: an operand read only through slices counts their
    bytes; a root dynamic-update-slice of a parameter writes its update, reads not the buffer."""
    operands = _split_top(_args_text(ins))
    params, users = _params_and_users(fused)
    root = next((f for f in fused if f.text.lstrip().startswith("ROOT")), fused[-1] if fused else None)
    written = array_bytes(ins.shape)
    aliased = None
    if root is not None and root.opcode == "dynamic-update-slice":
        ops = _split_top(_args_text(root))
        buf = ops[0].split()[-1].lstrip("%") if ops else ""
        if buf in params.values():
            aliased = buf
            written = _operand_bytes(ops[1], shapes) if len(ops) > 1 else written
    read = 0.0
    for idx, operand in enumerate(operands):
        pname = params.get(idx)
        if pname is not None and pname == aliased:
            continue
        sliced = _sliced_read(pname, users, comps or {}) if pname else None
        read += _operand_bytes(operand, shapes) if sliced is None else sliced
    return read, written


def _kind(ins: hlo.Instruction) -> str:
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


def _scope(op_name: str) -> tuple[str, str, str]:
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


def stack_frames(text: str) -> dict[int, list[tuple[str, str]]]:
    """Stack frame id -> [(``file:line``, function), ...] innermost first, from the tables XLA
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
    locs: dict[int, tuple[str, str]] = {}
    for i, v in sections.get("FileLocations", {}).items():
        m = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", v)
        if m:
            f = files.get(int(m.group(1)), "?").strip('"').rsplit("/", 1)[-1]
            locs[i] = (f"{f}:{m.group(3)}", funcs.get(int(m.group(2)), "?").strip('"'))
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


def _source(frames: list[tuple[str, str]], depth: int = 3) -> tuple[str, str]:
    """(innermost ``file:line function``, the innermost ``depth`` functions joined by ``<``)."""
    if not frames:
        return "(no stack frame)", "(no stack frame)"
    return f"{frames[0][0]} {frames[0][1]}", "<".join(fn for _, fn in frames[:depth])


def ops(text: str) -> list[dict]:
    """Every device op of the program, once per execution-site, with its multiplier and bytes."""
    prog = hlo.analyse(text)
    comps = prog.computations
    # computations reached through control flow (bodies, branches, calls, async wrappers) run
    # their instructions as device ops; fusion bodies and reducers do not.
    control: set[str] = {prog.entry}
    stack = [prog.entry]
    while stack:
        for ins in comps.get(stack.pop(), []):
            called = hlo._called(ins)
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
            if ins.opcode == "fusion":
                called = hlo._called(ins).get("calls", [])
                read, written = _fusion_io(ins, comps.get(called[0], []) if called else [], shapes, comps)
            else:
                args = _split_top(_args_text(ins))
                read, written = sum(_operand_bytes(a, shapes) for a in args), array_bytes(ins.shape)
                if ins.opcode == "dynamic-update-slice":
                    written = _operand_bytes(args[1], shapes) if len(args) > 1 else written
                    read = sum(_operand_bytes(a, shapes) for a in args[1:])
                elif ins.opcode == "copy-start":   # result: (destination, source, context)
                    written = array_bytes(_split_top(ins.shape.strip()[1:-1])[0])
                elif ins.opcode == "custom-call-update":   # result: ((operands), output, context)
                    parts = _split_top(ins.shape.strip()[1:-1])
                    written = array_bytes(parts[1]) if len(parts) > 1 else written
            names = hlo.op_names(ins)
            prim, scope, pas = _scope(names[0] if names else "")
            fid = re.search(r"stack_frame_id=(\d+)", ins.text)
            line, stack = _source(frames.get(int(fid.group(1)), []) if fid else [])
            dtypes = sorted({d for d, _, _ in _ARRAY_RE.findall(ins.shape)}) or ["-"]
            rows.append({"name": ins.name, "computation": cname, "kind": _kind(ins), "prim": prim,
                         "scope": scope, "line": line, "stack": stack, "pass": pas,
                         "dtype": ",".join(dtypes), "mult": mult,
                         "bytes": mult * (read + written), "read": mult * read, "written": mult * written,
                         "shape": ins.shape.strip()[:120], "op_name": names[0] if names else ""})
    return rows


GROUPS = ("kind", "prim", "scope", "line", "stack", "pass", "dtype")


def summary(rows: list[dict]) -> dict:
    out: dict = {"total_bytes": sum(r["bytes"] for r in rows), "ops": int(sum(r["mult"] for r in rows))}
    for g in GROUPS:
        acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for r in rows:
            acc[r[g]][0] += r["bytes"]
            acc[r[g]][1] += r["mult"]
        out[g] = {k: {"bytes": v[0], "ops": int(v[1])}
                  for k, v in sorted(acc.items(), key=lambda kv: -kv[1][0])}
    return out


def _print_groups(title: str, groups: dict, total: float, top: int) -> None:
    print(f"\n== by {title} ==")
    for k, v in list(groups.items())[:top]:
        print(f"  {v['bytes'] / GB:9.2f} GB {100 * v['bytes'] / total:5.1f}%  {v['ops']:6d} ops  {k}")


def show(path: str, top: int, json_out: str | None) -> int:
    rows = ops(Path(path).read_text())
    s = summary(rows)
    total = s["total_bytes"] or 1.0
    print(f"{path}: {s['ops']} device op executions, bytes-accessed proxy {total / GB:.2f} GB")
    for g in GROUPS:
        _print_groups(g, s[g], total, top)
    print(f"\n== top {top} ops ==")
    for r in sorted(rows, key=lambda r: -r["bytes"])[:top]:
        print(f"  {r['bytes'] / GB:8.2f} GB  x{r['mult']:<3g} {r['kind']:<24} {r['shape'][:56]:<56} "
              f"{r['line']:<34} {r['op_name'][-90:]}")
    if json_out:
        Path(json_out).write_text(json.dumps({"file": path, **s,
                                              "top": sorted(rows, key=lambda r: -r["bytes"])[:top]}, indent=1))
    return 0


def compare(a: str, b: str, top: int) -> int:
    sa, sb = summary(ops(Path(a).read_text())), summary(ops(Path(b).read_text()))
    print(f"A {a}: {sa['total_bytes'] / GB:.2f} GB proxy\nB {b}: {sb['total_bytes'] / GB:.2f} GB proxy")
    for g in GROUPS:
        keys = set(sa[g]) | set(sb[g])
        get = lambda s, k: s[g].get(k, {"bytes": 0.0, "ops": 0})  # noqa: E731
        diff = sorted(keys, key=lambda k: -abs(get(sa, k)["bytes"] - get(sb, k)["bytes"]))
        print(f"\n== by {g}: A GB (ops) | B GB (ops) | A-B GB, largest differences first ==")
        for k in diff[:top]:
            x, y = get(sa, k), get(sb, k)
            print(f"  {x['bytes'] / GB:8.2f} ({x['ops']:5d}) | {y['bytes'] / GB:8.2f} ({y['ops']:5d}) | "
                  f"{(x['bytes'] - y['bytes']) / GB:+8.2f}  {k}")
    return 0


def olmax_parts(recipe: str, overrides: list[str], topology: str, out_dir: str, parts: str,
                groups: int = 1) -> int:
    """Compile ``olmax plan``'s unscanned parts of RECIPE for TOPOLOGY and write their HLO."""
    from olmax.errors import OlmaxError
    from olmax.model.runtime import Runtime
    from olmax.parallel.mesh import data_parallel_size, make_mesh
    from olmax.perf.costs import part_costs
    from olmax.perf.targets import topology_devices
    from olmax.train.recipes import load_recipe
    from olmax.train.step import num_micro_batches

    try:
        cfg = load_recipe(recipe, overrides, find_mix=False)
        devices = topology_devices(topology)
    except OlmaxError as e:
        print(f"tpu_hlo_bytes: {e}", file=sys.stderr)
        return 2
    mesh = make_mesh(cfg.mesh, devices)
    dp = data_parallel_size(mesh)
    n_micro = num_micro_batches(cfg.train, dp)
    per_device = cfg.train.global_batch_size // n_micro // dp
    runtime = Runtime.of(cfg.train, devices)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    costs = part_costs(cfg, devices[0], per_device, mesh.shape["tensor"], len(devices), runtime,
                        only=tuple(parts.split(",")), hlo_dir=out_dir, groups=groups)
    for name, c in costs.items():
        print(f"part {name}: optimal_seconds {c.get('optimal_seconds')}, bytes accessed "
              f"{(c.get('bytes accessed') or 0) / GB:.2f} GB, flops {c.get('flops'):.4g} -> "
              f"{out_dir}/part_{name}.hlo.txt")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show")
    s.add_argument("hlo")
    s.add_argument("--top", type=int, default=25)
    s.add_argument("--json", dest="json_out")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--top", type=int, default=25)
    o = sub.add_parser("olmax-parts")
    o.add_argument("recipe")
    o.add_argument("overrides", nargs="*")
    o.add_argument("--topology", required=True)
    o.add_argument("--out-dir", required=True)
    o.add_argument("--parts", default="A,H", help="comma-separated: A (layer group + head), H (head), O")
    o.add_argument("--groups", type=int, default=1,
                   help="layer groups in part A (2: one group's cost is part A at 2 minus at 1)")
    a = p.parse_args(argv)
    for f in [getattr(a, k) for k in ("hlo", "a", "b") if getattr(a, k, None)]:
        if not Path(f).is_file():
            print(f"tpu_hlo_bytes: no such file: {f}", file=sys.stderr)
            return 2
    if a.cmd == "show":
        return show(a.hlo, a.top, a.json_out)
    if a.cmd == "compare":
        return compare(a.a, a.b, a.top)
    return olmax_parts(a.recipe, a.overrides, a.topology, a.out_dir, a.parts, a.groups)


if __name__ == "__main__":
    sys.exit(main())
