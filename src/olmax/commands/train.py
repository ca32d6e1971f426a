"""``olmax train RECIPE [--run-dir DIR] [key=value ...]``.

RECIPE is a YAML file or a packaged recipe name (``olmo3_7b_stage1``, ``olmo3_7b_stage1_part2``,
``olmo3_7b_stage2``, ``olmo3_tiny``). Overrides use the config's dotted keys, e.g.
``train.max_steps=100 train.global_batch_size=8 train.seq_len=256 data.paths=[a.npy,b.npy]
model.preset=olmo3-14m seed=1 optim.lr=1e-3 init.hf_dir=HF_DIR``. Re-running the same command with
the same ``--run-dir`` resumes from ``DIR/checkpoints/``. The run directory may be a bucket path,
``s3://BUCKET/PATH`` or ``gs://BUCKET/PATH``: checkpoints, metrics (rolled segments
``DIR/metrics/NNNNNN.jsonl``, uploaded every ``logging.flush_s`` seconds and before every
checkpoint) and the run's other files then go straight to the bucket, and no host needs a shared
file system. The device count comes from the
environment (e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on CPU).

SIGTERM saves a checkpoint at the step reached and stops; the exit status is then 0, or CODE with
``--exit-code-on-stop CODE`` (e.g. 143 for a scheduler that must restart the unfinished job).

Exit status (what a scheduler should do next):

  0    finished, or stopped as asked (SIGTERM; see --exit-code-on-stop)
  2    a configuration or input error: a restart cannot help
  3    the run cannot go on without a person (a non-finite loss)
  75   a failure that a restart may cure: peers that did not all start within
       distributed.init_timeout_s, a lost or hung peer (train.watchdog_s: the stacks go to
       RUN_DIR/hangs/), storage errors, remote reads that ran out of retries, runtime errors

A process killed by a signal (JAX's coordination service aborts a process whose peer was lost)
ends with 128 + the signal: schedulers treat that like 75.

Jobs written by ``olmax launch`` pass ``--attempt JOB.N`` (the job and its restart count: a later
attempt of a job takes over the run directory from an earlier one at once) and
``--expect-devices PLATFORM:N`` (the trainer refuses, exit 2, to run on another platform or device
count, e.g. on the CPU because the CUDA plugin is missing).
"""

from __future__ import annotations

import argparse
import os
import sys

from olmax.commands import HELP
from olmax.checkpoint.format import resolve_step_dir
from olmax.config import check_start
from olmax.errors import ConfigError, OlmaxError, RestartableError
from olmax.lockfile import parse_attempt
from olmax.store import run_location
from olmax.parallel.distributed import parse_expected_devices
from olmax.train.callbacks.run_lock import RunDirLockLost
from olmax.train.recipes import default_run_dir, load_recipe
from olmax.train import trainer as training   # looked up when run (tests replace the Trainer)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help=HELP["train"], description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", metavar="RECIPE", help="recipe YAML path or packaged recipe name")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument("--run-dir", default=None,
                   help="run directory, local or a bucket path (s3://BUCKET/PATH, gs://BUCKET/PATH; "
                        "default: runs/<recipe>-<UTC time>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or status lines")
    p.add_argument("--exit-code-on-stop", type=int, default=0, metavar="CODE",
                   help="exit status after a SIGTERM stop (checkpoint saved, run unfinished); "
                        "default 0")
    p.add_argument("--attempt", metavar="JOB.N", type=_attempt,
                   help="which start of a scheduled job this is: a job id and its restart count "
                        "(set by olmax launch); takes over the run directory from an earlier "
                        "attempt of the same job at once")
    p.add_argument("--expect-devices", metavar="PLATFORM:N", type=_expected_devices,
                   help="refuse to train unless JAX finds N devices of PLATFORM (cpu, gpu, tpu); "
                        "set by olmax launch")
    p.set_defaults(func=run)


RESOURCE_TRACKER_QUIET = "ignore::UserWarning:multiprocessing.resource_tracker"


def _attempt(text: str) -> str:
    try:
        parse_attempt(text)
    except OlmaxError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("attempt ")) from None
    return text


def _expected_devices(text: str) -> tuple[str, int]:
    try:
        return parse_expected_devices(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--expect-devices ")) from None


def _holds_checkpoint(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a complete checkpoint to resume from."""
    try:
        resolve_step_dir(run_dir)
    except RestartableError:     # the store did not answer: a restart may see it
        raise
    except OlmaxError:
        return False
    return True


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
    if not 0 <= args.exit_code_on_stop <= 255:
        raise ConfigError(f"--exit-code-on-stop must be 0..255 (got {args.exit_code_on_stop})")
    cfg = load_recipe(args.recipe, args.overrides)
    check_start(cfg)
    run_dir = args.run_dir or default_run_dir(args.recipe)
    try:    # TensorStore (the checkpoints) takes UTF-8 paths only: refused before any work
        run_location(run_dir)     # a bucket path: s3:// or gs://, well formed
        os.path.abspath(run_dir).encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"--run-dir {os.path.abspath(run_dir)!r} is not UTF-8 text, which the "
                          f"checkpoint library needs; choose another run directory") from None
    if cfg.init.required == "resume":    # a recipe that continues a run: its checkpoint is here
        check_start(cfg, resumes=_holds_checkpoint(run_dir))
    # A run the watchdog (or a signal) ends with os._exit leaves the data workers' shared memory
    # and semaphores to multiprocessing's resource tracker, which frees them and would print a
    # warning per kind into the job's log after olmax's one line. The tracker takes its warning
    # filters from these options when it starts.
    if RESOURCE_TRACKER_QUIET not in sys.warnoptions:
        sys.warnoptions.append(RESOURCE_TRACKER_QUIET)
    from olmax.perf.step_price import step_pricer

    trainer = training.Trainer(cfg, run_dir, quiet=args.quiet, attempt=args.attempt,
                               expect_devices=args.expect_devices, step_pricer=step_pricer)
    try:
        summary = trainer.run()
    except RunDirLockLost as e:
        _superseded(e)
    if trainer.is_main:
        print(f"olmax train: done: {format_summary(summary)}", file=sys.stdout)
    return args.exit_code_on_stop if summary.get("stopped_early") else 0


def _superseded(e: RunDirLockLost) -> None:
    """A newer attempt (or another process) took the run directory over: the run is its now. The
    one line, then out at once with the restartable status. Nothing of this process may write to
    the run any more, and a save it still had in flight -- whose temporary directory the newer
    attempt removed -- may never finish: at interpreter exit Python would join its writer thread,
    and the process could hang there after its line."""
    from olmax.reporting import error_line, exit_code

    print(error_line("train", e), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(exit_code(e))
