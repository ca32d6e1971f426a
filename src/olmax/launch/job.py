"""What every launcher shares: the job, its check against the recipe and the cluster's devices
(and the settings a launched run gets by default), the training command every process runs, the
environment every job exports, and the atomic write of the generated file.

A launched run differs from ``olmax train`` on a workstation in what it is protected against, not
in what it computes. Unless the recipe or the overrides set them, the job adds these overrides
before the user's (:func:`check_job`, :attr:`Fit.defaults`):

- ``distributed.init_timeout_s=1800``: processes that start up to 30 min apart (image pulls, node
  pools that scale up) still form one job; after that a lone process exits 75;
- ``train.watchdog_s=1800`` (:data:`WATCHDOG_S`): a step that has not completed 30 min after the
  previous one is a hang: every process dumps its stacks and exits 75, and the scheduler restarts
  the job. 30 min is far above a healthy gap between two steps (a stage-1 step is about a second
  on 512 GPUs and a minute on 8; an in-loop evaluation or a checkpoint that must commit takes
  minutes) and far below a time limit of days;
- the layout: on GPUs over more than one node, ``mesh.data=<nodes> mesh.fsdp=<GPUs per node>``
  (HSDP: parameters sharded within a node, replicated across nodes, as OLMo-core runs OLMo 3, whose
  throughput the time estimates rest on); on several TPU slices, ``mesh.data=<slices>`` over the
  data-center network and ``mesh.fsdp=<devices per slice>`` within each slice.

Every job pins the JAX platform (``JAX_PLATFORMS``; ``olmax train --expect-devices`` refuses to run
on another platform or device count), gives JAX's GPU allocator a known share of memory
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, the share ``olmax plan`` judges a GPU step against) and keeps
the cache (the epoch order: built once per run, by one process) on the run directory's storage
(``OLMAX_CACHE=<run dir>/cache``), not in a home directory.
"""

from __future__ import annotations

from importlib import resources

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import olmax
from olmax.config import MeshConfig, RunConfig, check_start
from olmax.errors import ConfigError
from olmax.store import is_bucket
from olmax.io import as_inputs, refuse_existing, write_bytes_atomic
from olmax.hardware import VENDORS, Vendor
from olmax.parallel.mesh import resolve_mesh_shape
from olmax.data.sources import resolve_mix
from olmax.perf.targets import MEM_FRACTION, MEM_FRACTION_ENV
from olmax.train.recipes import load_recipe
from olmax.train.step import num_micro_batches

