if ! command -v olmax >/dev/null 2>&1; then
  echo "olmax launch: 'olmax' is not on PATH on $(hostname): set up its environment in $0 (SET-ME)" >&2
  exit 2
fi
