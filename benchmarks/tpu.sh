#!/usr/bin/env bash
# One short, self-contained TPU check (no network; < 9 minutes on one v5e chip):
#   1. the versions (jax, libtpu, the chip) and the measured bf16 matmul ceiling (8192^3),
#   2. `olmax bench train` over the ladder olmo3-190m, olmo3-370m (16 x 4096), olmo3-600m
#      (8 x 4096) and a 7B slice (the 7B's layer shapes: a sliding and a full layer, vocabulary
#      32,768; 4 x 4096),
#      bf16, splash, each at the micro-batch and remat policy `auto` chooses on the chip (of the
#      steps that fit, the one estimated fastest: train.auto_choice),
#   3. while time is left, `olmax plan --topology v5e:1x1` of each row at its settings: the plan's
#      fit verdict and estimate beside the measurement,
# in one table (benchmarks/tpu_bench.py). With $OUT set, written there: tpu.json (every figure,
# the versions), cases/*.yaml (each row as a calibration case of olmax plan, for
# benchmarks/calibration/) and log.txt. Without a TPU it runs the same code on tiny shapes (a
# test of the script itself).
#
#   bash benchmarks/tpu.sh [extra tpu_bench.py args, e.g. --rows olmo3-370m --steps 6]
# Python: $PYTHON, else $OLMAX_VENV/bin/python, else ./.venv/bin/python, else python3; olmax
# installed there (on a host without a package index: scripts/bootstrap --offline WHEELS).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/tpu_env.sh
# One process holds the chip at a time: the plans run after the measurements, in processes of
# their own, each compiling for a v5e topology (no chip needed).
ARGS=()
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT/cases"
  ARGS=(--json "$OUT/tpu.json" --cases "$OUT/cases")
  exec > >(tee -a "$OUT/log.txt") 2>&1
fi
"$PY" -c 'import platform; print(f"python {platform.python_version()}")'
timeout "${TPU_BENCH_TIMEOUT:-530}" "$PY" benchmarks/tpu_bench.py "${ARGS[@]}" "$@"
