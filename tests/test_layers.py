"""The import graph runs one way: no cycles, and no module imports from a layer above its own.

The layers are the ones the README writes down (its ``Imports run one way`` block, top to bottom);
this test reads them from there and every ``import olmax...`` statement of ``src/olmax`` (at the top
of a module or inside a function) with :mod:`ast`, without importing anything.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "olmax"


def readme_layers() -> list[set[str]]:
    """The README's layers, bottom first: each a set of units (``train``, ``config``, ...)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"Imports run one way.*?\n```[a-z]*\n(.*?)```", text, re.S)
    assert block, "README.md: no 'Imports run one way' block"
    layers = []
    for line in block.group(1).splitlines():
        names = line.split("#")[0].strip()
        if names:
            layers.append({n.strip() for n in names.split(",")})
    return layers[::-1]


def modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The olmax modules ``path`` imports (``from olmax.x import y`` counts as olmax.x.y when that
    is a module, else olmax.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "olmax")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "olmax":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return {m for m in out if m in known and m != "olmax"}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, set(mods)) for m, p in mods.items()}


def test_every_unit_has_a_layer():
    layers = readme_layers()
    placed = set().union(*layers)
    units = {unit(m) for m in modules()} - {"olmax", "__main__"}
    assert units <= placed, f"units without a layer in the README: {sorted(units - placed)}"
    assert sum(len(layer) for layer in layers) == len(placed), "a unit is in two layers"


def test_no_import_from_a_higher_layer():
    level = {u: i for i, layer in enumerate(readme_layers()) for u in layer}
    up = [f"{a} -> {b}" for a, deps in graph().items() for b in deps
          if unit(a) in level and unit(b) in level and level[unit(b)] > level[unit(a)]]
    assert not up, "imports running up the layers:\n" + "\n".join(sorted(up))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
