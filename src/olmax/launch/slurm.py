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

from olmax.errors import EXIT_RESTART, NO_RESTART, ConfigError, no_restart_text
from olmax.launch.job import SET_ME, Fit, Job, comment, fill, provenance, shell_join, template, train_argv

_WORD = re.compile(r"[^\s#'\"\\]+")
SIGNAL_MAX_S = 65535   # sbatch --signal=[B:]SIG@TIME: TIME is 0..65535 seconds
CONTAINER_OPTION = "--container-image"
ATTEMPT = '"${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"'

# What each task runs (POSIX sh, inside the container when srun starts one: templates/slurm_task.sh):
# check that olmax is there, run the training command, record a failure's exit status for the
# batch shell. A TERM (preemption, the stop before the time limit) is for the training process:
# the shell only waits.
TASK = template("slurm_task.sh")


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
    exports = [f'export XLA_FLAGS="${{XLA_FLAGS:+$XLA_FLAGS }}"{shell_join([v])}' if k == "XLA_FLAGS"
               else f"export {k}={shell_join([v])}" for k, v in job.environment().items()]
    sbatch = [_option("partition", partition), _option("account", account),
              _option("time", time_limit), *(f"#SBATCH {o}" for o in sbatch_extra)]
    return fill(
        template("slurm.sh"),
        summary=comment(f"olmax: {job.recipe} on {where}, {per}; {fit.describe(job)}."),
        provenance=provenance(job), restart_code=str(EXIT_RESTART),
        max_restarts=str(job.max_restarts),
        no_restart=" or ".join(f"{code} ({why})" for code, why in NO_RESTART.items()),
        run_dir_comment=comment(job.run_dir), name=job.name, nodes=str(job.nodes),
        tasks_per_node=str(per_node), gpus_directive=f"#SBATCH --gpus-per-node={gpus}" if gpus else "",
        grace_s=str(job.grace_s), sbatch_options="\n".join(sbatch),
        run_dir=shell_join([job.run_dir]), train=_train_array(job, fit), task=shlex.quote(TASK),
        setup="\n".join(setup or ["# source /shared/path/to/olmax/.venv/bin/activate"]),
        # in a container the software is checked inside it, by each task
        olmax_check="" if container else template("slurm_olmax_check.sh").rstrip("\n"),
        exports="\n".join(exports),
        nccl_hint="# NCCL, if needed (SET-ME): export NCCL_SOCKET_IFNAME=... NCCL_IB_HCA=..." if gpus else "",
        srun=srun, no_restart_codes="|".join(map(str, NO_RESTART)), no_restart_text=no_restart_text(),
        exclude_failed_node=(template("slurm_exclude_failed_node.sh").rstrip("\n")
                             if exclude_failed_node else ""))


def _train_array(job: Job, fit: Fit) -> str:
    """The training command as a bash array, ``$ATTEMPT`` expanded when the script runs."""
    argv = train_argv(job, fit, "--attempt", "@ATTEMPT@")
    return shell_join(argv).replace(shlex.quote("@ATTEMPT@"), '"$ATTEMPT"').replace(
        "@ATTEMPT@", '"$ATTEMPT"')
