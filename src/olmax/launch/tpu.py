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
from olmax.launch.job import (LONG_ARGS, MAX_ARG_BYTES, SET_ME, Fit, Job, comment, fill, provenance,
                              shell_join, template, train_argv)
from olmax.store import is_bucket
from olmax.topology import TpuSlice

LIBTPU_LOCK = "/tmp/libtpu_lockfile"

# The supervisor each worker runs: bash -c "$SUPERVISE" olmax-supervisor START_ID MAX olmax train ...
# (templates/tpu_supervise.sh): it restarts training after a failure a restart may cure.
SUPERVISE = fill(template("tpu_supervise.sh"), libtpu_lock=LIBTPU_LOCK,
                 no_restart_codes="|".join(map(str, NO_RESTART)), no_restart_text=no_restart_text())


def _run_dir_note(run_dir: str) -> str:
    if is_bucket(run_dir):
        return (f"#   - the run directory {comment(run_dir)} is a bucket path: no shared file system\n"
                "#     is needed (checkpoints, metrics and the run lock go to the bucket); the\n"
                "#     workers need credentials for it (the TPU VM's service account for gs://);\n"
                "#     each worker's log stays on it, in ~/olmax-logs/.")
    return (f"#   - the run directory {comment(run_dir)} must be storage every worker sees (NFS,\n"
            "#     Filestore, a gcsfuse mount); relative paths start in each worker's home directory.")


def _worker_commands(job: Job, fit: Fit, setup: Sequence[str]) -> dict[str, str]:
    """The shell commands each worker runs for ``start``, ``logs`` and ``stop``."""
    # the workers' logs and pid files: in the run directory, or node-local for a bucket run dir
    log_dir = (f'"$HOME/olmax-logs/"{shlex.quote(job.name)}' if is_bucket(job.run_dir)
               else shlex.quote(job.run_dir))
    files = [f"dir={log_dir}",
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
    run = ('ssh_to "$TPU_NAME"' if slices == 1 else
           fill(template("tpu_vm_slices.sh"), names=names).rstrip("\n"))
    return fill(
        template("tpu_vm.sh"),
        summary=comment(f"olmax: {job.recipe} on {where} ({tpu.hosts} worker(s) x {tpu.chips_per_host} "
                        f"chips each), one training process per worker; {fit.describe(job)}."),
        provenance=provenance(job), max_restarts=str(job.max_restarts),
        run_dir_note=_run_dir_note(job.run_dir), accelerator_type=tpu.accelerator_type,
        tpu_name=tpu_name or SET_ME, zone=zone or SET_ME, project=project or "",
        worker_commands="\n".join(f"{k.upper()}_COMMAND={shlex.quote(v)}" for k, v in cmds.items()),
        run=run)
