"""``olmax launch slurm|k8s|tpu-vm RECIPE [key=value ...] ... --out FILE``: a ready-to-submit job.

Writes an ``sbatch`` script (``slurm``), a Kubernetes manifest (``k8s``: an Indexed Job with a
headless Service) or a TPU VM script (``tpu-vm``) that runs ``olmax train RECIPE --run-dir DIR
key=value ...`` once per node / pod / TPU worker, with the recipe and overrides exactly as given.
The recipe and overrides are validated first, and so is their fit on the devices (mesh, global
batch, micro-batches): a bad key is one line and a non-zero exit, and nothing is written. The run
directory must be on storage every process sees; running the job again resumes from its last
checkpoint. `olmax launch TARGET --help` lists what each target leaves for you to set by hand
(marked SET-ME in the file).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from olmax.commands import HELP
from olmax.commands.train import default_run_dir
from olmax.config import ConfigError
from olmax.launch import job as launch_job
from olmax.launch import k8s, slurm, tpu
from olmax.launch.job import shell_join

SLURM_HELP = """\
an sbatch script: one `olmax train` process per node via srun; JAX's SLURM detection connects
them and each drives every GPU of its node. --exclusive, --requeue; USR1 GRACE seconds before the
time limit makes every process save a checkpoint and the job requeue itself; after a preemption
(SIGTERM) the processes save and Slurm requeues the job. Submit with `sbatch FILE`.

Set by hand (SET-ME in the file, or the options below): partition / account / time limit
(--partition, --account, --time); the software on every node (`olmax` on PATH: --setup 'source
/shared/venv/bin/activate', a module, or a container via --srun-option=--container-image=...);
NCCL's network settings if NCCL does not find the fabric (--env NCCL_IB_HCA=...); the run directory
(--run-dir) on storage every node sees; a cluster GraceTime / KillWait longer than one step plus one
checkpoint save, for preemptions.
"""

K8S_HELP = """\
a Kubernetes manifest (YAML): a headless Service and an Indexed Job (batch/v1) with one pod per node
(GPUs: --gpus-per-node) or per TPU slice host (--topology v5p-64: GKE TPU node selectors and
google.com/tpu). Every pod gets OLMAX_COORDINATOR (pod 0 through the Service) and OLMAX_NUM_PROCESSES;
the process id is the pod's JOB_COMPLETION_INDEX. A preempted pod saves a checkpoint and exits 143;
the pod failure policy restarts the pods without counting it. Start with `kubectl apply -f FILE`.

Set by hand (SET-ME in the file, or the options below): the container image with olmax (--image);
a ReadWriteMany volume claim for the run directory (--volume-claim, mounted at --mount-path); the
namespace, node selectors and tolerations your cluster needs (--namespace, --node-selector); NCCL
network settings (--env NCCL_...=...).
"""

TPU_VM_HELP = """\
a script for a TPU VM slice (--topology v5p-64, v4-32, v5litepod-16, v6e-16, ...): `bash FILE` starts
one `olmax train` process per worker through `gcloud compute tpus tpu-vm ssh --worker=all`, in the
background with a log per worker in RUN_DIR/logs; `bash FILE logs` follows worker 0; `bash FILE stop`
makes every worker save a checkpoint and stop. Running it again resumes from the last checkpoint.

Set by hand (SET-ME in the file, or the options below): the slice's name and zone (--tpu-name, --zone,
--project; or TPU_NAME / ZONE / PROJECT in the environment); the software on every worker (`olmax` on
PATH: --setup 'source ~/venv/bin/activate'); a run directory every worker sees (--run-dir on NFS,
Filestore or a gcsfuse mount; required for multi-host slices). The slice is created beforehand.
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="FILE", help="the file to write (required)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--run-dir", metavar="DIR", help="run directory on shared storage")
    p.add_argument("--name", help="job name (default: olmax-<recipe>)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for every process (repeatable)")