# XLA's latency-hiding scheduler overlaps the FSDP all-gathers / reduce-scatters with compute on
# GPUs (the JAX GPU performance guide's first recommendation). Not on by default on GPU in XLA.
GPU_XLA_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true"
CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"
SET_ME = "SET-ME"
INT32_MAX = 2**31 - 1        # Kubernetes' counts (maxRestarts, backoffLimit) are int32
MAX_ARG_BYTES = 131072       # Linux's limit on one argument of a command (MAX_ARG_STRLEN)
LONG_ARGS = "put long values in a recipe file (a YAML that sets them) and launch that instead"
INIT_TIMEOUT_S = 1800
WATCHDOG_S = 1800
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Job:
    """One training run on a cluster: ``nodes`` hosts (nodes, pods or TPU workers, over all
    slices), each running ``processes_per_node`` processes that drive ``devices_per_node``
    devices of ``platform`` (``gpu``, ``tpu``, ``cpu``) between them."""

    recipe: str
    overrides: tuple[str, ...]
    run_dir: str
    nodes: int
    devices_per_node: int
    name: str
    platform: str = "gpu"
    gpu_vendor: str = "nvidia"  # GPUs: a vendor of olmax.hardware (its JAX platform, its resource)
    processes_per_node: int = 1
    num_slices: int = 1
    env: tuple[tuple[str, str], ...] = ()
    grace_s: int = 300          # seconds between the stop signal and the kill: step + save
    max_restarts: int = 10      # restarts of the whole job after failures
    command_line: str = ""      # the ``olmax launch`` command, recorded in the generated file

    @property
    def processes(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def vendor(self) -> Vendor | None:
        """Whose devices the job runs on (:mod:`olmax.hardware`); None on CPUs."""
        if self.platform == "gpu":
            return VENDORS[self.gpu_vendor]
        return VENDORS["google"] if self.platform == "tpu" else None

    @property
    def jax_platforms(self) -> str:
        return self.vendor.jax_platform if self.vendor else "cpu"

    def environment(self) -> dict[str, str]:
        """What every process of the job gets, the user's ``--env`` last (it wins); XLA_FLAGS is
        added to whatever the process environment holds."""
        env = {"JAX_PLATFORMS": self.jax_platforms, "PYTHONUNBUFFERED": "1"}
        if not is_bucket(self.run_dir):     # a bucket run dir: caches stay node-local
            env["OLMAX_CACHE"] = f"{self.run_dir.rstrip('/')}/cache"
        if self.platform == "gpu":
            env[MEM_FRACTION_ENV] = f"{MEM_FRACTION:.2f}"
            env["XLA_FLAGS"] = GPU_XLA_FLAGS
        elif self.platform == "cpu" and self.devices_per_node // self.processes_per_node > 1:
            env["XLA_FLAGS"] = f"{CPU_DEVICES_FLAG}={self.devices_per_node // self.processes_per_node}"
        return {**env, **dict(self.env)}


@dataclass(frozen=True)
class Fit:
    """The recipe as it will run on the job's devices, with the overrides the launcher adds
    (``defaults``, placed before the user's)."""

    cfg: RunConfig
    mesh: tuple[int, int, int, int]    # (data, fsdp, context, tensor)
    micro_batches: int
    notes: tuple[str, ...]
    defaults: tuple[str, ...] = ()

    def describe(self, job: Job) -> str:
        t = self.cfg.train
        d, f, c, tp = self.mesh
        ctx = f"context {c} x " if c > 1 else ""
        length = f"{t.max_steps} steps" if t.max_steps is not None else t.length
        if t.hard_stop is not None:
            length += f" (hard stop at step {t.hard_stop})"
        return (f"batch {t.global_batch_size} x {t.seq_len}, {length}, mesh data {d} x "
                f"fsdp {f} x {ctx}tensor {tp} over {job.devices} {job.platform.upper()} devices, "
                f"{self.micro_batches} micro-batch(es)")


def check_label(value: str, flag: str, limit: int = 63) -> str:
    """``value`` if it is a DNS label (RFC 1123: what Kubernetes names and namespaces must be) of
    at most ``limit`` characters, else a ConfigError naming ``flag``."""
    if not _NAME.fullmatch(value) or len(value) > limit:
        raise ConfigError(f"{flag} {value!r}: use lower-case letters, digits and '-' (at most "
                          f"{limit}, starting and ending with a letter or digit)")
    return value


def check_name(name: str) -> str:
    """Job names become SLURM job names, Kubernetes object names and pod host names (52: room for
    the pod suffixes Kubernetes adds)."""
    return check_label(name, "--name", 52)


def default_name(recipe: str) -> str:
    stem = Path(recipe).name
    for suffix in (".yaml", ".yml"):
        stem = stem[: -len(suffix)] if stem.endswith(suffix) else stem
    slug = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:45].strip("-")
    return f"olmax-{slug}" if slug else "olmax"


