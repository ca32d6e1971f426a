"""The launch targets: one class and one entry in :data:`TARGETS` per kind of cluster.

A target declares its command-line options, turns them into a :class:`~olmax.launch.job.Job`
(``job``: hosts, devices, platform, run directory), writes the file (``render``), says how to
start it (``start_hint``) and what is still to be set by hand (``todo``). ``olmax launch`` does
the rest the same way for all: the recipe's check (:func:`olmax.launch.job.check_job`) and the
atomic write.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from olmax.errors import ConfigError
from olmax.store import is_bucket, run_location
from olmax.launch import k8s, slurm, tpu
from olmax.launch.job import Fit, Job, check_name, default_name, parse_env
from olmax.topology import TpuSlice, parse_tpu
from olmax.hardware import GPU_VENDORS
from olmax.train.recipes import default_run_dir


class Target:
    """What a launch target provides (see the module docstring)."""

    name = ""
    help = ""
    executable = True         # the written file is a script
    recipe_travels = False    # a recipe file path is read at the same path where the job runs

    def add_options(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", metavar="FILE", help="the file to write (required)")
        p.add_argument("--force", action="store_true", help="replace an existing --out file")
        p.add_argument("--run-dir", metavar="DIR", help="run directory on shared storage")
        p.add_argument("--name", help="job name (default: olmax-<recipe>)")
        p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                       help="an environment variable for every process (repeatable)")
        p.add_argument("--max-restarts", type=int, default=10, metavar="N",
                       help="restarts of the whole job after failures a restart may cure (exit "
                            "status 75, a signal); never after 2 or 3 (default 10)")

    def job(self, args: argparse.Namespace, **shape) -> Job:
        return Job(recipe=args.recipe, overrides=tuple(args.overrides), name=self.job_name(args),
                   env=parse_env(args.env), grace_s=getattr(args, "grace", 300),
                   max_restarts=args.max_restarts, command_line=getattr(args, "command_line", ""),
                   gpu_vendor=getattr(args, "gpu_vendor", "nvidia"), **shape)

    @staticmethod
    def job_name(args: argparse.Namespace) -> str:
        return check_name(args.name or default_name(args.recipe))

    @staticmethod
    def add_tpu_options(p: argparse.ArgumentParser, topology: str, slices: str) -> None:
        p.add_argument("--topology", metavar="NAME", help=topology)
        p.add_argument("--num-slices", type=int, default=1, metavar="N", help=slices)

    @staticmethod
    def tpu_hosts(args: argparse.Namespace) -> tuple[TpuSlice, int]:
        """The slice ``--topology`` names and the hosts of ``--num-slices`` of them."""
        if args.num_slices < 1:
            raise ConfigError(f"--num-slices must be at least 1 (got {args.num_slices})")
        s = parse_tpu(args.topology)
        return s, s.hosts * args.num_slices

    def render(self, job: Job, fit: Fit, args: argparse.Namespace) -> str:
        raise NotImplementedError

    def start_hint(self, out: str) -> str:
        raise NotImplementedError

    def todo(self, args: argparse.Namespace) -> list[str]:
        return []


class _Nodes(Target):
    """Targets of nodes with GPUs (or CPUs): ``--nodes``, ``--gpus-per-node``."""

    nodes_help = "nodes"

    def add_options(self, p: argparse.ArgumentParser) -> None:
        super().add_options(p)
        p.add_argument("--grace", type=int, default=300, metavar="SECONDS",
                       help="time from the stop signal to the kill: one step plus one save "
                            "(default 300)")
        p.add_argument("--nodes", type=int, metavar="N", help=self.nodes_help)
        p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                       help="GPUs per node (default 8; 0: CPU nodes)")
        p.add_argument("--gpu-vendor", choices=GPU_VENDORS, default="nvidia",
                       help="whose GPUs: the JAX platform the job pins and the resource it asks "
                            "for (default nvidia)")
        p.add_argument("--cpu-devices-per-node", type=int, default=None, metavar="N",
                       help="CPU nodes with N JAX devices each (a rehearsal on CPUs)")

    @staticmethod
    def devices(args: argparse.Namespace) -> tuple[str, int]:
        """(platform, devices per node) of ``--gpus-per-node`` / ``--cpu-devices-per-node``."""
        cpus, gpus = args.cpu_devices_per_node, args.gpus_per_node
        if cpus is not None:
            if gpus:
                raise ConfigError("--cpu-devices-per-node and --gpus-per-node exclude each other")
            if cpus < 1:
                raise ConfigError(f"--cpu-devices-per-node must be at least 1 (got {cpus})")
            return "cpu", cpus
        gpus = 8 if gpus is None else gpus
        if gpus < 0:
            raise ConfigError(f"--gpus-per-node must be >= 0 (got {gpus})")
        return ("gpu", gpus) if gpus else ("cpu", 1)

    @staticmethod
    def nodes(args: argparse.Namespace) -> int:
        if args.nodes is None:
            raise ConfigError("--nodes N is required")
        return args.nodes


class Slurm(_Nodes):
    name = "slurm"
    recipe_travels = True
    nodes_help = "nodes (required)"
    help = """\