def _nodes(p: argparse.ArgumentParser, what: str) -> None:
    _common(p)
    p.add_argument("--grace", type=int, default=300, metavar="SECONDS",
                   help="time from the stop signal to the kill: one step plus one save (default 300)")
    p.add_argument("--nodes", type=int, metavar="N", help=f"{what}, one process each")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="G", help="default 8; 0: CPUs")


def _slurm_options(p: argparse.ArgumentParser) -> None:
    _nodes(p, "nodes (required)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time", metavar="LIMIT", help="time limit, e.g. 2-00:00:00")
    p.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line run before training, e.g. activating a venv (repeatable)")
    p.add_argument("--sbatch-option", action="append", default=[], metavar="OPT",
                   help="an extra #SBATCH option, e.g. --sbatch-option=--qos=high (repeatable)")
    p.add_argument("--srun-option", action="append", default=[], metavar="OPT",
                   help="an extra srun option, e.g. --srun-option=--container-image=IMG (repeatable)")


def _k8s_options(p: argparse.ArgumentParser) -> None:
    _nodes(p, "pods (required for GPUs)")
    p.add_argument("--topology", metavar="NAME", help="a GKE TPU slice instead of GPUs, e.g. v5p-64")
    p.add_argument("--image", help="container image with olmax installed")
    p.add_argument("--namespace")
    p.add_argument("--volume-claim", metavar="PVC", help="ReadWriteMany claim holding the run directory")
    p.add_argument("--mount-path", default="/mnt/runs", metavar="PATH",
                   help="where the claim is mounted (default /mnt/runs)")
    p.add_argument("--node-selector", action="append", default=[], metavar="LABEL=VALUE",
                   help="a node selector (repeatable)")
    p.add_argument("--port", type=int, default=8476, help="coordinator port (default 8476)")
    p.add_argument("--max-restarts", type=int, default=10, metavar="N",
                   help="restarts of the whole run after failures, preemptions not counted (default 10)")


