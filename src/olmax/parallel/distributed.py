"""Multi-process start-up: ``jax.distributed.initialize`` from the config or the environment.

With ``distributed.coordinator`` / ``num_processes`` / ``process_id`` set, those are passed on;
otherwise, when the environment describes a multi-process job (``OLMAX_COORDINATOR`` /
``OLMAX_NUM_PROCESSES`` / ``OLMAX_PROCESS_ID``, or a cluster JAX detects itself: SLURM, Open MPI,
Kubernetes/TPU pods), ``jax.distributed.initialize()`` auto-detects. A single process needs nothing.
Must run before any other JAX call that touches devices.
"""

from __future__ import annotations

import os

import jax

from olmax.config import ConfigError, DistributedConfig

_ENV = {"coordinator": "OLMAX_COORDINATOR", "num_processes": "OLMAX_NUM_PROCESSES",
        "process_id": "OLMAX_PROCESS_ID"}
_CLUSTER_HINTS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                  "JAX_COORDINATOR_ADDRESS")


def _resolved(cfg: DistributedConfig) -> dict:
    out = {}
    for field, env in _ENV.items():
        value = getattr(cfg, field)
        if value is None and os.environ.get(env):
            raw = os.environ[env]
            try:
                value = raw if field == "coordinator" else int(raw)
            except ValueError:
                raise ConfigError(f"{env}: expected an integer, got {raw!r}") from None
        out[field] = value
    return out


def maybe_initialize(cfg: DistributedConfig) -> bool:
    """Initialise ``jax.distributed`` when a multi-process job is configured; True if it did."""
    args = _resolved(cfg)
    explicit = any(v is not None for v in args.values())
    if explicit:
        if args["num_processes"] in (None, 1) and args["coordinator"] is None:
            return False
        missing = [k for k, v in args.items() if v is None]
        if missing:
            raise ConfigError(f"distributed.{missing[0]} must be set together with the other "
                              f"distributed.* settings")
        jax.distributed.initialize(coordinator_address=args["coordinator"],
                                   num_processes=args["num_processes"],
                                   process_id=args["process_id"])
        return True
    if any(os.environ.get(h) for h in _CLUSTER_HINTS):
        try:
            jax.distributed.initialize()
            return True
        except (RuntimeError, ValueError):
            if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
                raise
    return False
