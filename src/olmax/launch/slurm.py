"""SLURM: an ``sbatch`` script that runs the training processes through ``srun``.

One process per node (each drives every GPU of its node), or with ``--processes-per-node gpus`` one
per GPU (JAX's SLURM detection then gives each process GPU ``SLURM_LOCALID``). The processes find
each other through JAX's SLURM detection (``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``,
``SLURM_PROCID``; coordinator on the first node, port from the job id;
:mod:`olmax.parallel.distributed`). What happens when:

- time limit: Slurm sends the batch shell USR1 ``grace`` seconds before the limit; the script asks
  the training processes to stop (SIGTERM through ``scancel --signal``), each saves a checkpoint at
  the step reached, and the script requeues the job, which resumes from that checkpoint;
- preemption (``PreemptMode=REQUEUE``), node failure: Slurm signals SIGTERM and requeues the job
  itself (``--requeue``); the batch shell keeps waiting so that the save completes;
- a failure (a crash, a hang the watchdog caught, peers that did not start): every task records
  its exit status in ``RUN_DIR/exits/<job>.<restart>/<rank>``; ``--kill-on-bad-exit`` ends the
  others at once. Unless a process said 2 (configuration or input error) or 3 (needs a person),
  the script requeues the job, up to ``--max-restarts`` times per job; with
  ``--exclude-failed-node`` it submits the script again without the node whose process failed
  first (Slurm changes a job's excluded nodes only while it is pending);
- ``scancel``: the processes save and stop; no requeue. Submitting the script again continues.

Each start passes ``--attempt <job id>.<restart count>``, so a requeued job takes the run directory
over from its previous attempt at once.
"""

from __future__ import annotations

import re
import shlex
from typing import Sequence

from olmax.errors import NO_RESTART, ConfigError, no_restart_text
from olmax.launch.job import SET_ME, Fit, Job, comment, provenance, shell_join, train_argv

_WORD = re.compile(r"[^\s#'\"\\]+")
SIGNAL_MAX_S = 65535   # sbatch --signal=[B:]SIG@TIME: TIME is 0..65535 seconds
CONTAINER_OPTION = "--container-image"
ATTEMPT = '"${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"'

# What each task runs (POSIX sh, inside the container when srun starts one): check that olmax is
# there, run the training command, record a failure's exit status for the batch shell. A TERM
# (preemption, the stop before the time limit) is for the training process: the shell only waits.
TASK = r"""trap : TERM
if ! command -v olmax >/dev/null 2>&1; then
  echo "olmax launch: 'olmax' is not on PATH on $(hostname) (SET-ME: --setup, or the container image)" >&2
  rc=2
else
  "$@"
  rc=$?
fi
if [ "$rc" != 0 ]; then
  mkdir -p "$OLMAX_EXITS" && echo "$rc ${SLURMD_NODENAME:-$(hostname)} $(date +%s)" >"$OLMAX_EXITS/${SLURM_PROCID:-0}"
fi
exit "$rc"
"""


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


