"""Multi-process start-up: ``jax.distributed.initialize`` from the config, environment or cluster.

Each of coordinator address, process count and process id comes from ``distributed.coordinator`` /
``num_processes`` / ``process_id``, else from ``OLMAX_COORDINATOR`` / ``OLMAX_NUM_PROCESSES`` /
``OLMAX_PROCESS_ID``; in a Kubernetes Indexed Job (or a JobSet) the process id defaults to the pod's
``JOB_COMPLETION_INDEX`` (``olmax launch k8s`` sets the coordinator, the headless service's name for
pod 0, and the count). What is still unset is left to JAX's own cluster detection (SLURM, Open MPI,
GKE TPU pods, Cloud TPU VMs: ``olmax launch tpu-vm`` sets only the count). With nothing set, a job
JAX recognises by its environment (``srun``, ``mpirun``, GKE TPU pods) is initialised from it; a
plain single process needs nothing, and neither does one whose cluster environment names one
worker (:func:`hinted_processes`: a one-host TPU VM's ``TPU_WORKER_HOSTNAMES=localhost``, ``srun
-n 1``): JAX's cluster detection would ask a metadata server that a container or a VM outside
Google Cloud does not have. Where a multi-process job needs that detection and it fails, one line
says what it asked and what to set instead (exit 2 when the name does not resolve, 75 when a
server did not answer).

Under ``srun`` with one process per node (``olmax launch slurm``), each process gets every GPU of
its node; JAX's SLURM detection alone would give it only GPU ``SLURM_LOCALID``. In a multi-slice
TPU job (``MEGASCALE_NUM_SLICES`` > 1) the pod index counts within its slice, so the process id is
``MEGASCALE_SLICE_ID`` x processes per slice + the index.
Must run before any other JAX call that touches devices.

Start-up is bounded: a process whose peers have not all joined within
``distributed.init_timeout_s`` (default JAX's 300 s) prints one line and exits 75, so that the
scheduler starts the whole job again. (JAX itself would abort the process a minute later.)
:func:`check_devices` refuses to train on another platform or device count than the job was written
for (``olmax train --expect-devices gpu:512``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import Mapping

import jax

from olmax import process_exit
from olmax.config import DistributedConfig
from olmax.config.schema import check_coordinator
from olmax.errors import EXIT_RESTART, ConfigError, RestartableError
from olmax.hardware import GPU_VENDORS, VENDORS
from olmax.platforms import backend_of

DEFAULT_INIT_TIMEOUT_S = 300     # JAX's own
RESTART_EXIT_CODE = EXIT_RESTART
PLATFORMS = ("cpu", "gpu", "tpu")

_ENV = {"coordinator": "OLMAX_COORDINATOR", "num_processes": "OLMAX_NUM_PROCESSES",
        "process_id": "OLMAX_PROCESS_ID"}
INDEX_ENV = "JOB_COMPLETION_INDEX"   # set by Kubernetes in every pod of an Indexed Job / JobSet
_CLUSTER_HINTS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                  "TPU_PROCESS_ADDRESSES", "JAX_COORDINATOR_ADDRESS")
_SETTINGS = ("distributed.coordinator, distributed.num_processes and distributed.process_id (or "
             "OLMAX_COORDINATOR, OLMAX_NUM_PROCESSES, OLMAX_PROCESS_ID)")


def hinted_processes(environ: Mapping[str, str] = os.environ) -> int | None:
    """The process count the cluster environment names: Slurm's and Open MPI's task counts, a TPU
    slice's worker list (times its slices); the largest where several speak, None where none
    gives a count (``JAX_COORDINATOR_ADDRESS`` alone: JAX's detection must find the rest). A
    variable that is no count is a ConfigError naming it."""
    counts = []
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if environ.get(name):
            counts.append(_env_int(environ, name))
    hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES")
    if hosts:
        slices = _env_int(environ, "MEGASCALE_NUM_SLICES") if environ.get("MEGASCALE_NUM_SLICES") else 1
        counts.append(len([h for h in hosts.split(",") if h.strip()]) * slices)
    return max(counts) if counts else None


def _detection_failed(e: BaseException, hints: list[str], environ: Mapping[str, str]) -> Exception:
    """JAX's cluster detection failing, as one line: what it asked (a metadata server, a
    coordinator's name) and what to set instead. A name that does not resolve (no metadata
    server on this host: a container, a VM outside Google Cloud) is a configuration error; a
    server that did not answer may answer a restart (exit 75)."""
    text = " ".join(str(e).split())
    host = re.search(r"host='([^']+)'", text)
    url = re.search(r"with url: (\S+)", text)
    asked = (f"http://{host.group(1)}{url.group(1) if url else ''}" if host else
             (re.search(r"coordinator address (\S+)", text) or [None, None])[1])
    what = f"it asked {asked}" if asked else "it failed"
    cause = next((m.group(0) for m in re.finditer(
        r"Name or service not known|Temporary failure in name resolution|nodename nor servname|"
        r"Failed to resolve [^ ]+|Connection refused|timed out|Max retries exceeded", text)), None)
    resolve = any(k in text for k in ("NameResolution", "Failed to resolve", "Name or service not known",
                                      "Failed to recognize coordinator", "nodename nor servname",
                                      "gaierror"))
    n = hinted_processes(environ)
    line = (f"distributed: {n if n else 'several'} processes by {', '.join(hints)}, but JAX's cluster "
            f"detection failed: {what} ({cause or _first_line(text)}); set {_SETTINGS}, or "
            f"OLMAX_NUM_PROCESSES=1 for one process")
    return ConfigError(line) if resolve else RestartableError(line)


def _first_line(text: str) -> str:
    return text[:200] + ("..." if len(text) > 200 else "")


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
            value = (check_coordinator(environ[env], env) if field == "coordinator"
                     else _env_int(environ, env))
        out[field] = value
    if (out["process_id"] is None and environ.get(INDEX_ENV)
            and (out["coordinator"] is not None or out["num_processes"] is not None)):
        out["process_id"] = _env_int(environ, INDEX_ENV)
        slices = _env_int(environ, "MEGASCALE_NUM_SLICES") if environ.get("MEGASCALE_NUM_SLICES") else 1
        if slices > 1 and out["num_processes"] is not None and environ.get("MEGASCALE_SLICE_ID"):
            per_slice = out["num_processes"] // slices
            out["process_id"] += _env_int(environ, "MEGASCALE_SLICE_ID") * per_slice
    return out


def slurm_local_device_ids(environ: Mapping[str, str] = os.environ) -> list[int] | None:
    """Every GPU this process sees when ``srun`` started one process per node; else None (JAX's
    default). Counted from the GPU vendors' visible-devices variable (Slurm sets
    ``CUDA_VISIBLE_DEVICES`` or ``ROCR_VISIBLE_DEVICES`` for the step: :mod:`olmax.hardware`), else
    ``SLURM_GPUS_ON_NODE``; ``JAX_LOCAL_DEVICE_IDS``, when set, wins (JAX reads it itself)."""
    if "SLURM_STEP_NODELIST" not in environ or environ.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    nodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
    if not tasks or tasks != nodes:
        return None
    visible: list[str] = []
    for vendor in GPU_VENDORS:
        ids = environ.get(VENDORS[vendor].visible_devices_env or "", "")
        visible = [d for d in ids.split(",") if d.strip() and d.strip() != "NoDevFiles"]
        if visible:
            break
    n = len(visible) or int(environ.get("SLURM_GPUS_ON_NODE", "0") or 0)
    return list(range(n)) if n else None


class _StartupDeadline:
    """Exit 75 with one line unless :meth:`cancel` is called within ``seconds``."""

    def __init__(self, seconds: float, where: str, who: str) -> None:
        self.seconds, self.where, self.who = seconds, where, who
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        print(f"{self.who}: error: distributed: the other processes did not all join within "
              f"{self.seconds:.0f} s ({self.where}; distributed.init_timeout_s); exiting with "
              f"{RESTART_EXIT_CODE} to be started again", file=sys.stderr, flush=True)
        os._exit(RESTART_EXIT_CODE)

    def cancel(self) -> None:
        self._timer.cancel()


def maybe_initialize(cfg: DistributedConfig, environ: Mapping[str, str] = os.environ, *,
                     who: str = "olmax") -> bool:
    """Initialise ``jax.distributed`` when a multi-process job is configured; True if it did.
    ``who`` starts the line printed when the peers do not come (``olmax train``)."""
    args = resolve_settings(cfg, environ)
    local = slurm_local_device_ids(environ)
    timeout = cfg.init_timeout_s or DEFAULT_INIT_TIMEOUT_S
    # JAX aborts the process (SIGABRT) when its own timeout passes: give it a minute more.
    options = {"local_device_ids": local, "initialization_timeout": int(timeout) + 60}
    if any(v is not None for v in args.values()):
        if args["num_processes"] in (None, 1) and args["coordinator"] is None:
            return False
        complete = all(v is not None for v in args.values())
        where = (f"{args['num_processes'] or '?'} processes, coordinator "
                 f"{args['coordinator'] or '(from the cluster)'}, this is process "
                 f"{'?' if args['process_id'] is None else args['process_id']}")
        deadline = _StartupDeadline(timeout, where, who)
        try:
            # All three given: no cluster detection (it could only disagree, or query an API).
            jax.distributed.initialize(coordinator_address=args["coordinator"],
                                       num_processes=args["num_processes"],
                                       process_id=args["process_id"],
                                       cluster_detection_method="deactivate" if complete else None,
                                       **options)
            devices()    # the backends connect every process: part of the start-up
            process_exit.keep_service()
        except ValueError as e:
            missing = [k for k, v in args.items() if v is None]
            if missing and "defined" in str(e):
                raise ConfigError(f"distributed.{missing[0]} is not set (nor {_ENV[missing[0]]}) and "
                                  "no cluster environment JAX recognises supplies it") from None
            raise ConfigError(f"distributed: {e}") from None
        except (OSError, RuntimeError) as e:    # JAX's cluster detection (a metadata server, DNS)
            if complete or not _detection_error(e):
                raise
            raise _detection_failed(e, [f"{k}={v}" for k, v in args.items() if v is not None],
                                    environ) from None
        finally:
            deadline.cancel()
        return True
    hints = [h for h in _CLUSTER_HINTS if environ.get(h)]
    if not hints:
        return False
    if hinted_processes(environ) == 1:    # one worker (a one-host TPU VM, srun -n 1): one process
        return False
    deadline = _StartupDeadline(timeout, "processes found by the cluster environment", who)
    try:
        jax.distributed.initialize(**options)
        devices()
        process_exit.keep_service()
        return True
    except (OSError, RuntimeError, ValueError) as e:
        if not _detection_error(e) and not isinstance(e, ValueError):
            raise
        raise _detection_failed(e, [f"{h}={environ[h]}" for h in hints], environ) from None
    finally:
        deadline.cancel()


def _detection_error(e: BaseException) -> bool:
    """Whether ``e`` is JAX's cluster detection failing to learn the cluster (a metadata server
    or a coordinator's name that cannot be reached), not the peers failing to meet."""
    text = str(e)
    return isinstance(e, OSError) or any(k in text for k in (
        "metadata", "Failed to recognize coordinator", "NameResolution", "Failed to resolve",
        "Getting metadata"))


