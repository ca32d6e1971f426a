# Sourced by the chip's scripts (benchmarks/tpu.sh, benchmarks/tpu_ab.sh) from the repository's
# root: $PY is $PYTHON, else $OLMAX_VENV/bin/python, else ./.venv/bin/python, else python3, with
# src/ first on PYTHONPATH and TensorFlow's and Python's output settings for a log.
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -n "${OLMAX_VENV:-}" && -x "$OLMAX_VENV/bin/python" ]]; then PY="$OLMAX_VENV/bin/python"
  elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1
