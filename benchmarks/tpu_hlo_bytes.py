"""Where the bytes of a compiled XLA program go: a per-op breakdown of its optimized HLO text.

XLA's TPU cost model reports one ``bytes accessed`` figure per program. This script splits a
program into its device ops, each with a bytes-accessed proxy from the HLO shapes
(:func:`olmax.perf.hlo.device_ops`, whose docstring says what is counted).

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

and gives the floor of one layer group's time by the same cost model: the group's dense matrix
products alone (the projections and the MLP of each layer of ``model.window_pattern``, each run as
the remat policy makes the step run it: forward, recomputed forward under ``train.remat=full``,
then the input and the weight gradients), in bf16 (``--dtype``), at the plan's per-device batch,
each product with inputs of its own and its output written to HBM, nothing else::

    python benchmarks/tpu_hlo_bytes.py matmuls olmo3_7b_stage1 train.global_batch_size=16 \
        train.micro_batch_size=1 train.remat=full --topology tpu7x:2x2x2 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from olmax.perf import hlo
from olmax.perf.hlo import GROUPS, summary

GB = 1e9

def _print_groups(title: str, groups: dict, total: float, top: int) -> None:
    print(f"\n== by {title} ==")
    for k, v in list(groups.items())[:top]:
        print(f"  {v['bytes'] / GB:9.2f} GB {100 * v['bytes'] / total:5.1f}%  {v['ops']:6d} ops  {k}")


def show(path: str, top: int, json_out: str | None) -> int:
    rows = hlo.device_ops(Path(path).read_text())
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
    sa, sb = summary(hlo.device_ops(Path(a).read_text())), summary(hlo.device_ops(Path(b).read_text()))
    print(f"A {a}: {sa['total_bytes'] / GB:.2f} GB proxy\nB {b}: {sb['total_bytes'] / GB:.2f} GB proxy")
    for g in GROUPS:
        keys = set(sa[g]) | set(sb[g])
        get = lambda s, k, g=g: s[g].get(k, {"bytes": 0.0, "ops": 0})  # noqa: E731
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


def group_matmuls(recipe: str, overrides: list[str], topology: str | None, json_out: str | None,
                  dtype: str = "bfloat16") -> int:
    """XLA's cost model for the dense matrix products of one layer group alone (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from olmax.errors import OlmaxError
    from olmax.parallel.mesh import data_parallel_size, make_mesh
    from olmax.perf.costs import cost
    from olmax.perf.targets import topology_devices
    from olmax.platforms import backend_of, compiler_options
    from olmax.train.recipes import load_recipe
    from olmax.train.step import num_micro_batches

    try:
        cfg = load_recipe(recipe, overrides, find_mix=False)
        devices = topology_devices(topology) if topology else jax.devices()
    except OlmaxError as e:
        print(f"tpu_hlo_bytes: {e}", file=sys.stderr)
        return 2
    m, train = cfg.model, cfg.train
    if train.remat not in ("full", "none"):
        print(f"tpu_hlo_bytes: matmuls counts the passes of train.remat=full or none, not "
              f"{train.remat!r}", file=sys.stderr)
        return 2
    mesh = make_mesh(cfg.mesh, devices)
    dp = data_parallel_size(mesh)
    per_device = train.global_batch_size // num_micro_batches(train, dp) // dp
    rows = per_device * train.seq_len
    d, q, kv, f = m.d_model, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.mlp_hidden
    weights = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]   # q k v o, gate up down
    layers, forwards = len(m.window_pattern), 2 if train.remat == "full" else 1
    one = NamedSharding(Mesh(np.asarray(devices[:1]).reshape(1), ("x",)), P())

    def arg(shape):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=one)

    # every product gets inputs of its own, so that XLA cannot share one between products
    ws = [[arg(w) for w in weights] for _ in range(layers)]
    xs = [[[arg((rows, w[0])) for w in weights] for _ in range(forwards)] for _ in range(layers)]
    gs = [[arg((rows, w[1])) for w in weights] for _ in range(layers)]

    def products(ws, xs, gs):
        out = []
        for layer in range(layers):
            for rep in range(forwards):
                out += [x @ w for x, w in zip(xs[layer][rep], ws[layer])]
            for x, w, g in zip(xs[layer][0], ws[layer], gs[layer]):
                out += [g @ w.T, x.T @ g]
        return out

    device = devices[0]
    compiled = (jax.jit(products, compiler_options=compiler_options(backend_of([device]), [device]))
                .lower(ws, xs, gs).compile())
    c = cost(compiled)
    flops = 2.0 * rows * sum(a * b for a, b in weights) * layers * (forwards + 2)
    r = {"recipe": recipe, "overrides": overrides, "topology": topology or device.platform,
         "dtype": dtype, "rows_per_device": rows,
         "layers_per_group": layers, "remat": train.remat, "flops_counted": flops,
         "flops_xla": c.get("flops"), "optimal_seconds": c.get("optimal_seconds"),
         "bytes_accessed": c.get("bytes accessed"),
         "tflops_per_s": flops / c["optimal_seconds"] / 1e12 if c.get("optimal_seconds") else None}
    print(f"one group's matrix products alone ({layers} layers x {forwards + 2} passes, {rows} rows): "
          f"{flops / 1e12:.2f} TFLOP (XLA {(c.get('flops') or 0) / 1e12:.2f}), cost model "
          f"{1e3 * (c.get('optimal_seconds') or 0):.2f} ms, {(c.get('bytes accessed') or 0) / GB:.2f} GB")
    if json_out:
        Path(json_out).write_text(json.dumps(r, indent=1) + "\n")
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
    mm = sub.add_parser("matmuls")
    mm.add_argument("recipe")
    mm.add_argument("overrides", nargs="*")
    mm.add_argument("--topology", help="a TPU topology (default: this machine's devices, whose "
                    "cost analysis may have FLOPs only)")
    mm.add_argument("--json", dest="json_out")
    mm.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="of the products' inputs and outputs (the step's: bfloat16)")
    a = p.parse_args(argv)
    for f in [getattr(a, k) for k in ("hlo", "a", "b") if getattr(a, k, None)]:
        if not Path(f).is_file():
            print(f"tpu_hlo_bytes: no such file: {f}", file=sys.stderr)
            return 2
    if a.cmd == "show":
        return show(a.hlo, a.top, a.json_out)
    if a.cmd == "compare":
        return compare(a.a, a.b, a.top)
    if a.cmd == "matmuls":
        return group_matmuls(a.recipe, a.overrides, a.topology, a.json_out, a.dtype)
    return olmax_parts(a.recipe, a.overrides, a.topology, a.out_dir, a.parts, a.groups)


if __name__ == "__main__":
    sys.exit(main())
