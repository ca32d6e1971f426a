"""``olmax bench train RECIPE [key=value ...] --steps N [--json OUT]``, ``olmax bench profile`` and
``olmax bench matmul``.

``bench train`` times the trainer's step on synthetic tokens on one device: steady-state tokens/s
(median step), compile time, peak memory, MFU in OLMo-core's and the causal FLOPs convention, and
the percentage of the measured matmul ceiling (measured first unless ``--no-ceiling``). Any recipe
key can be overridden, e.g. ``model.n_layers=4 train.seq_len=8192 train.attn_impl=chunked``.

``bench profile`` attributes the step's time op by op from an XLA profile (CPU; see
:mod:`olmax.perf.profile`): pass, source line, each op's rate against the matmul or bandwidth
ceiling measured in the same process, and the step's floor estimate.

``bench ab RECIPE [key=value ...] --leg NAME [key=value ...] --leg ...`` times two or more
settings of one model side by side in this process (:func:`olmax.perf.bench.interleave_steps`):
every leg compiled, then one step of each in turn for ``--rounds`` rounds, each leg's median
step and its median per-round ratio to the first leg. ``--compile-budget-s S`` keeps a command
under a time limit from losing everything: legs whose compile would end past S seconds are
reported as not compiled, and the others are measured. The legs step one shared training state, so
a device that holds a single copy of it (one TPU chip) compares them with no second process.

``bench matmul`` measures the ceiling: the best FLOP/s of a square matmul (fp32 accumulation).
With ``--table OUT`` it measures the rates table that ``olmax plan`` prices a GPU's step with
(:mod:`olmax.perf.gpu_rates`: GEMMs on a grid of shapes, cuDNN attention by sequence, head
dimension and window, HBM bandwidth, the per-kernel floor) and writes it to OUT; copied to
``src/olmax/perf/gpu_tables/NAME.json`` and named by the GPU's row in :mod:`olmax.hardware`
(``rates``), it prices that GPU and those of the same tensor cores, or that TPU.
"""

from __future__ import annotations

import argparse
import math

from olmax.commands import HELP
from olmax.errors import ConfigError
from olmax.io import as_inputs, refuse_existing, refuse_outputs, write_json_atomic
from olmax.perf.bench import bench_train, format_train, interleave_steps, matmul_ceiling
from olmax.perf.profile import format_profile, profile_step
from olmax.train.recipes import load_recipe


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help=HELP["bench"],
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench_command", metavar="WHAT")
    sub.required = True

    t = sub.add_parser("train", help="steady-state training step throughput and MFU")
    t.add_argument("recipe", help="recipe name or YAML path")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    t.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    t.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation (default 2)")
    t.add_argument("--no-ceiling", action="store_true", help="skip the matmul-ceiling measurement")
    t.add_argument("--json", dest="json_out", help="also write the result here (JSON)")
    t.add_argument("--force", action="store_true", help="replace an existing --json file")
    t.set_defaults(func=run_train)

    pr = sub.add_parser("profile", help="the step's time op by op, from an XLA profile (CPU)")
    pr.add_argument("recipe", help="recipe name or YAML path (e.g. benchmarks/shapes/A.yaml)")
    pr.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    pr.add_argument("--steps", type=int, default=3,
                    help="profiled steps after one warm-up (per-op figures: the median over them)")
    pr.add_argument("--top", type=int, default=25, help="ops listed (default 25)")
    pr.add_argument("--hlo", help="also write the compiled HLO text here")
    pr.add_argument("--perf", action="store_true",
                    help="also sample the CPU time of --steps more steps with Linux perf and split it "
                         "by code: GEMM micro-kernels, the GEMM library's packing, XLA-generated code, "
                         "the kernel (page faults)")
    pr.add_argument("--json", dest="json_out", help="also write the result here (JSON)")
    pr.add_argument("--force", action="store_true", help="replace an existing --json or --hlo file")
    pr.set_defaults(func=run_profile)

    ab = sub.add_parser("ab", help="settings of one model side by side, steps interleaved")
    ab.add_argument("recipe", help="recipe name or YAML path")
    ab.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of every leg")
    ab.add_argument("--leg", nargs="+", action="append", required=True, metavar="NAME [key=value]",
                    help="a leg: its name, then its own overrides (at least two legs)")
    ab.add_argument("--rounds", type=int, default=6, help="timed rounds (default 6)")
    ab.add_argument("--warmup", type=int, default=1, help="untimed steps of each leg (default 1)")
    ab.add_argument("--compile-budget-s", type=float, default=None, metavar="S",
                    help="compile the legs after the first only while the time spent plus the "
                         "longest compile so far stays within S seconds; the rest are reported "
                         "as not compiled and the compiled ones measured (default: no budget)")
    ab.add_argument("--json", dest="json_out", help="also write the result here (JSON)")
    ab.add_argument("--force", action="store_true", help="replace an existing --json file")
    ab.set_defaults(func=run_ab)

    m = sub.add_parser("matmul", help="measured matmul ceiling (FLOP/s)")
    m.add_argument("--size", type=int, default=None, help="matrix size (default 8192; 1024 on CPU)")
    m.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 "
                                                  "(default bfloat16; float32 on CPU)")
    m.add_argument("--iters", type=int, default=10)
    m.add_argument("--json", dest="json_out", help="also write the result here (JSON)")
    m.add_argument("--table", dest="table_out",
                   help="measure the GPU rates table (GEMMs by shape, cuDNN attention, HBM, kernel "
                        "floor) and write it here (JSON), instead of the ceiling")
    m.add_argument("--force", action="store_true", help="replace an existing --json or --table file")
    m.set_defaults(func=run_matmul)


