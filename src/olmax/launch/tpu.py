"""TPU slices: accelerator types (``v5p-64``, ``v6e-16``, ...) and the TPU VM launcher.

A slice of ``hosts`` workers runs one training process per worker. ``olmax launch tpu-vm`` writes a
script that starts that process on every worker through ``gcloud compute tpus tpu-vm ssh
--worker=all`` (in the background, logging to the run directory), follows worker 0's log, or stops
the run (SIGTERM: every process saves a checkpoint at the same step). The processes find each other
through JAX's Cloud TPU detection (worker number and addresses from the VM metadata); the script
sets only ``OLMAX_NUM_PROCESSES``. Running the script again resumes from the last checkpoint.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from typing import Sequence

from olmax.config import ConfigError
from olmax.launch.job import SET_ME, Fit, Job, comment, provenance, shell_join, train_argv

# generation: (what the size in the name counts, topology dimensions, GKE accelerator label)
_GENERATIONS = {
    "v4": ("cores", 3, "tpu-v4-podslice"),
    "v5p": ("cores", 3, "tpu-v5p-slice"),
    "v5litepod": ("chips", 2, "tpu-v5-lite-podslice"),
    "v6e": ("chips", 2, "tpu-v6e-slice"),
}
_NAME = re.compile(r"(v4|v5p|v5litepod|v6e)-(\d+)")


@dataclass(frozen=True)
class TpuSlice:
    """A TPU slice by accelerator type. v4 and v5p names count TensorCores (2 per chip, one JAX
    device per chip: megacore); v5e (``v5litepod``) and v6e names count chips (one core each)."""

    name: str
    chips: int
    hosts: int
    topology: str          # the physical shape GKE schedules on, e.g. 2x4x4
    gke_accelerator: str   # GKE node label cloud.google.com/gke-tpu-accelerator

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def devices(self) -> int:
        return self.chips


def _shape(chips: int, dims: int) -> tuple[int, ...]:
    """The standard slice shape: from 2x2(x1), double the last of the smallest dimensions."""
    if chips == 1:
        return (1,) * dims
    shape = [2, 2] + [1] * (dims - 2)
    while math.prod(shape) < chips:
        smallest = min(shape)
        shape[max(i for i, s in enumerate(shape) if s == smallest)] *= 2
    return tuple(shape)


def parse_topology(name: str) -> TpuSlice:
    """``v4-32``, ``v5p-64``, ``v5litepod-16``, ``v6e-16``, ... (power-of-two slices)."""
    m = _NAME.fullmatch(name)
    bad = ConfigError(f"--topology {name!r}: expected a TPU accelerator type with a power-of-two "
                      "size, e.g. v4-32, v5p-64 (TensorCores), v5litepod-16 or v6e-16 (chips)")
    if not m:
        raise bad
    counts, dims, label = _GENERATIONS[m.group(1)]
    size = int(m.group(2))
    chips = size // 2 if counts == "cores" else size
    if chips < 1 or chips & (chips - 1) or (counts == "cores" and (size % 8 or chips < 4)) \
            or (counts == "chips" and (chips == 2 or chips > 256)):
        raise bad
    hosts = chips // 4 if counts == "cores" or chips > 8 else 1
    return TpuSlice(name=name, chips=chips, hosts=hosts,
                    topology="x".join(map(str, _shape(chips, dims))), gke_accelerator=label)


def _worker_commands(job: Job, tpu: TpuSlice, setup: Sequence[str]) -> dict[str, str]:
    """The shell commands each worker runs for ``start``, ``logs`` and ``stop``."""
    files = [f"dir={shlex.quote(job.run_dir)}",
             'log="$dir/logs/$(hostname).log"', 'pidfile="$dir/logs/$(hostname).pid"']
    exports = ([f"export OLMAX_NUM_PROCESSES={tpu.hosts}"] if tpu.hosts > 1 else [])
    exports += [f"export {k}={shlex.quote(v)}" for k, v in job.env]
    start = [
        "set -e",
        *setup,
        "if ! command -v olmax >/dev/null 2>&1; then",
        "  echo \"olmax launch: 'olmax' is not on PATH on $(hostname) (SET-ME: --setup)\" >&2",
        "  exit 2",
        "fi",
        *files,
        'mkdir -p "$dir/logs"',
        'if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then',
        '  echo "olmax launch: $(hostname): already running (pid $(cat "$pidfile"))" >&2',
        "  exit 1",
        "fi",
        *exports,
        "export PYTHONUNBUFFERED=1",
        f'nohup {shell_join(train_argv(job))} >>"$log" 2>&1 </dev/null &',
        'echo $! >"$pidfile"',
        'echo "olmax launch: $(hostname): olmax train started (pid $!), log $log"',
    ]
    logs = [*files, 'tail -n 200 -F "$log"']
    stop = [
        *files,
        'if [ -f "$pidfile" ] && kill -TERM "$(cat "$pidfile")" 2>/dev/null; then',
        '  echo "olmax launch: $(hostname): SIGTERM sent: checkpoint at the current step, then stop"',
        "else",
        '  echo "olmax launch: $(hostname): olmax train is not running"',
        "fi",
    ]
    return {"start": "\n".join(start), "logs": "\n".join(logs), "stop": "\n".join(stop)}


def render_vm(job: Job, fit: Fit, tpu: TpuSlice, *, tpu_name: str | None = None,
              zone: str | None = None, project: str | None = None,
              setup: Sequence[str] = ()) -> str:
    for flag, value in (("--tpu-name", tpu_name), ("--zone", zone), ("--project", project)):
        if value is not None and not re.fullmatch(r"[A-Za-z0-9._:-]+", value):
            raise ConfigError(f"{flag} {value!r}: letters, digits and . _ : - only")
    cmds = _worker_commands(job, tpu, setup)
    lines = [
        "#!/bin/bash",
        comment(f"# olmax: {job.recipe} on a TPU VM slice {tpu.name} ({tpu.hosts} worker(s) x "
                f"{tpu.chips_per_host} chips), one training process per worker; "
                f"{fit.describe(job)}."),
        f"# {provenance(job)}",
        "#",
        "#   bash <this file>        start training on every worker, in the background; running it",
        "#                           again after a preemption, a stop or a lost worker resumes the",
        "#                           run from its last checkpoint",
        "#   bash <this file> logs   follow worker 0's output",
        "#   bash <this file> stop   SIGTERM on every worker: each saves a checkpoint at the current",
        "#                           step, then stops",
        "#",
        f"# Set by hand where this file says {SET_ME}:",
        "#   - TPU_NAME and ZONE (here or in the environment; PROJECT defaults to gcloud's own);",
        "#   - the software on every worker: `olmax` on PATH (--setup, e.g. activating a venv);",
        comment(f"#   - the run directory {job.run_dir} must be storage every worker sees (NFS,"),
        "#     Filestore, a gcsfuse mount); relative paths start in each worker's home directory.",
        "# The slice is created beforehand, e.g.",
        f"#   gcloud compute tpus tpu-vm create \"$TPU_NAME\" --zone=\"$ZONE\" "
        f"--accelerator-type={tpu.name} --version=<TPU software version>",
        "set -euo pipefail",
        "",
        f'TPU_NAME="${{TPU_NAME:-{tpu_name or SET_ME}}}"',
        f'ZONE="${{ZONE:-{zone or SET_ME}}}"',
        f'PROJECT="${{PROJECT:-{project or ""}}}"',
        "for v in TPU_NAME ZONE; do",
        f'  if [ "${{!v}}" = {SET_ME} ]; then',
        '    echo "olmax launch: set $v (SET-ME in $0, or in the environment)" >&2',
        "    exit 2",
        "  fi",
        "done",
        "",
        *(f"{k.upper()}_COMMAND={shlex.quote(v)}" for k, v in cmds.items()),
        "",
        'case "${1:-start}" in',
        '  start) command=$START_COMMAND; worker=all ;;',
        '  logs) command=$LOGS_COMMAND; worker=0 ;;',
        '  stop) command=$STOP_COMMAND; worker=all ;;',
        '  *) echo "usage: $0 [start|logs|stop]" >&2; exit 2 ;;',
        "esac",
        'exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" '
        '${PROJECT:+--project="$PROJECT"} --worker="$worker" --command="$command"',
        "",
    ]
    return "\n".join(lines)
