"""What every launcher shares: the job, its check against the recipe and the cluster's devices,
the training command every process runs, and the atomic write of the generated file."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import olmax
from olmax.config import ConfigError, RunConfig
from olmax.io import as_inputs, refuse_existing, write_bytes_atomic
from olmax.parallel.mesh import resolve_mesh_shape
from olmax.data.sources import resolve_mix
from olmax.train.recipes import load_recipe
from olmax.train.step import num_micro_batches

# XLA's latency-hiding scheduler overlaps the FSDP all-gathers / reduce-scatters with compute on
# GPUs (the JAX GPU performance guide's first recommendation). Not on by default on GPU in XLA.
GPU_XLA_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true"
SET_ME = "SET-ME"
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Job:
    """One training run on a cluster: ``nodes`` processes (one per node, pod or TPU worker), each
    driving ``devices_per_node`` accelerators (None: not known here, e.g. CPU nodes)."""

    recipe: str
    overrides: tuple[str, ...]
    run_dir: str
    nodes: int
    devices_per_node: int | None
    name: str
    env: tuple[tuple[str, str], ...] = ()
    grace_s: int = 300          # seconds between the stop signal and the kill: step + save
    command_line: str = ""      # the ``olmax launch`` command, recorded in the generated file

    @property
    def devices(self) -> int | None:
        return self.nodes * self.devices_per_node if self.devices_per_node else None


@dataclass(frozen=True)
class Fit:
    """The recipe as it will run on the job's devices."""

    cfg: RunConfig
    mesh: tuple[int, int, int] | None    # (data, fsdp, tensor), when the device count is known
    micro_batches: int | None
    notes: tuple[str, ...]

    def describe(self, job: Job) -> str:
        t = self.cfg.train
        text = f"batch {t.global_batch_size} x {t.seq_len}, {t.max_steps} steps"
        if self.mesh is not None:
            d, f, tp = self.mesh
            text += (f", mesh data {d} x fsdp {f} x tensor {tp} over {job.devices} devices, "
                     f"{self.micro_batches} micro-batch(es)")
        return text


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


def check_job(job: Job, *, recipe_travels: bool = True) -> Fit:
    """Validate the recipe and overrides (a bad key or value is a ConfigError naming it) and their
    fit on the job's processes and devices; nothing is read from the cluster's storage.

    ``recipe_travels``: a recipe given as a file path is read at this path by every process (true
    on SLURM with a shared file system; elsewhere a note says the file must be there too)."""
    if job.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1 (got {job.nodes})")
    if job.devices_per_node is not None and job.devices_per_node < 0:
        raise ConfigError(f"devices per node must be >= 0 (got {job.devices_per_node})")
    if job.grace_s < 1:
        raise ConfigError(f"--grace must be a positive number of seconds (got {job.grace_s})")
    cfg = load_recipe(job.recipe, job.overrides, find_mix=False, read_init=False)
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
    if t.global_batch_size % job.nodes:
        raise ConfigError(f"train.global_batch_size {t.global_batch_size} is not divisible by the "
                          f"{job.nodes} processes (one per node)")
    mesh = micro = None
    if job.devices:
        mesh = resolve_mesh_shape(cfg.mesh, job.devices)
        micro = num_micro_batches(t, mesh[0] * mesh[1])
    return Fit(cfg, mesh, micro, tuple(notes))


def train_argv(job: Job, *options: str) -> list[str]:
    """The command every process runs: the recipe and overrides exactly as given."""
    return ["olmax", "train", job.recipe, "--run-dir", job.run_dir, *options, *job.overrides]


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