def _tpu_vm_options(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--topology", metavar="NAME", help="TPU accelerator type, e.g. v5p-64 (required)")
    p.add_argument("--tpu-name")
    p.add_argument("--zone")
    p.add_argument("--project")
    p.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line each worker runs before training (repeatable)")


TARGETS = {"slurm": (SLURM_HELP, _slurm_options), "k8s": (K8S_HELP, _k8s_options),
           "tpu-vm": (TPU_VM_HELP, _tpu_vm_options)}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("launch", help=HELP["launch"],
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="target", metavar="TARGET")
    sub.required = True
    for name, (text, options) in TARGETS.items():
        sp = sub.add_parser(name, help=text.split(":")[0], description=text, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("recipe", metavar="RECIPE", help="recipe YAML path or packaged recipe name")
        sp.add_argument("overrides", nargs=argparse.REMAINDER, metavar="key=value",
                        help="config overrides, passed through unchanged")
        options(sp)
        sp.set_defaults(func=run)


def _options_parser(target: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"olmax launch {target}", add_help=False, allow_abbrev=False,
                                exit_on_error=False)
    TARGETS[target][1](p)
    return p


def split_options(args: argparse.Namespace) -> argparse.ArgumentParser:
    """Options may follow the overrides (``RECIPE key=value --nodes 2``): parse them out."""
    parser = _options_parser(args.target)
    try:
        _, rest = parser.parse_known_args(list(args.overrides), namespace=args)
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from None
    for item in rest:
        if item.startswith("-"):
            raise ConfigError(f"unknown option '{item}'")
    args.overrides = rest
    return parser


def command_line(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The command, normalised (options after the overrides), for the generated file's header."""
    argv = ["olmax", "launch", args.target, args.recipe, *args.overrides]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value == action.default:
            continue
        for v in value if isinstance(value, list) else [value]:
            argv.append(f"{action.option_strings[0]}={v}")
    return shell_join(argv)


def run(args: argparse.Namespace) -> int:
    parser = split_options(args)
    if not args.out:
        raise ConfigError("--out FILE is required")
    launch_job.check_output(args.out, args.recipe, force=args.force)
    target = args.target
    tpu_slice = tpu.parse_topology(args.topology) if getattr(args, "topology", None) else None
    if target == "tpu-vm" and tpu_slice is None:
        raise ConfigError("--topology NAME is required (a TPU accelerator type, e.g. v5p-64)")
    if tpu_slice is not None:
        if getattr(args, "nodes", None) not in (None, tpu_slice.hosts):
            raise ConfigError(f"--nodes {args.nodes} disagrees with --topology {tpu_slice.name} "
                              f"({tpu_slice.hosts} hosts)")
        nodes, per_node = tpu_slice.hosts, tpu_slice.chips_per_host
    else:
        if args.nodes is None:
            raise ConfigError("--nodes N is required")
        nodes, per_node = args.nodes, args.gpus_per_node
        if per_node < 0:
            raise ConfigError(f"--gpus-per-node must be >= 0 (got {per_node})")
    stem = Path(default_run_dir(args.recipe)).name
    run_dir = args.run_dir
    if target == "slurm":
        run_dir = os.path.abspath(run_dir or default_run_dir(args.recipe))
    elif target == "k8s":
        run_dir = run_dir or f"{args.mount_path.rstrip('/')}/{stem}"
    elif run_dir is None:
        if tpu_slice.hosts > 1:
            raise ConfigError(f"--run-dir DIR is required for {tpu_slice.name} ({tpu_slice.hosts} "
                              "workers): a directory every worker sees (NFS, Filestore, gcsfuse)")
        run_dir = f"runs/{stem}"
    name = launch_job.check_name(args.name or launch_job.default_name(args.recipe))
    job = launch_job.Job(recipe=args.recipe, overrides=tuple(args.overrides), run_dir=run_dir,
                         nodes=nodes, devices_per_node=per_node or None, name=name,
                         env=launch_job.parse_env(args.env), grace_s=getattr(args, "grace", 300),
                         command_line=command_line(args, parser))
    fit = launch_job.check_job(job, recipe_travels=target == "slurm")
    if target == "slurm":
        text = slurm.render(job, fit, partition=args.partition, account=args.account,
                            time_limit=args.time, sbatch_options=args.sbatch_option,
                            srun_options=args.srun_option, setup=args.setup)
        how = f"sbatch {args.out}"
    elif target == "k8s":
        text = k8s.render(job, fit, tpu=tpu_slice, image=args.image, namespace=args.namespace,
                          volume_claim=args.volume_claim, mount_path=args.mount_path,
                          node_selectors=args.node_selector, port=args.port,
                          max_restarts=args.max_restarts)
        how = f"kubectl apply -f {args.out}"
    else:
        text = tpu.render_vm(job, fit, tpu_slice, tpu_name=args.tpu_name, zone=args.zone,
                             project=args.project, setup=args.setup)
        how = f"bash {args.out}"
    out = launch_job.write_output(args.out, text, executable=target != "k8s", force=args.force)
    todo = {"slurm": [],
            "k8s": [o for o, v in (("--image", args.image), ("--volume-claim", args.volume_claim))
                    if not v] if target == "k8s" else [],
            "tpu-vm": [o for o, v in (("--tpu-name", getattr(args, "tpu_name", None)),
                                      ("--zone", getattr(args, "zone", None))) if not v]}[target]
    print(f"olmax launch {target}: wrote {out}: {args.recipe}, {fit.describe(job)}; "
          f"run dir {job.run_dir}")
    print(f"  start: {how}")
    if todo:
        print(f"  still {launch_job.SET_ME} in the file: {', '.join(todo)} (edit it, or regenerate "
              "with these options)")
    for note in fit.notes:
        print(f"  note: {note}", file=sys.stderr)
    return 0
