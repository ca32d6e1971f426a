"""TPU VMs: a script that starts, follows and stops the run on every worker of a slice.

A slice (``--topology v5p-128`` or ``v5p:4x4x4``: :mod:`olmax.topology`) of ``hosts`` workers runs
one training process per worker. ``bash FILE`` starts, through ``gcloud compute tpus tpu-vm ssh
--worker=all``, a supervisor on every worker (in the background, logging to
``RUN_DIR/logs/<host>.log``) that runs ``olmax train`` and starts it again after a failure a
restart may cure (exit status 75, a signal), up to ``--max-restarts`` times, but not after 0
(finished or stopped), 2 (a configuration or input error) or 3 (needs a person). Before each start
it removes libtpu's lock file of the process that ended (``/tmp/libtpu_lockfile``); a start finds
processes that still hold the TPU and names them instead of starting. Each start passes
``--attempt <start>.<n>``, so a restarted process takes the run directory over from the one it
replaces at once. When a process fails, its peers fail too (their collectives cannot complete;
the watchdog catches the ones that hang), so every supervisor restarts and the job forms again.

``bash FILE logs`` follows worker 0's log; ``bash FILE stop`` makes every worker save a checkpoint
at the same step and stop (SIGTERM to each supervisor, which passes it on and does not restart).
The processes find each other through JAX's Cloud TPU detection (worker number and addresses from
the VM metadata); the script sets only ``OLMAX_NUM_PROCESSES``. ``--num-slices N`` runs on the N
slices ``TPU_NAME-0`` .. ``TPU_NAME-<N-1>`` of a multi-slice queued resource (whose metadata tells
JAX the slice and the ``MEGASCALE_*`` settings), with the data axis across the slices.
"""

from __future__ import annotations

import re
import shlex
from typing import Sequence

from olmax.errors import NO_RESTART, ConfigError, no_restart_text
from olmax.launch.job import (LONG_ARGS, MAX_ARG_BYTES, SET_ME, Fit, Job, comment, provenance,
                              shell_join, train_argv)
from olmax.topology import TpuSlice

LIBTPU_LOCK = "/tmp/libtpu_lockfile"

# The supervisor each worker runs: bash -c "$SUPERVISE" olmax-supervisor START_ID MAX olmax train ...
SUPERVISE = r"""start_id=$1 max=$2
shift 2
attempt=0 failures=0 stopping=0 child=
trap 'stopping=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null' TERM
while :; do
  rm -f LIBTPU_LOCK    # left by the process that ended; no other is running here
  "$@" --attempt "$start_id.$attempt" &
  child=$!
  while :; do   # a trapped signal interrupts `wait`: keep waiting while training runs
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break
  done
  child=
  if [ "$stopping" = 1 ]; then
    echo "olmax launch: $(hostname): stopped (exit $rc)"
    exit "$rc"
  fi
  case "$rc" in
    0) echo "olmax launch: $(hostname): olmax train ended (exit 0)"; exit 0 ;;
    NO_RESTART) echo "olmax launch: $(hostname): olmax train exited with $rc (NO_RESTART_TEXT): not restarted"; exit "$rc" ;;
  esac
  failures=$((failures + 1))
  if [ "$failures" -gt "$max" ]; then
    echo "olmax launch: $(hostname): olmax train exited with $rc; $max restart(s) already, the most --max-restarts allows: giving up"
    exit "$rc"
  fi
  attempt=$((attempt + 1))
  echo "olmax launch: $(hostname): olmax train exited with $rc; restart $failures of $max (attempt $start_id.$attempt) in ${OLMAX_RESTART_DELAY_S:-10} s"
  sleep "${OLMAX_RESTART_DELAY_S:-10}" &
  wait $!
  [ "$stopping" = 0 ] || exit "$rc"
done
""".replace("LIBTPU_LOCK", LIBTPU_LOCK).replace("NO_RESTART_TEXT", no_restart_text()).replace(
    "NO_RESTART)", "|".join(map(str, NO_RESTART)) + ")")


