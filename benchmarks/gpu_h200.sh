#!/usr/bin/env bash
# One short, self-contained GPU check (no network; < 8 minutes on one H200):
#   1. the measured bf16 matmul ceiling (8192^3),
#   2. training tokens/s and MFU (OLMo-core's and the causal FLOPs convention) of a 7B-width OLMo 3
#      slice (4 layers, seq 8192, bf16, cuDNN sliding-window attention), 32x128 heads,
#   3. the same with 16x256 heads,
# printed as one table (and written to $OUT/gpu_h200.json when $OUT is set), then
#   4. `olmax plan` of the same 32x128 slice compiled for this GPU: XLA's memory analysis, FLOPs and
#      collectives beside the measured step ($OUT/plan_gpu.json).
# Without a GPU it runs the same code on a tiny shape (a test of the script itself).
#
#   bash benchmarks/gpu_h200.sh [extra gpu_bench.py args, e.g. --layers 8 --remat dots]
# Python: $PYTHON, else ./.venv/bin/python, else python3. It needs jax with CUDA on a GPU machine
# (carry wheels and `pip install --no-index --find-links WHEELS jax[cuda12]` there if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=3
# Let XLA take most of the GPU memory up front (the default 75 % is fine for a 4-layer slice).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
JSON_ARGS=()
PLAN_JSON=()
if [[ -n "${OUT:-}" ]]; then JSON_ARGS=(--json "$OUT/gpu_h200.json"); PLAN_JSON=(--json "$OUT/plan_gpu.json" --force); fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
timeout 400 "$PY" benchmarks/gpu_bench.py "${JSON_ARGS[@]}" "$@"
if "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  PLAN=(olmo3_7b_stage1 model.n_layers=4 train.global_batch_size=1 train.micro_batch_size=1
        train.seq_len=8192 train.attn_impl=cudnn data.mix=null data.embedded=true)
else
  PLAN=(olmo3_tiny train.global_batch_size=2 train.attn_impl=auto --no-parts)   # tiny, on CPU
fi
echo "== olmax plan ${PLAN[*]}"
exec timeout 150 "$PY" -m olmax.cli plan "${PLAN[@]}" "${PLAN_JSON[@]}"
