trap : TERM
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
