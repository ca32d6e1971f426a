"""Multi-process start-up: ``jax.distributed.initialize`` from the config, environment or cluster.

Each of coordinator address, process count and process id comes from ``distributed.coordinator`` /
``num_processes`` / ``process_id``, else from ``OLMAX_COORDINATOR`` / ``OLMAX_NUM_PROCESSES`` /
``OLMAX_PROCESS_ID``; in a Kubernetes Indexed Job (or a JobSet) the process id defaults to the pod's
``JOB_COMPLETION_INDEX`` (``olmax launch k8s`` sets the coordinator, the headless service's name for
pod 0, and the count). What is still unset is left to JAX's own cluster detection (SLURM, Open MPI,
GKE TPU pods, Cloud TPU VMs: ``olmax launch tpu-vm`` sets only the count). With nothing set, a job
JAX recognises by its environment (``srun``, ``mpirun``, GKE TPU pods) is initialised from it; a
plain single process needs nothing.

Under ``srun`` with one process per node (``olmax launch slurm``), each process gets every GPU of
its node; JAX's SLURM detection alone would give it only GPU ``SLURM_LOCALID``.
Must run before any other JAX call that touches devices.
"""

from __future__ import annotations

import os
from typing import Mapping

import jax

from olmax.config import ConfigError, DistributedConfig

_ENV = {"coordinator": "OLMAX_COORDINATOR", "num_processes": "OLMAX_NUM_PROCESSES",
        "process_id": "OLMAX_PROCESS_ID"}
INDEX_ENV = "JOB_COMPLETION_INDEX"   # set by Kubernetes in every pod of an Indexed Job / JobSet
_CLUSTER_HINTS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                  "JAX_COORDINATOR_ADDRESS")


def _env_int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None


def resolve_settings(cfg: DistributedConfig, environ: Mapping[str, str] = os.environ) -> dict:
    """coordinator / num_processes / process_id from the config, else the ``OLMAX_*`` variables;
    the process id of an Indexed Job pod defaults to ``JOB_COMPLETION_INDEX`` once a coordinator or a
    count is set. None where neither says."""
    out = {}
    for field, env in _ENV.items():
        value = getattr(cfg, field)
        if value is None and environ.get(env):
            value = environ[env] if field == "coordinator" else _env_int(environ, env)
        out[field] = value
    if (out["process_id"] is None and environ.get(INDEX_ENV)
            and (out["coordinator"] is not None or out["num_processes"] is not None)):
        out["process_id"] = _env_int(environ, INDEX_ENV)
    return out


def slurm_local_device_ids(environ: Mapping[str, str] = os.environ) -> list[int] | None:
    """Every GPU this process sees when ``srun`` started one process per node; else None (JAX's
    default). Counted from ``CUDA_VISIBLE_DEVICES`` (which Slurm sets for the step), else
    ``SLURM_GPUS_ON_NODE``; ``JAX_LOCAL_DEVICE_IDS``, when set, wins (JAX reads it itself)."""
    if "SLURM_STEP_NODELIST" not in environ or environ.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    nodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
    if not tasks or tasks != nodes:
        return None
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if d.strip() and d.strip() != "NoDevFiles"]
    n = len(visible) or int(environ.get("SLURM_GPUS_ON_NODE", "0") or 0)
    return list(range(n)) if n else None


def maybe_initialize(cfg: DistributedConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """Initialise ``jax.distributed`` when a multi-process job is configured; True if it did."""
    args = resolve_settings(cfg, environ)
    local = slurm_local_device_ids(environ)
    if any(v is not None for v in args.values()):
        if args["num_processes"] in (None, 1) and args["coordinator"] is None:
            return False
        complete = all(v is not None for v in args.values())
        try:
            # All three given: no cluster detection (it could only disagree, or query an API).
            jax.distributed.initialize(coordinator_address=args["coordinator"],
                                       num_processes=args["num_processes"],
                                       process_id=args["process_id"], local_device_ids=local,
                                       cluster_detection_method="deactivate" if complete else None)
        except ValueError as e:
            missing = [k for k, v in args.items() if v is None]
            if missing and "defined" in str(e):
                raise ConfigError(f"distributed.{missing[0]} is not set (nor {_ENV[missing[0]]}) and "
                                  "no cluster environment JAX recognises supplies it") from None
            raise ConfigError(f"distributed: {e}") from None
        return True
    if any(environ.get(h) for h in _CLUSTER_HINTS):
        try:
            jax.distributed.initialize(local_device_ids=local)
            return True
        except (RuntimeError, ValueError):
            if int(environ.get("SLURM_NTASKS", "1")) > 1:
                raise
    return False
