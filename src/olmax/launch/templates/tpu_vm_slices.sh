if [ "$worker" = 0 ]; then ssh_to "$TPU_NAME-0"; exit; fi
status=0
for name in {{names}}; do
  ssh_to "$name" & pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