an sbatch script: the training processes through srun, one per node (each drives every GPU of its
node) or one per GPU (--processes-per-node gpus); JAX's SLURM detection connects them. --exclusive,
--requeue; USR1 GRACE seconds before the time limit makes every process save a checkpoint and the
job requeue itself; after a preemption (SIGTERM) the processes save and Slurm requeues the job.
After a failure a restart may cure (exit status 75: a crash, a hang the watchdog caught, peers that
did not start; or a signal) the job requeues itself, up to --max-restarts times, and with
--exclude-failed-node resubmits itself without the node whose process failed first; after exit
status 2 (configuration or input error) or 3 (needs a person) it stops. Submit with `sbatch FILE`.

Set by hand (SET-ME in the file, or the options below): partition / account / time limit
(--partition, --account, --time); the software on every node (`olmax` on PATH: --setup 'source
/shared/venv/bin/activate' or a module, run before training with `set +u`; or a container:
--srun-option=--container-image=IMAGE --srun-option=--container-mounts=/shared:/shared, mounting
the run directory and the data, where olmax is looked for inside the container); NCCL's network
settings if NCCL does not find the fabric (--env NCCL_IB_HCA=...); the run directory (--run-dir,
required for more than one node) on storage every node sees; a cluster GraceTime / KillWait longer
than one step plus one checkpoint save, for preemptions.
"""

    def add_options(self, p: argparse.ArgumentParser) -> None:
        super().add_options(p)
        p.add_argument("--processes-per-node", choices=("1", "gpus"), default="1",
                       help="one process per node driving its GPUs (default), or one per GPU")
        p.add_argument("--partition")
        p.add_argument("--account")
        p.add_argument("--time", metavar="LIMIT", help="time limit, e.g. 2-00:00:00")
        p.add_argument("--setup", action="append", default=[], metavar="LINE",
                       help="a shell line run before training, e.g. activating a venv (repeatable)")
        p.add_argument("--sbatch-option", action="append", default=[], metavar="OPT",
                       help="an extra #SBATCH option, e.g. --sbatch-option=--qos=high (repeatable)")
        p.add_argument("--srun-option", action="append", default=[], metavar="OPT",
                       help="an extra srun option, e.g. --srun-option=--container-image=IMG "
                            "(repeatable)")
        p.add_argument("--exclude-failed-node", action="store_true",
                       help="after a failure, resubmit without the node whose process failed first")

    def job(self, args: argparse.Namespace, **_) -> Job:
        nodes = self.nodes(args)
        platform, per_node = self.devices(args)
        per_process = 1
        if args.processes_per_node == "gpus":
            if platform != "gpu":
                raise ConfigError("--processes-per-node gpus needs GPUs (--gpus-per-node G)")
            per_process = per_node
        if args.run_dir is None and nodes > 1:
            raise ConfigError(f"--run-dir DIR is required for {nodes} nodes: a directory every node "
                              "sees (a default would name a new run each time the script is written)")
        if args.run_dir and is_bucket(run_location(args.run_dir)):
            raise ConfigError(f"--run-dir {args.run_dir}: a bucket path; the Slurm job script keeps "
                              f"its exit files in the run directory: give a directory every node "
                              f"sees (or use --target k8s or tpu-vm, which take bucket paths)")
        run_dir = os.path.abspath(args.run_dir or default_run_dir(args.recipe))
        return super().job(args, run_dir=run_dir, nodes=nodes, devices_per_node=per_node,
                           platform=platform, processes_per_node=per_process)

    def render(self, job: Job, fit: Fit, args: argparse.Namespace) -> str:
        return slurm.render(job, fit, partition=args.partition, account=args.account,
                            time_limit=args.time, sbatch_options=args.sbatch_option,
                            srun_options=args.srun_option, setup=args.setup,
                            exclude_failed_node=args.exclude_failed_node)

    def start_hint(self, out: str) -> str:
        return f"sbatch {out}"


def _given_run_dir(args: argparse.Namespace) -> str | None:
    """``--run-dir`` as given; a bucket path checked and normalised (``s3://``, ``gs://``)."""
    if args.run_dir and is_bucket(run_location(args.run_dir)):   # run_location: checked
        return str(run_location(args.run_dir))
    return args.run_dir


class K8s(_Nodes):
    name = "k8s"
    executable = False
    nodes_help = "pods (required for GPUs)"
    help = """\
a Kubernetes manifest (YAML): a JobSet (default; the JobSet controller must be installed) or an
Indexed Job with a headless Service (--controller job), one pod per node (GPUs: --gpus-per-node) or
per TPU slice host (--topology v5p-128 or v5p:4x4x4: GKE TPU node selectors, google.com/tpu, one
node pool per slice; --num-slices N for several slices over the data-center network). Every pod
gets OLMAX_COORDINATOR (pod 0) and OLMAX_NUM_PROCESSES; the process id is the pod's
JOB_COMPLETION_INDEX. A failure restarts every pod together (JobSet), up to --max-restarts times;
exit status 2 or 3 (configuration or input error, needs a person) stops the job for good; a
preempted pod saves a checkpoint and exits 143, restarted without counting. Start with
`kubectl apply -f FILE`.

Set by hand (SET-ME in the file, or the options below): the container image with olmax (--image);
a ReadWriteMany volume claim for the run directory (--volume-claim, mounted at --mount-path); the
namespace, node selectors, Kueue queue and requests your cluster needs (--namespace,
--node-selector, --queue, --cpu, --memory); the GPU fabric (--resource rdma/ib=1, --annotation,
--host-network, --patch FILE: a strategic-merge patch of the pod template; --env NCCL_...=...).
"""

    def add_options(self, p: argparse.ArgumentParser) -> None:
        super().add_options(p)
        self.add_tpu_options(p, "a GKE TPU slice instead of GPUs, e.g. v5p-128 or v5p:4x4x4",
                             "TPU slices, the data axis across them (default 1)")
        p.add_argument("--controller", choices=k8s.CONTROLLERS, default="jobset",
                       help="jobset (restarts every pod together; default) or job (batch/v1)")
        p.add_argument("--image", help="container image with olmax installed")
        p.add_argument("--namespace")
        p.add_argument("--queue", metavar="NAME", help="Kueue LocalQueue (kueue.x-k8s.io/queue-name)")
        p.add_argument("--volume-claim", metavar="PVC",
                       help="ReadWriteMany claim holding the run directory")
        p.add_argument("--mount-path", default="/mnt/runs", metavar="PATH",
                       help="where the claim is mounted (default /mnt/runs)")
        p.add_argument("--node-selector", action="append", default=[], metavar="LABEL=VALUE",
                       help="a node selector (repeatable)")
        p.add_argument("--port", type=int, default=8476, help="coordinator port (default 8476)")
        p.add_argument("--cpu", metavar="QUANTITY", help="CPU request per pod, e.g. 200")
        p.add_argument("--memory", metavar="QUANTITY", help="memory request per pod, e.g. 1600Gi")
        p.add_argument("--resource", action="append", default=[], metavar="NAME=N",
                       help="an extra resource limit per pod, e.g. rdma/ib=1 (repeatable)")
        p.add_argument("--annotation", action="append", default=[], metavar="KEY=VALUE",
                       help="a pod annotation, e.g. for a multi-network fabric (repeatable)")
        p.add_argument("--host-network", action="store_true",
                       help="pods on the node's network (hostNetwork, ClusterFirstWithHostNet DNS)")
        p.add_argument("--patch", metavar="FILE",
                       help="a strategic-merge patch (YAML) of the pod template: sidecars, volumes")

    def job(self, args: argparse.Namespace, **_) -> Job:
        run_dir = (_given_run_dir(args) or
                   f"{args.mount_path.rstrip('/')}/{Path(default_run_dir(args.recipe)).name}")
        if args.num_slices > 1 and args.controller != "jobset":
            raise ConfigError("--num-slices needs --controller jobset (one replicated job per slice)")
        if args.topology:
            s, hosts = self.tpu_hosts(args)
            if args.nodes not in (None, hosts):
                raise ConfigError(f"--nodes {args.nodes} disagrees with --topology {s.name} "
                                  f"({hosts} hosts)")
            return super().job(args, run_dir=run_dir, nodes=hosts, platform="tpu",
                               devices_per_node=s.devices_per_host, num_slices=args.num_slices)
        if args.num_slices != 1:
            raise ConfigError("--num-slices needs a TPU --topology (GPU nodes: --nodes)")
        platform, per_node = self.devices(args)
        return super().job(args, run_dir=run_dir, nodes=self.nodes(args), platform=platform,
                           devices_per_node=per_node)

    def render(self, job: Job, fit: Fit, args: argparse.Namespace) -> str:
        return k8s.render(job, fit, tpu=parse_tpu(args.topology) if args.topology else None,
                          controller=args.controller, image=args.image, namespace=args.namespace,
                          volume_claim=args.volume_claim, mount_path=args.mount_path,
                          node_selectors=args.node_selector, port=args.port, queue=args.queue,
                          cpu=args.cpu, memory=args.memory, resources=args.resource,
                          annotations=args.annotation, host_network=args.host_network,
                          patch=k8s.read_patch(args.patch) if args.patch else None)

    def start_hint(self, out: str) -> str:
        return f"kubectl apply -f {out}"

    def todo(self, args: argparse.Namespace) -> list[str]:
        need = [("--image", args.image)]
        if not (args.run_dir and is_bucket(args.run_dir)):    # a bucket run dir needs no volume
            need.append(("--volume-claim", args.volume_claim))
        return [o for o, v in need if not v]


class TpuVm(Target):
    name = "tpu-vm"
    help = """\
a script for TPU VM slices (--topology v5p-128 or v5p:4x4x4, v4-32, v5litepod-16, v6e-16, ...):
`bash FILE` starts one `olmax train` process per worker through `gcloud compute tpus tpu-vm ssh
--worker=all`, in the background under a supervisor that restarts it after a failure a restart
may cure (exit status 75, a signal; up to --max-restarts times; not after 2 or 3), with a log per
worker in RUN_DIR/logs; `bash FILE logs` follows worker 0; `bash FILE stop` makes every worker save
a checkpoint and stop. Running it again resumes from the last checkpoint. --num-slices N: the
slices TPU_NAME-0 .. TPU_NAME-<N-1> of a multi-slice queued resource.

Set by hand (SET-ME in the file, or the options below): the slice's name and zone (--tpu-name, --zone,
--project; or TPU_NAME / ZONE / PROJECT in the environment); the software on every worker (`olmax` on
PATH: --setup 'source ~/venv/bin/activate'); a run directory every worker sees (required for
multi-host slices): a bucket path, --run-dir gs://BUCKET/PATH (no shared file system: checkpoints,
metrics and the run lock go to the bucket, the workers' logs stay on each worker), or a folder on
NFS, Filestore or a gcsfuse mount. The slice is created beforehand.
"""

    def add_options(self, p: argparse.ArgumentParser) -> None:
        super().add_options(p)
        self.add_tpu_options(p, "TPU slice, e.g. v5p-128 or v5p:4x4x4 (required)",
                             "slices of a multi-slice queued resource (default 1)")
        p.add_argument("--tpu-name")
        p.add_argument("--zone")
        p.add_argument("--project")
        p.add_argument("--setup", action="append", default=[], metavar="LINE",
                       help="a shell line each worker runs before training (repeatable)")

    def job(self, args: argparse.Namespace, **_) -> Job:
        if not args.topology:
            raise ConfigError("--topology NAME is required (a TPU slice, e.g. v5p-128 or v5p:4x4x4)")
        s, hosts = self.tpu_hosts(args)
        run_dir = _given_run_dir(args)
        if run_dir is None:
            if hosts > 1:
                raise ConfigError(f"--run-dir DIR is required for {s.name} ({hosts} workers): a "
                                  "bucket path (gs://BUCKET/PATH) or a directory every worker sees "
                                  "(NFS, Filestore, gcsfuse)")
            run_dir = f"runs/{Path(default_run_dir(args.recipe)).name}"
        return super().job(args, run_dir=run_dir, nodes=hosts, platform="tpu",
                           devices_per_node=s.devices_per_host, num_slices=args.num_slices)

    def render(self, job: Job, fit: Fit, args: argparse.Namespace) -> str:
        return tpu.render_vm(job, fit, parse_tpu(args.topology), tpu_name=args.tpu_name,
                             zone=args.zone, project=args.project, setup=args.setup)

    def start_hint(self, out: str) -> str:
        return f"bash {out}"

    def todo(self, args: argparse.Namespace) -> list[str]:
        return [o for o, v in (("--tpu-name", args.tpu_name), ("--zone", args.zone)) if not v]


TARGETS: dict[str, Target] = {"slurm": Slurm(), "k8s": K8s(), "tpu-vm": TpuVm()}

__all__ = ["TARGETS", "Target"]