def parse_env(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not _ENV_KEY.fullmatch(key):
            raise ConfigError(f"--env {item!r} is not of the form NAME=VALUE")
        out.append((key, value))
    return tuple(out)


def launch_defaults(cfg: RunConfig, job: Job) -> list[str]:
    """The overrides a launched run gets unless the recipe or the overrides set them (module
    docstring)."""
    out = []
    if cfg.distributed.init_timeout_s is None:
        out.append(f"distributed.init_timeout_s={INIT_TIMEOUT_S}")
    if cfg.train.watchdog_s is None:
        out.append(f"train.watchdog_s={WATCHDOG_S}")
    if cfg.mesh == MeshConfig():
        if job.platform == "gpu" and job.nodes > 1:
            out += [f"mesh.data={job.nodes}", f"mesh.fsdp={job.devices_per_node}"]
        elif job.num_slices > 1:
            out += [f"mesh.data={job.num_slices}", f"mesh.fsdp={job.devices // job.num_slices}"]
    return out


def check_job(job: Job, *, recipe_travels: bool = True) -> Fit:
    """Validate the recipe and overrides (a bad key or value is a ConfigError naming it) and their
    fit on the job's processes and devices, with the launcher's defaults; nothing is read from the
    cluster's storage.

    ``recipe_travels``: a recipe given as a file path is read at this path by every process (true
    on SLURM with a shared file system; elsewhere a note says the file must be there too)."""
    if job.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1 (got {job.nodes})")
    if job.devices_per_node < 1:
        raise ConfigError(f"devices per node must be at least 1 (got {job.devices_per_node})")
    if job.grace_s < 1:
        raise ConfigError(f"--grace must be a positive number of seconds (got {job.grace_s})")
    if job.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0 (got {job.max_restarts})")
    if job.max_restarts * job.nodes > INT32_MAX:     # a Job's backoffLimit counts every node's
        raise ConfigError(f"--max-restarts {job.max_restarts} times {job.nodes} node(s) exceeds "
                          f"{INT32_MAX:,}, the most restarts a job may count (Kubernetes "
                          f"counts them in int32)")
    cfg = load_recipe(job.recipe, job.overrides, find_mix=False, read_init=False)
    defaults = launch_defaults(cfg, job)
    if defaults:
        cfg = load_recipe(job.recipe, [*defaults, *job.overrides], find_mix=False, read_init=False)
    check_start(cfg)
    notes = []
    if cfg.data.mix is not None:
        try:
            resolve_mix(cfg.data.mix)
        except ConfigError:
            notes.append(f"data.mix {cfg.data.mix!r} is not found on this machine; it must resolve "
                         "where the job runs")
    if not recipe_travels and Path(job.recipe).suffix in (".yaml", ".yml"):
        notes.append(f"the recipe file {job.recipe} is read at this path where the job runs")
    t = cfg.train
    if t.global_batch_size % job.processes:
        raise ConfigError(f"train.global_batch_size {t.global_batch_size} is not divisible by the "
                          f"{job.processes} processes ({job.nodes} node(s) x "
                          f"{job.processes_per_node})")
    mesh = resolve_mesh_shape(cfg.mesh, job.devices)
    micro = num_micro_batches(t, mesh[0] * mesh[1])
    return Fit(cfg, mesh, micro, tuple(notes), tuple(defaults))


def train_argv(job: Job, fit: Fit, *options: str) -> list[str]:
    """The command every process runs: the launcher's options and defaults, then the recipe's
    overrides exactly as given."""
    return ["olmax", "train", job.recipe, "--run-dir", job.run_dir,
            "--expect-devices", f"{job.platform}:{job.devices}", *options, *fit.defaults,
            *job.overrides]


def comment(text: str) -> str:
    """``text`` safe inside a one-line ``#`` comment (no line breaks)."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def provenance(job: Job) -> str:
    line = f"Generated by olmax {olmax.__version__}"
    return comment(f"{line}: {job.command_line}" if job.command_line else line)


def shell_join(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def check_output(path: str | Path, recipe: str, *, force: bool = False) -> Path:
    """``--out``, checked before anything else is done (:func:`olmax.io.refuse_existing`: an
    existing file only with ``force``; never the recipe file itself, a folder or a FIFO)."""
    return refuse_existing(path, force, flag="--out", inputs=as_inputs([recipe], "the recipe"))


def write_output(path: str | Path, text: str, *, executable: bool = False,
                 force: bool = False) -> Path:
    """Write the generated file atomically (a complete file or none)."""
    p = write_bytes_atomic(path, text.encode(), overwrite=force)
    p.chmod(0o755 if executable else 0o644)
    return p


_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def template(name: str) -> str:
    """The launch template ``name``: a file of ``olmax/launch/templates/`` (the job bodies, as the
    cluster runs them, with ``{{placeholders}}`` that :func:`fill` fills)."""
    return resources.files("olmax.launch").joinpath("templates", name).read_text()


def fill(text: str, **values: str) -> str:
    """``text`` with each ``{{name}}`` replaced by ``values[name]``, in one pass (a value is never
    searched for placeholders); a line that is one placeholder alone, whose value is empty, is
    left out. Every placeholder needs a value and every value a placeholder (a ValueError)."""
    names = set(_PLACEHOLDER.findall(text))
    if names != set(values):
        raise ValueError(f"template placeholders {sorted(names)} != values {sorted(values)}")
    lines = [line for line in text.splitlines(keepends=True)
             if not ((m := _PLACEHOLDER.fullmatch(line.rstrip("\n"))) and values[m.group(1)] == "")]
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], "".join(lines))
