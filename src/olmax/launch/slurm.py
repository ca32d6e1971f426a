"""SLURM: an ``sbatch`` script that runs one training process per node through ``srun``.

Each process finds its peers through JAX's SLURM detection (``SLURM_STEP_NODELIST``,
``SLURM_NTASKS``, ``SLURM_PROCID``; coordinator on the first node, port from the job id) and drives
every GPU of its node (:mod:`olmax.parallel.distributed`). Stopping and resuming:

- time limit: Slurm sends the batch shell USR1 ``grace`` seconds before the limit; the script asks
  the training processes to stop (SIGTERM through ``scancel --signal``), each saves a checkpoint at
  the step reached, and the script requeues the job, which resumes from that checkpoint;
- preemption (``PreemptMode=REQUEUE``), node failure: Slurm signals SIGTERM and requeues the job
  itself (``--requeue``); the batch shell keeps waiting so that the save completes;
- ``scancel``: the processes save and stop; no requeue. Submitting the script again continues.
"""

from __future__ import annotations

import re
import shlex
from typing import Sequence

from olmax.config import ConfigError
from olmax.launch.job import (GPU_XLA_FLAGS, SET_ME, Fit, Job, comment, provenance, shell_join,
                              train_argv)

_WORD = re.compile(r"[^\s#'\"\\]+")


def _option(name: str, value: str | None) -> str:
    if value is None:
        return f"##SBATCH --{name}={SET_ME}   # if your cluster needs it"
    if not _WORD.fullmatch(value):
        raise ConfigError(f"--{name} {value!r}: one word without spaces or quotes")
    return f"#SBATCH --{name}={value}"


def _raw_options(kind: str, options: Sequence[str]) -> list[str]:
    for o in options:
        if not o.startswith("-") or "\n" in o or "\r" in o:
            raise ConfigError(f"--{kind}-option {o!r}: one {kind} option, starting with '-'")
    return list(options)


SIGNAL_MAX_S = 65535   # sbatch --signal=[B:]SIG@TIME: TIME is 0..65535 seconds


def render(job: Job, fit: Fit, *, partition: str | None = None, account: str | None = None,
           time_limit: str | None = None, sbatch_options: Sequence[str] = (),
           srun_options: Sequence[str] = (), setup: Sequence[str] = ()) -> str:
    if job.grace_s > SIGNAL_MAX_S:
        raise ConfigError(f"--grace {job.grace_s}: sbatch --signal takes at most {SIGNAL_MAX_S} "
                          f"seconds before the time limit")
    gpus = job.devices_per_node or 0
    sbatch_extra = _raw_options("sbatch", sbatch_options)
    srun_extra = _raw_options("srun", srun_options)
    srun = " ".join(["srun --ntasks-per-node=1 --kill-on-bad-exit=1",
                     *(shlex.quote(o) for o in srun_extra), '"${TRAIN[@]}" &'])
    where = f"{job.nodes} node(s) x {gpus} GPU(s)" if gpus else f"{job.nodes} node(s), CPUs only"
    lines = [
        "#!/bin/bash",
        "# " + comment(f"olmax: {job.recipe} on {where}, one training process per node; "
                       f"{fit.describe(job)}."),
        f"# {provenance(job)}",
        "#",
        "# Submit with `sbatch <this file>`. Submitting it again continues the run from its last",
        "# checkpoint. The job requeues itself before its time limit (after the training processes",
        "# saved a checkpoint); Slurm requeues it after a preemption or a node failure (--requeue).",
        "#",
        "# Set by hand where this file says SET-ME:",
        "#   - partition, account and time limit, if your cluster needs them (#SBATCH lines below);",
        "#   - the software: every node must find `olmax` on PATH (see 'Environment' below: a venv on",
        "#     shared storage, a module, or a container image via --srun-option=--container-image=...);",
        "#   - NCCL's network settings, if NCCL does not find the fast fabric itself;",
        comment(f"#   - the run directory must be on storage every node sees: {job.run_dir}"),
        "# Preemption: Slurm sends SIGTERM and every process saves a checkpoint; the cluster's",
        "# GraceTime (or KillWait) must exceed one step plus one save, else the run resumes from",
        "# the last periodic checkpoint instead.",
        "#",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    lines += [
        "#SBATCH --exclusive",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{job.grace_s}",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=%x-%j.out",
        _option("partition", partition),
        _option("account", account),
        _option("time", time_limit),
        *(f"#SBATCH {o}" for o in sbatch_extra),
        "",
        "set -uo pipefail",
        ': "${SLURM_JOB_ID:?submit this script with sbatch}"',
        "",
        f"RUN_DIR={shell_join([job.run_dir])}",
        f"TRAIN=({shell_join(train_argv(job))})",
        "",
        "# Environment (SET-ME if `olmax` is not on PATH already): srun passes it on to every node.",
        *(setup or ["# source /shared/path/to/olmax/.venv/bin/activate"]),
        "if ! command -v olmax >/dev/null 2>&1; then",
        "  echo \"olmax launch: 'olmax' is not on PATH on $(hostname): set up its environment in $0"
        " (SET-ME)\" >&2",
        "  exit 2",
        "fi",
    ]
    if gpus:
        lines.append(f'export XLA_FLAGS="${{XLA_FLAGS:+$XLA_FLAGS }}{GPU_XLA_FLAGS}"')
    lines.append("export PYTHONUNBUFFERED=1")
    lines += [f"export {k}={shell_join([v])}" for k, v in job.env]
    if gpus:
        lines += ["# NCCL, if needed (SET-ME): export NCCL_SOCKET_IFNAME=... NCCL_IB_HCA=..."]
    lines += [
        "",
        'mkdir -p "$RUN_DIR"',
        'echo "olmax launch: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on'
        ' ${SLURM_JOB_NUM_NODES} node(s) ${SLURM_JOB_NODELIST}; run dir $RUN_DIR"',
        "",
        "requeue=0",
        "stop_training() {  # SIGTERM to the training processes (not to srun, which would kill them)",
        '  scancel --signal=TERM "$SLURM_JOB_ID"',
        "}",
        "trap 'echo \"olmax launch: time limit near: checkpoint, stop, requeue\"; requeue=1;"
        " stop_training' USR1",
        "trap 'echo \"olmax launch: SIGTERM: waiting for the checkpoint\"' TERM",
        "",
        srun,
        "srun_pid=$!",
        "while :; do  # a trapped signal interrupts `wait`: keep waiting while srun runs",
        '  wait "$srun_pid"',
        "  rc=$?",
        '  kill -0 "$srun_pid" 2>/dev/null || break',
        "done",
        'if [ "$rc" -gt 128 ]; then  # interrupted just as srun ended: its own status',
        '  wait "$srun_pid" 2>/dev/null',
        "  status=$?",
        '  [ "$status" = 127 ] || rc=$status',
        "fi",
        'if [ "$requeue" = 1 ]; then',
        '  echo "olmax launch: requeueing job $SLURM_JOB_ID to continue from the checkpoint"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)

