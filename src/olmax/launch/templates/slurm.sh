#!/bin/bash
# {{summary}}
# {{provenance}}
#
# Submit with `sbatch <this file>`. Submitting it again continues the run from its last
# checkpoint. The job requeues itself before its time limit (after the training processes
# saved a checkpoint) and after a failure a restart may cure (exit status {{restart_code}}, a signal), up
# to {{max_restarts}} times; not after {{no_restart}}.
# Slurm requeues it after a preemption or a node failure (--requeue). Each task's exit
# status is in RUN_DIR/exits/<job>.<restart>/; a hang's stacks in RUN_DIR/hangs/.
#
# Set by hand where this file says SET-ME:
#   - partition, account and time limit, if your cluster needs them (#SBATCH lines below);
#   - the software: every node must find `olmax` on PATH (see 'Environment' below: a venv on
#     shared storage, a module, or a container image via --srun-option=--container-image=...,
#     with the run directory and the data mounted: --srun-option=--container-mounts=/shared:/shared);
#   - NCCL's network settings, if NCCL does not find the fast fabric itself;
#   - the run directory must be on storage every node sees: {{run_dir_comment}}
# Preemption: Slurm sends SIGTERM and every process saves a checkpoint; the cluster's
# GraceTime (or KillWait) must exceed one step plus one save, else the run resumes from
# the last periodic checkpoint instead.
#
#SBATCH --job-name={{name}}
#SBATCH --nodes={{nodes}}
#SBATCH --ntasks-per-node={{tasks_per_node}}
{{gpus_directive}}
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=B:USR1@{{grace_s}}
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
{{sbatch_options}}

set -uo pipefail
: "${SLURM_JOB_ID:?submit this script with sbatch}"

RUN_DIR={{run_dir}}
MAX_RESTARTS={{max_restarts}}
ATTEMPT="${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"
TRAIN=({{train}})
TASK={{task}}

# Environment (SET-ME if `olmax` is not on PATH already): srun passes it on to every node.
set +u   # activation scripts (conda's, modules) read unset variables
{{setup}}
set -u
{{olmax_check}}
{{exports}}
{{nccl_hint}}
export OLMAX_EXITS="$RUN_DIR/exits/$ATTEMPT"

mkdir -p "$RUN_DIR"
echo "olmax launch: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES} node(s) ${SLURM_JOB_NODELIST}; run dir $RUN_DIR"

requeue=0
stop_training() {  # SIGTERM to the training processes (not to srun, which would kill them)
  scancel --signal=TERM "$SLURM_JOB_ID"
}
trap 'echo "olmax launch: time limit near: checkpoint, stop, requeue"; requeue=1; stop_training' USR1
trap 'echo "olmax launch: SIGTERM: waiting for the checkpoint"' TERM

{{srun}}
srun_pid=$!
while :; do  # a trapped signal interrupts `wait`: keep waiting while srun runs
  wait "$srun_pid"
  rc=$?
  kill -0 "$srun_pid" 2>/dev/null || break
done
if [ "$rc" -gt 128 ]; then  # interrupted just as srun ended: its own status
  wait "$srun_pid" 2>/dev/null
  status=$?
  [ "$status" = 127 ] || rc=$status
fi
if [ "$requeue" = 1 ]; then
  echo "olmax launch: requeueing job $SLURM_JOB_ID to continue from the checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
  exit "$rc"
fi
[ "$rc" = 0 ] && exit 0

# A failure. What the processes said, first failure first (rank files: code node time).
codes=$(cat "$OLMAX_EXITS"/* 2>/dev/null | cut -d" " -f1 | sort -u | tr "\n" " ")
for code in $codes; do
  case "$code" in {{no_restart_codes}})
    echo "olmax launch: a process exited with $code ({{no_restart_text}}): not restarted; see the log above"
    exit "$code" ;;
  esac
done
failed_node=$(sort -n -k3 "$OLMAX_EXITS"/* 2>/dev/null | head -n 1 | cut -d" " -f2)
mkdir -p "$RUN_DIR/exits"
count_file="$RUN_DIR/exits/$SLURM_JOB_ID.failures"
failures=$(( ${OLMAX_PRIOR_FAILURES:-0} + $(cat "$count_file" 2>/dev/null || echo 0) ))
if [ "$failures" -ge "$MAX_RESTARTS" ]; then
  echo "olmax launch: exit $rc (statuses: ${codes:-none recorded}); $failures restart(s) after failures already, the most --max-restarts allows: giving up"
  exit "$rc"
fi
echo $(( $(cat "$count_file" 2>/dev/null || echo 0) + 1 )) >"$count_file"
{{exclude_failed_node}}
echo "olmax launch: exit $rc (statuses: ${codes:-none recorded}; first failure on ${failed_node:-an unknown node}); requeueing, restart $((failures + 1)) of $MAX_RESTARTS"
scontrol requeue "$SLURM_JOB_ID"
exit "$rc"