def render(job: Job, fit: Fit, *, partition: str | None = None, account: str | None = None,
           time_limit: str | None = None, sbatch_options: Sequence[str] = (),
           srun_options: Sequence[str] = (), setup: Sequence[str] = (),
           exclude_failed_node: bool = False) -> str:
    if job.grace_s > SIGNAL_MAX_S:
        raise ConfigError(f"--grace {job.grace_s}: sbatch --signal takes at most {SIGNAL_MAX_S} "
                          f"seconds before the time limit")
    gpus = job.devices_per_node if job.platform == "gpu" else 0
    sbatch_extra = _raw_options("sbatch", sbatch_options)
    srun_extra = _raw_options("srun", srun_options)
    container = any(o.split("=", 1)[0] == CONTAINER_OPTION for o in srun_extra)
    per_node = job.processes_per_node
    srun = " ".join([f"srun --ntasks-per-node={per_node} --kill-on-bad-exit=1",
                     *(shlex.quote(o) for o in srun_extra),
                     'sh -c "$TASK" olmax-task "${TRAIN[@]}" &'])
    where = (f"{job.nodes} node(s) x {gpus} GPU(s)" if gpus else
             f"{job.nodes} node(s) x {job.devices_per_node} CPU device(s)")
    per = "one training process per GPU" if per_node > 1 else "one training process per node"
    lines = [
        "#!/bin/bash",
        "# " + comment(f"olmax: {job.recipe} on {where}, {per}; {fit.describe(job)}."),
        f"# {provenance(job)}",
        "#",
        "# Submit with `sbatch <this file>`. Submitting it again continues the run from its last",
        "# checkpoint. The job requeues itself before its time limit (after the training processes",
        "# saved a checkpoint) and after a failure a restart may cure (exit status 75, a signal), up",
        comment(f"# to {job.max_restarts} times; not after 2 (a configuration or input error) or 3 "
                "(needs a person)."),
        "# Slurm requeues it after a preemption or a node failure (--requeue). Each task's exit",
        "# status is in RUN_DIR/exits/<job>.<restart>/; a hang's stacks in RUN_DIR/hangs/.",
        "#",
        "# Set by hand where this file says SET-ME:",
        "#   - partition, account and time limit, if your cluster needs them (#SBATCH lines below);",
        "#   - the software: every node must find `olmax` on PATH (see 'Environment' below: a venv on",
        "#     shared storage, a module, or a container image via --srun-option=--container-image=...,",
        "#     with the run directory and the data mounted: --srun-option=--container-mounts=/shared:/shared);",
        "#   - NCCL's network settings, if NCCL does not find the fast fabric itself;",
        comment(f"#   - the run directory must be on storage every node sees: {job.run_dir}"),
        "# Preemption: Slurm sends SIGTERM and every process saves a checkpoint; the cluster's",
        "# GraceTime (or KillWait) must exceed one step plus one save, else the run resumes from",
        "# the last periodic checkpoint instead.",
        "#",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
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
        f"MAX_RESTARTS={job.max_restarts}",
        f"ATTEMPT={ATTEMPT}",
        f"TRAIN=({_train_array(job, fit)})",
        f"TASK={shlex.quote(TASK)}",
        "",
        "# Environment (SET-ME if `olmax` is not on PATH already): srun passes it on to every node.",
        "set +u   # activation scripts (conda's, modules) read unset variables",
        *(setup or ["# source /shared/path/to/olmax/.venv/bin/activate"]),
        "set -u",
    ]
    if not container:   # in a container the software is checked inside it, by each task
        lines += [
            "if ! command -v olmax >/dev/null 2>&1; then",
            "  echo \"olmax launch: 'olmax' is not on PATH on $(hostname): set up its environment in"
            " $0 (SET-ME)\" >&2",
            "  exit 2",
            "fi",
        ]
    for k, v in job.environment().items():
        if k == "XLA_FLAGS":
            lines.append(f'export XLA_FLAGS="${{XLA_FLAGS:+$XLA_FLAGS }}"{shell_join([v])}')
        else:
            lines.append(f"export {k}={shell_join([v])}")
    if gpus:
        lines += ["# NCCL, if needed (SET-ME): export NCCL_SOCKET_IFNAME=... NCCL_IB_HCA=..."]
    lines += [
        'export OLMAX_EXITS="$RUN_DIR/exits/$ATTEMPT"',
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
        '  exit "$rc"',
        "fi",
        '[ "$rc" = 0 ] && exit 0',
        "",
        "# A failure. What the processes said, first failure first (rank files: code node time).",
        'codes=$(cat "$OLMAX_EXITS"/* 2>/dev/null | cut -d" " -f1 | sort -u | tr "\\n" " ")',
        'for code in $codes; do',
        f'  case "$code" in {"|".join(map(str, NO_RESTART))})',
        f'    echo "olmax launch: a process exited with $code ({no_restart_text()}): not restarted;'
        ' see the log above"',
        '    exit "$code" ;;',
        "  esac",
        "done",
        'failed_node=$(sort -n -k3 "$OLMAX_EXITS"/* 2>/dev/null | head -n 1 | cut -d" " -f2)',
        'mkdir -p "$RUN_DIR/exits"',
        'count_file="$RUN_DIR/exits/$SLURM_JOB_ID.failures"',
        'failures=$(( ${OLMAX_PRIOR_FAILURES:-0} + $(cat "$count_file" 2>/dev/null || echo 0) ))',
        'if [ "$failures" -ge "$MAX_RESTARTS" ]; then',
        '  echo "olmax launch: exit $rc (statuses: ${codes:-none recorded}); $failures restart(s)'
        ' after failures already, the most --max-restarts allows: giving up"',
        '  exit "$rc"',
        "fi",
        'echo $(( $(cat "$count_file" 2>/dev/null || echo 0) + 1 )) >"$count_file"',
    ]
    if exclude_failed_node:
        lines += [
            'if [ -n "$failed_node" ]; then',
            '  echo "$failed_node" >>"$RUN_DIR/exits/excluded-nodes"',
            '  excluded=$(sort -u "$RUN_DIR/exits/excluded-nodes" | paste -sd, -)',
            '  echo "olmax launch: exit $rc (statuses: $codes); restart $((failures + 1)) of'
            ' $MAX_RESTARTS as a new job without $excluded"',
            '  sbatch --exclude="$excluded" --export=ALL,OLMAX_PRIOR_FAILURES=$((failures + 1))'
            ' "$0"',
            '  exit "$rc"',
            "fi",
        ]
    lines += [
        'echo "olmax launch: exit $rc (statuses: ${codes:-none recorded}; first failure on'
        ' ${failed_node:-an unknown node}); requeueing, restart $((failures + 1)) of $MAX_RESTARTS"',
        'scontrol requeue "$SLURM_JOB_ID"',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def _train_array(job: Job, fit: Fit) -> str:
    """The training command as a bash array, ``$ATTEMPT`` expanded when the script runs."""
    argv = train_argv(job, fit, "--attempt", "@ATTEMPT@")
    return shell_join(argv).replace(shlex.quote("@ATTEMPT@"), '"$ATTEMPT"').replace(
        "@ATTEMPT@", '"$ATTEMPT"')
