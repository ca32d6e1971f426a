#!/bin/bash
# {{summary}}
# {{provenance}}
#
#   bash <this file>        start training on every worker, in the background, under a
#                           supervisor that restarts it after a failure a restart may cure
#                           (up to {{max_restarts}} times); running it again after a preemption, a stop
#                           or a lost worker resumes the run from its last checkpoint
#   bash <this file> logs   follow worker 0's output
#   bash <this file> stop   SIGTERM on every worker: each saves a checkpoint at the current
#                           step, then stops
#
# Set by hand where this file says SET-ME:
#   - TPU_NAME and ZONE (here or in the environment; PROJECT defaults to gcloud's own);
#   - the software on every worker: `olmax` on PATH (--setup, e.g. activating a venv);
{{run_dir_note}}
# The slice is created beforehand, e.g.
#   gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --accelerator-type={{accelerator_type}} --version=<TPU software version>
set -euo pipefail

TPU_NAME="${TPU_NAME:-{{tpu_name}}}"
ZONE="${ZONE:-{{zone}}}"
PROJECT="${PROJECT:-{{project}}}"
for v in TPU_NAME ZONE; do
  if [ "${!v}" = SET-ME ]; then
    echo "olmax launch: set $v (SET-ME in $0, or in the environment)" >&2
    exit 2
  fi
done

{{worker_commands}}

case "${1:-start}" in
  start) command="export OLMAX_START_ID=$(date -u +%Y%m%d%H%M%S); $START_COMMAND"; worker=all ;;
  logs) command=$LOGS_COMMAND; worker=0 ;;
  stop) command=$STOP_COMMAND; worker=all ;;
  *) echo "usage: $0 [start|logs|stop]" >&2; exit 2 ;;
esac
ssh_to() {
  gcloud compute tpus tpu-vm ssh "$1" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"} --worker="$worker" --command="$command"
}
{{run}}
