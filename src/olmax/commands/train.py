"""``olmax train RECIPE [--run-dir DIR] [key=value ...]``.

RECIPE is a YAML file or a packaged recipe name (``olmo3_7b_stage1``, ``olmo3_7b_stage1_part2``,
``olmo3_7b_stage2``, ``olmo3_tiny``). Overrides use the config's dotted keys, e.g.
``train.max_steps=100 train.global_batch_size=8 train.seq_len=256 data.paths=[a.npy,b.npy]
model.preset=olmo3-14m seed=1 optim.lr=1e-3 init.hf_dir=HF_DIR``. Re-running the same command with
the same ``--run-dir`` resumes from ``DIR/checkpoints/``. The device count comes from the
environment (e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on CPU).

SIGTERM saves a checkpoint at the step reached and stops; the exit status is then 0, or CODE with
``--exit-code-on-stop CODE`` (e.g. 143 for a scheduler that must restart the unfinished job).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from olmax.commands import HELP
from olmax.config import ConfigError
from olmax.train.recipes import load_recipe
from olmax.train import trainer as training   # looked up when run (tests replace the Trainer)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help=HELP["train"], description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", metavar="RECIPE", help="recipe YAML path or packaged recipe name")
    p.add_argument("overrides", nargs=argparse.REMAINDER, metavar="key=value", help="config overrides")
    p.add_argument("--run-dir", default=None,
                   help="run directory (default: runs/<recipe>-<UTC time>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or status lines")
    p.add_argument("--exit-code-on-stop", type=int, default=0, metavar="CODE",
                   help="exit status after a SIGTERM stop (checkpoint saved, run unfinished); "
                        "default 0")
    p.set_defaults(func=run)


def split_options(args: argparse.Namespace) -> None:
    """Options may follow the overrides (``RECIPE key=value --run-dir DIR``): pull them out."""
    rest, i = [], 0
    items = list(args.overrides)
    valued = {"--run-dir": ("run_dir", str, "a directory")}
    if hasattr(args, "exit_code_on_stop"):
        valued["--exit-code-on-stop"] = ("exit_code_on_stop", int, "an integer")
    while i < len(items):
        a = items[i]
        name = a.split("=", 1)[0]
        if name in valued:
            dest, kind, what = valued[name]
            if "=" in a:
                raw = a.split("=", 1)[1]
            elif i + 1 < len(items):
                raw = items[i + 1]
                i += 1
            else:
                raise ConfigError(f"{name} needs {what}")
            try:
                setattr(args, dest, kind(raw))
            except ValueError:
                raise ConfigError(f"{name} needs {what}, got {raw!r}") from None
        elif a == "--quiet" and hasattr(args, "quiet"):
            args.quiet = True
        elif a.startswith("-"):
            raise ConfigError(f"unknown option '{a}'")
        else:
            rest.append(a)
        i += 1
    args.overrides = rest


def default_run_dir(recipe: str) -> str:
    name = Path(recipe).name
    for suffix in (".yaml", ".yml"):
        name = name[: -len(suffix)] if name.endswith(suffix) else name
    return str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")


def format_summary(summary: dict) -> str:
    tps = summary.get("tokens_per_sec")
    parts = [f"steps {summary['start_step'] + 1}..{summary['last_step']}"]
    if summary.get("first_loss") is not None:
        parts.append(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} "
                     f"(min {summary['min_loss']:.4f})")
    if tps:
        parts.append(f"{tps:,.0f} tokens/s")
    parts.append(f"run dir {summary['run_dir']}")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    split_options(args)
    if not 0 <= args.exit_code_on_stop <= 255:
        raise ConfigError(f"--exit-code-on-stop must be 0..255 (got {args.exit_code_on_stop})")
    cfg = load_recipe(args.recipe, args.overrides)
    run_dir = args.run_dir or default_run_dir(args.recipe)
    trainer = training.Trainer(cfg, run_dir, quiet=args.quiet)
    summary = trainer.run()
    if trainer.is_main:
        print(f"olmax train: done: {format_summary(summary)}", file=sys.stdout)
    return args.exit_code_on_stop if summary.get("stopped_early") else 0
