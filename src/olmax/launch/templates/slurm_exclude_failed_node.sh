if [ -n "$failed_node" ]; then
  echo "$failed_node" >>"$RUN_DIR/exits/excluded-nodes"
  excluded=$(sort -u "$RUN_DIR/exits/excluded-nodes" | paste -sd, -)
  echo "olmax launch: exit $rc (statuses: $codes); restart $((failures + 1)) of $MAX_RESTARTS as a new job without $excluded"
  sbatch --exclude="$excluded" --export=ALL,OLMAX_PRIOR_FAILURES=$((failures + 1)) "$0"
  exit "$rc"
fi