def _worker_commands(job: Job, fit: Fit, setup: Sequence[str]) -> dict[str, str]:
    """The shell commands each worker runs for ``start``, ``logs`` and ``stop``."""
    files = [f"dir={shlex.quote(job.run_dir)}",
             'log="$dir/logs/$(hostname).log"', 'pidfile="$dir/logs/$(hostname).pid"']
    running = ('[ -f "$pidfile" ] && tr "\\0" " " <"/proc/$(cat "$pidfile")/cmdline" 2>/dev/null'
               ' | grep -q olmax-supervisor')
    exports = [f"export OLMAX_NUM_PROCESSES={job.processes}"] if job.processes > 1 else []
    exports += [f"export {k}={shlex.quote(v)}" for k, v in job.environment().items()]
    start = [
        "set -e",
        "set +u",
        *setup,
        "if ! command -v olmax >/dev/null 2>&1; then",
        "  echo \"olmax launch: 'olmax' is not on PATH on $(hostname) (SET-ME: --setup)\" >&2",
        "  exit 2",
        "fi",
        *files,
        'mkdir -p "$dir/logs"',
        f"if {running}; then",
        '  echo "olmax launch: $(hostname): already running (supervisor pid $(cat "$pidfile"))" >&2',
        "  exit 1",
        "fi",
        "holders=$(fuser /dev/accel* /dev/vfio/[0-9]* 2>/dev/null | tr -s ' ' || true)",
        'if [ -n "$holders" ]; then',
        '  echo "olmax launch: $(hostname): processes$holders hold the TPU; stop them first" >&2',
        "  exit 1",
        "fi",
        *exports,
        f"TRAIN=({shell_join(train_argv(job, fit))})",
        f"SUPERVISE={shlex.quote(SUPERVISE)}",
        f'nohup bash -c "$SUPERVISE" olmax-supervisor "$OLMAX_START_ID" {job.max_restarts} '
        '"${TRAIN[@]}" >>"$log" 2>&1 </dev/null &',
        'echo $! >"$pidfile"',
        'echo "olmax launch: $(hostname): olmax train started under a supervisor (pid $!), log $log"',
    ]
    logs = [*files, 'tail -n 200 -F "$log"']
    stop = [
        *files,
        f"if {running} && kill -TERM \"$(cat \"$pidfile\")\" 2>/dev/null; then",
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
    cmds = _worker_commands(job, fit, setup)
    # The start command reaches each worker as one argument (gcloud's --command, then ssh's).
    size = len(f"export OLMAX_START_ID=00000000000000; {cmds['start']}".encode())
    if size >= MAX_ARG_BYTES:
        raise ConfigError(f"the command each TPU VM worker runs would be {size:,} bytes, more than "
                          f"one argument of gcloud --command may hold ({MAX_ARG_BYTES:,}); "
                          f"{LONG_ARGS}")
    slices = job.num_slices
    names = '"$TPU_NAME"' if slices == 1 else f'$(printf "$TPU_NAME-%d " $(seq 0 {slices - 1}))'
    where = (f"a TPU VM slice {tpu.name}" if slices == 1 else
             f"{slices} TPU VM slices {tpu.name} (TPU_NAME-0 .. TPU_NAME-{slices - 1})")
    lines = [
        "#!/bin/bash",
        comment(f"# olmax: {job.recipe} on {where} ({tpu.hosts} worker(s) x {tpu.chips_per_host} "
                f"chips each), one training process per worker; {fit.describe(job)}."),
        f"# {provenance(job)}",
        "#",
        "#   bash <this file>        start training on every worker, in the background, under a",
        "#                           supervisor that restarts it after a failure a restart may cure",
        comment(f"#                           (up to {job.max_restarts} times); running it again "
                "after a preemption, a stop"),
        "#                           or a lost worker resumes the run from its last checkpoint",
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
        f"--accelerator-type={tpu.accelerator_type} --version=<TPU software version>",
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
        '  start) command="export OLMAX_START_ID=$(date -u +%Y%m%d%H%M%S); $START_COMMAND";'
        ' worker=all ;;',
        '  logs) command=$LOGS_COMMAND; worker=0 ;;',
        '  stop) command=$STOP_COMMAND; worker=all ;;',
        '  *) echo "usage: $0 [start|logs|stop]" >&2; exit 2 ;;',
        "esac",
        "ssh_to() {",
        '  gcloud compute tpus tpu-vm ssh "$1" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"}'
        ' --worker="$worker" --command="$command"',
        "}",
    ]
    if slices == 1:
        lines.append('ssh_to "$TPU_NAME"')
    else:
        lines += [
            'if [ "$worker" = 0 ]; then ssh_to "$TPU_NAME-0"; exit; fi',
            "status=0",
            f"for name in {names}; do",
            '  ssh_to "$name" & pids+=($!)',
            "done",
            'for pid in "${pids[@]}"; do wait "$pid" || status=$?; done',
            'exit "$status"',
        ]
    lines.append("")
    return "\n".join(lines)
