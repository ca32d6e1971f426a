"""``olmax launch slurm|k8s|tpu-vm RECIPE [key=value ...] ... --out FILE``: a ready-to-submit job.

Writes an ``sbatch`` script (``slurm``), a Kubernetes manifest (``k8s``: a JobSet, or an Indexed
Job with a headless Service) or a TPU VM script (``tpu-vm``) that runs ``olmax train RECIPE
--run-dir DIR key=value ...`` on every node / pod / TPU worker, with the recipe and overrides
exactly as given, after the settings a launched run gets unless the recipe or the overrides set
them (``distributed.init_timeout_s=1800``, ``train.watchdog_s=1800``, and on GPUs over several
nodes the HSDP layout ``mesh.data=<nodes> mesh.fsdp=<GPUs per node>``; on several TPU slices
``mesh.data=<slices>``). Every job pins the JAX platform and its device count, restarts the whole
job after a failure a restart may cure (exit status 75, a signal) and stops for good after exit
status 2 or 3. The recipe and overrides are validated first, and so is their fit on the devices
(mesh, global batch, micro-batches): a bad key is one line and a non-zero exit, and nothing is
written. The run directory must be on storage every process sees; running the job again resumes
from its last checkpoint. `olmax launch TARGET --help` lists what each target leaves for you to
set by hand (marked SET-ME in the file).
"""

from __future__ import annotations

import argparse
import sys

from olmax.commands import HELP
from olmax.errors import ConfigError
from olmax.launch import job as launch_job
from olmax.launch.job import shell_join
from olmax.launch.targets import TARGETS


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("launch", help=HELP["launch"],
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="target", metavar="TARGET")
    sub.required = True
    for name, target in TARGETS.items():
        sp = sub.add_parser(name, help=target.help.split(":")[0], description=target.help,
                            allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("recipe", metavar="RECIPE", help="recipe YAML path or packaged recipe name")
        sp.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, passed through unchanged")
        target.add_options(sp)
        sp.set_defaults(func=run, options=sp)


def command_line(args: argparse.Namespace) -> str:
    """The command, normalised (options after the overrides), for the generated file's header."""
    argv = ["olmax", "launch", args.target, args.recipe, *args.overrides]
    for action in args.options._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value == action.default or action.default == argparse.SUPPRESS:
            continue
        for v in value if isinstance(value, list) else [value]:
            argv.append(f"{action.option_strings[0]}={v}")
    return shell_join(argv)


def run(args: argparse.Namespace) -> int:
    target = TARGETS[args.target]
    if not args.out:
        raise ConfigError("--out FILE is required")
    launch_job.check_output(args.out, args.recipe, force=args.force)
    args.command_line = command_line(args)
    job = target.job(args)
    fit = launch_job.check_job(job, recipe_travels=target.recipe_travels)
    text = target.render(job, fit, args)
    out = launch_job.write_output(args.out, text, executable=target.executable, force=args.force)
    print(f"olmax launch {target.name}: wrote {out}: {args.recipe}, {fit.describe(job)}; "
          f"run dir {job.run_dir}")
    if fit.defaults:
        print(f"  launch settings: {' '.join(fit.defaults)} (set them in the recipe or the "
              "overrides to choose otherwise)")
    print(f"  start: {target.start_hint(str(out))}")
    todo = target.todo(args)
    if todo:
        print(f"  still {launch_job.SET_ME} in the file: {', '.join(todo)} (edit it, or regenerate "
              "with these options)")
    for note in fit.notes:
        print(f"  note: {note}", file=sys.stderr)
    return 0
