"""``olmax curves RUN_OR_FILE... [--metric loss] [--x step|tokens] [--smooth EMA] [--out PLOT.png]
[--json SUMMARY.json]``: overlay runs and report their differences against the first one.

A source is a run directory (its ``metrics.jsonl``), a ``.jsonl`` file, or a ``.csv`` (W&B /
OLMo-core export) whose columns are mapped with ``--map step=_step --map loss="train/CE loss"``.
"""

from __future__ import annotations

import argparse
import math

from olmax.analysis.curves import compare_runs, load_curve, metrics_file, plot_comparison
from olmax.commands import HELP
from olmax.errors import ConfigError
from olmax.io import refuse_outputs, write_json_atomic
from olmax.store import is_bucket


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("curves", help=HELP["curves"],
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", metavar="RUN_OR_FILE",
                   help="run directories, metrics .jsonl or .csv files; the first is the reference")
    p.add_argument("--metric", default="loss", help="metric to compare (default: loss)")
    p.add_argument("--x", default="step", choices=["step", "tokens"], help="align runs on step or tokens")
    p.add_argument("--smooth", type=float, default=None, metavar="EMA",
                   help="EMA weight of the past in [0, 1) (TensorBoard convention)")
    p.add_argument("--map", action="append", default=[], metavar="NAME=COLUMN",
                   help="column mapping for CSV/JSONL sources, e.g. loss='train/CE loss'")
    p.add_argument("--label", action="append", default=[], help="display names, in source order")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="divergence threshold (relative to the reference unless --absolute; default 0.01)")
    p.add_argument("--absolute", action="store_true", help="the threshold is an absolute difference")
    p.add_argument("--windows", type=int, default=10, help="number of windows for the summary")
    p.add_argument("--out", help="write the plot here (PNG)")
    p.add_argument("--json", dest="json_out", help="write the summary here (JSON)")
    p.add_argument("--force", action="store_true", help="replace existing --out/--json files")
    p.set_defaults(func=run)


def parse_map(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--map expects NAME=COLUMN, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def run(args: argparse.Namespace) -> int:
    if args.smooth is not None and not 0 <= args.smooth < 1:
        raise ConfigError(f"--smooth must be in [0, 1) (got {args.smooth})")
    if not (math.isfinite(args.threshold) and args.threshold >= 0):
        raise ConfigError(f"--threshold must be a finite number >= 0 (got {args.threshold})")
    if args.windows < 1:
        raise ConfigError(f"--windows must be positive (got {args.windows})")
    if args.label and len(args.label) != len(args.sources):
        raise ConfigError(f"--label given {len(args.label)} times for {len(args.sources)} sources")
    columns = parse_map(args.map)
    files = [metrics_file(src) for src in args.sources]
    inputs = [(f, "a metrics file") for f in files if not is_bucket(str(f))]
    refuse_outputs([("--json", args.json_out), ("--out", args.out)], args.force, inputs=inputs)
    curves = [load_curve(src, args.metric, args.x, columns=columns,
                         name=args.label[i] if args.label else None) for i, src in enumerate(args.sources)]
    names = [c.name for c in curves]
    for i, c in enumerate(curves):  # keep display names unique
        if names.count(c.name) > 1:
            c.name = f"{c.name}#{i}"
    summary = compare_runs(curves, metric=args.metric, x=args.x, smooth=args.smooth,
                           threshold=args.threshold, relative=not args.absolute, windows=args.windows)
    for r in summary["runs"]:
        bad = r["non_finite"]
        print(f"{r['name']}: {r['points']} points, final {args.metric} {_num(r['final'], '.6g')}, "
              f"min {_num(r['min'], '.6g')}" + (f"; {bad['points']} non-finite, first {bad['first_value']} "
                                                 f"at {args.x} {bad['first_x']:g}" if bad else ""))
    for c in summary["comparisons"]:
        div = c["first_divergence"]
        kind = "relative" if c["threshold"]["relative"] else "absolute"
        why = " (a non-finite value)" if c["divergence_reason"] == "non-finite" else ""
        print(f"{c['run']} vs {c['reference']}: {c['aligned_points']} aligned points"
              f"{' (interpolated)' if c['interpolated'] else ''}, mean |diff| "
              f"{_num(c['mean_abs_diff'], '.4g')} (max {_num(c['max_abs_diff'], '.4g')}), mean rel "
              f"{_num(c['mean_rel_diff'], '.3%')} (max {_num(c['max_rel_diff'], '.3%')}); "
              + (f"first {args.x} beyond {kind} {args.threshold:g}: {div:g}{why}" if div is not None
                 else f"never beyond {kind} {args.threshold:g}"))
    if args.json_out:
        write_json_atomic(args.json_out, summary, overwrite=args.force)
    if args.out:
        plot_comparison(curves, summary, args.out, metric=args.metric, x=args.x, smooth=args.smooth,
                        overwrite=args.force)
        print(f"plot: {args.out}")
    return 0