def parse_expected_devices(text: str) -> tuple[str, int]:
    """``gpu:512`` -> ("gpu", 512): the platform (cpu, gpu, tpu) and device count of a job."""
    platform, colon, count = text.partition(":")
    if platform not in PLATFORMS or not colon or not count.isdigit() or int(count) < 1:
        raise ConfigError(f"--expect-devices {text!r}: expected PLATFORM:N with PLATFORM one of "
                          f"{', '.join(PLATFORMS)} and N a positive device count, e.g. gpu:512")
    return platform, int(count)


def devices() -> list:
    """``jax.devices()``; when the platforms JAX may use are pinned (``JAX_PLATFORMS``) and none of
    them can start (no CUDA plugin, no libtpu), a ConfigError saying so: a restart cannot help."""
    pinned = os.environ.get("JAX_PLATFORMS", "")
    try:
        return jax.devices()
    except (RuntimeError, AssertionError) as e:   # JAX asserts when no pinned platform exists
        if not pinned:
            raise
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "no such platform")
        raise ConfigError(f"JAX_PLATFORMS={pinned}: JAX cannot start that platform here "
                          f"({first})") from None


def check_devices(expected: tuple[str, int]) -> None:
    """Refuse (ConfigError: exit 2) to train on another platform or device count than ``expected``
    (a missing CUDA plugin or libtpu makes JAX fall back to the CPU; a node may show fewer GPUs)."""
    platform, count = expected
    pinned = os.environ.get("JAX_PLATFORMS", "")
    found = devices()
    got = backend_of(found)
    if got != platform or len(found) != count:
        hint = (f" (JAX_PLATFORMS={pinned or 'unset'}: is "
                f"{'the CUDA plugin' if platform == 'gpu' else 'libtpu'} installed and the "
                "accelerator visible?)" if got != platform else "")
        raise ConfigError(f"the job was written for {count} {platform} devices, but this process "
                          f"sees {len(found)} {got} device(s) in all{hint}")
