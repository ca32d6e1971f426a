#!/usr/bin/env bash
# One short, self-contained GPU check (no network; < 9 minutes on one H200):
#   1. the measured bf16 matmul ceiling (8192^3),
#   2. training tokens/s and MFU (OLMo-core's and the causal FLOPs convention) of a 7B-width OLMo 3
#      slice (4 layers, seq 8192, bf16, cuDNN sliding-window attention), 32x128 heads, then the
#      same with 16x256 heads; each variant's compiled step (HLO) and a profile of 3 steps,
#   3. the rates table of this GPU (`olmax bench matmul --table`: GEMMs by shape, cuDNN attention
#      by sequence, head dimension and window, HBM bandwidth, the per-kernel floor), also written
#      where `olmax plan` reads it, src/olmax/perf/gpu_tables/NAME.json (NAME: the GPU's row in
#      olmax.hardware; with $OUT set),
#   4. `olmax plan` of the same 32x128 slice compiled for this GPU (XLA's memory analysis, FLOPs,
#      collectives) beside the measured step.
# Printed as tables; with $OUT set, written there: gpu_h200.json, gpu_rates.json, plan_gpu.json,
# hlo_HEADS.txt.gz, trace_HEADS.json.gz (Perfetto), log.txt. `benchmarks/calibrate.py --case
# olmo3_7b_slice_h200` then holds olmax's GPU estimate of the same HLO against the measured step.
# Without a GPU it runs the same code on a tiny shape (a test of the script itself).
#
#   bash benchmarks/gpu_h200.sh [extra gpu_bench.py args, e.g. --layers 8 --remat dots]
# Python: $PYTHON, else ./.venv/bin/python, else python3. It needs jax with CUDA on a GPU machine
# (carry wheels and `pip install --no-index --find-links WHEELS jax[cuda12]` there if missing).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1
# Let XLA take most of the GPU memory up front (the default 75 % is fine for a 4-layer slice).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
ARGS=()
PLAN_JSON=()
WORK=""
if [[ -n "${OUT:-}" ]]; then
  WORK="$(mktemp -d)"
  ARGS=(--json "$OUT/gpu_h200.json" --out "$WORK" --rates)
  PLAN_JSON=(--json "$OUT/plan_gpu.json" --force)
  exec > >(tee -a "$OUT/log.txt") 2>&1
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
rc=0
timeout "${GPU_BENCH_TIMEOUT:-420}" "$PY" benchmarks/gpu_bench.py "${ARGS[@]}" "$@" || rc=$?
if [[ -n "$WORK" ]]; then   # the files that come back: at most a few, flat
  cp "$WORK"/gpu_rates.json "$WORK"/hlo_*.txt.gz "$OUT"/ 2>/dev/null
  for d in "$WORK"/trace_*; do
    [[ -d "$d" ]] || continue
    f="$(find "$d" -name perfetto_trace.json.gz | head -1)"
    [[ -n "$f" ]] && cp "$f" "$OUT/$(basename "$d").json.gz"
  done
fi
if "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  PLAN=(olmo3_7b_stage1 model.n_layers=4 train.global_batch_size=1 train.micro_batch_size=1
        train.seq_len=8192 train.attn_impl=cudnn data.mix=null data.embedded=true --no-parts)
else
  PLAN=(olmo3_tiny train.global_batch_size=2 train.attn_impl=auto --no-parts)   # tiny, on CPU
fi
echo "== olmax plan ${PLAN[*]}"
timeout 150 "$PY" -m olmax.cli plan "${PLAN[@]}" "${PLAN_JSON[@]}" || rc=$?
exit "$rc"