def run_train(args: argparse.Namespace) -> int:
    if args.json_out:   # refused before spending minutes on the benchmark
        refuse_existing(args.json_out, args.force, flag="--json",
                        inputs=as_inputs([args.recipe], "the recipe"))
    cfg = load_recipe(args.recipe, args.overrides)
    ceiling = None
    if not args.no_ceiling:
        dtype = "float32" if cfg.train.compute_dtype == "float32" else "bfloat16"
        ceiling = matmul_ceiling(dtype=dtype)
        print(f"matmul ceiling    {ceiling['flops_per_s'] / 1e12:.3f} TFLOP/s "
              f"({ceiling['size']}^3 {ceiling['dtype']})")
    result = bench_train(cfg, steps=args.steps, warmup=args.warmup,
                         ceiling_flops=ceiling["flops_per_s"] if ceiling else None)
    print(format_train(result))
    if args.json_out:
        write_json_atomic(args.json_out, {"train": result.to_dict(), "matmul": ceiling,
                                          "recipe": args.recipe, "overrides": list(args.overrides)},
                          overwrite=args.force)
    return 0


def run_profile(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.top < 1:      # before the recipe is compiled and warmed up
        flag, value = ("--steps", args.steps) if args.steps < 1 else ("--top", args.top)
        raise ConfigError(f"{flag} must be >= 1 (got {value})")
    # refused before spending minutes on the benchmark
    refuse_outputs([("--json", args.json_out), ("--hlo", args.hlo)], args.force,
                   inputs=as_inputs([args.recipe], "the recipe"))
    cfg = load_recipe(args.recipe, args.overrides)
    result = profile_step(cfg, args.steps, hlo_out=args.hlo, perf=args.perf)
    print(" ".join([args.recipe, *args.overrides]))
    print(format_profile(result, args.top))
    if args.json_out:
        write_json_atomic(args.json_out, {"recipe": args.recipe, "overrides": list(args.overrides),
                                          **result}, overwrite=args.force)
    return 0


def run_ab(args: argparse.Namespace) -> int:
    names = [leg[0] for leg in args.leg]
    if len(names) < 2 or len(set(names)) != len(names) or any("=" in n for n in names):
        raise ConfigError("--leg: at least two legs, each named first (a name without '='), "
                          f"names distinct (got {names})")
    if args.rounds < 1 or args.warmup < 0:
        raise ConfigError(f"--rounds must be >= 1 and --warmup >= 0 (got {args.rounds}, {args.warmup})")
    budget = args.compile_budget_s
    if budget is not None and not (math.isfinite(budget) and budget >= 0):
        raise ConfigError(f"--compile-budget-s must be a number of seconds >= 0 (got {budget:g})")
    if args.json_out:
        refuse_existing(args.json_out, args.force, flag="--json", inputs=as_inputs([args.recipe], "the recipe"))
    cfgs = {leg[0]: load_recipe(args.recipe, [*args.overrides, *leg[1:]]) for leg in args.leg}
    result = interleave_steps(cfgs, rounds=args.rounds, warmup=args.warmup, compile_budget_s=budget)
    first = cfgs[names[0]]
    tokens = first.train.global_batch_size * first.train.seq_len
    print(f"{args.recipe} {' '.join(args.overrides)}: {args.rounds} rounds, steps interleaved")
    print("| leg | overrides | micro | remat | step ms | tokens/s | ratio to the first (median per round) |")
    print("|---|---|---|---|---|---|---|")
    for leg in args.leg:
        r = result[leg[0]]
        if "error" in r:
            print(f"| {leg[0]} | {' '.join(leg[1:]) or '-'} | {r['error']} |||||")
            continue
        print(f"| {leg[0]} | {' '.join(leg[1:]) or '-'} | {r['micro_batch_size']} | {r['remat']} | "
              f"{r['step_s'] * 1e3:.1f} | {tokens / r['step_s']:,.0f} | {r['ratio_to_first']:.3f} |")
    if args.json_out:
        write_json_atomic(args.json_out, {"recipe": args.recipe, "overrides": list(args.overrides),
                                          "legs": {leg[0]: {"overrides": leg[1:], **result[leg[0]]}
                                                   for leg in args.leg}}, overwrite=args.force)
    return 0


def run_matmul(args: argparse.Namespace) -> int:
    if args.json_out:   # refused before spending minutes on the benchmark
        refuse_existing(args.json_out, args.force, flag="--json")
    if args.table_out:
        from olmax.perf.gpu_rates import measure

        refuse_existing(args.table_out, args.force, flag="--table")
        written: list[bool] = []

        def save(table: dict) -> None:    # after each part: a measurement cut short keeps its parts
            write_json_atomic(args.table_out, table, overwrite=args.force or bool(written))
            written.append(True)
        table = measure(progress=save)
        print(f"rates table of {table['device_kind']} written to {args.table_out}")
        return 0
    r = matmul_ceiling(size=args.size, dtype=args.dtype, iters=args.iters)
    peak = r["peak_flops"]
    print(f"{r['device']}: {r['flops_per_s'] / 1e12:.3f} TFLOP/s ({r['size']}^3 {r['dtype']}, best of "
          f"{args.iters})" + (f", {100 * r['flops_per_s'] / peak:.1f}% of the {peak / 1e12:.0f} TFLOP/s "
                              f"peak" if peak else ""))
    if args.json_out:
        write_json_atomic(args.json_out, r, overwrite=args.force)
    return 0
