start_id=$1 max=$2
shift 2
attempt=0 failures=0 stopping=0 child=
trap 'stopping=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null' TERM
while :; do
  rm -f {{libtpu_lock}}    # left by the process that ended; no other is running here
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
    {{no_restart_codes}}) echo "olmax launch: $(hostname): olmax train exited with $rc ({{no_restart_text}}): not restarted"; exit "$rc" ;;
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
