#!/usr/bin/env bash
# The step changes not yet measured on a TPU, as A/B runs on one chip (no network; < 9 minutes on
# one v5e chip): each `olmax bench ab` compiles its legs, then steps one shared state with each
# leg in turn (steps interleaved, 3 rounds, the median per-round ratio to the first leg).
#   olmo3-600m, 8 x 4096, micro-batch 8, full remat (the row `auto` fits to a v5e chip), and
#   olmo3-370m, 16 x 4096, micro-batch 1, save_proj (likewise), each with the legs
#     base     the defaults (splash's fused backward, blocks of 512, the layer scan rolled)
#     unroll   train.unroll_layers=true: every layer's residuals in buffers of their own, where
#              the rolled scan stacks them with dynamic-update-slice and reads them back with
#              dynamic-slice (12 % of the 370m's step on the chip's profile)
#     b1024    train.splash_block=1024: half the kernel steps, more masked work at the diagonal
#   and for the 600m also
#     kernels  train.remat=save_kernels train.unroll_layers=true train.loss_chunk_rows=4096: full
#              remat but for splash's output and statistics, so the backward pass never runs the
#              forward kernel again (216 ms of the step runs it twice under full); compiled for
#              v5e it fits only so, unrolled and with loss chunks of 512 positions (14.13 GiB; the
#              rolled scan needs 16.60, the unrolled one with chunks of 1,024 positions 15.78)
#   and for the 370m (16 micro-batches of one sequence) also
#     chunk    train.loss_chunk_rows=4096: one LM head and loss chunk a micro-batch instead of
#              4, so the head's fp32 weight gradient is read and written 16 times a step, not 64
# With $OUT set, ab_600m.json and ab_370m.json and log.txt are written there. Without a TPU the
# same commands run on tiny shapes (a test of the script itself).
#
#   bash benchmarks/tpu_ab.sh
# Python: $PYTHON, else $OLMAX_VENV/bin/python, else ./.venv/bin/python, else python3; olmax
# installed there (on a host without a package index: scripts/bootstrap --offline WHEELS).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/tpu_env.sh
out="${OUT:-}"
if [[ -n "$out" ]]; then
  mkdir -p "$out"
  exec > >(tee -a "$out/log.txt") 2>&1
fi
t0=$SECONDS
budget="${TPU_AB_BUDGET_S:-520}"
tpu="$("$PY" -c 'import jax; print(int(jax.default_backend() == "tpu"))' 2>/dev/null)"
if [[ "$tpu" == 1 ]]; then
  common=(olmo3_tiny model.max_seq_len=4096 train.seq_len=4096 train.compute_dtype=bfloat16
          train.attn_impl=auto data.embedded=true)
  m600=(model.preset=olmo3-600m train.global_batch_size=8 train.micro_batch_size=8 train.remat=full)
  m370=(model.preset=olmo3-370m train.global_batch_size=16 train.micro_batch_size=1
        train.remat=save_proj)
else   # tiny shapes on the TPU's code path (Pallas interpret mode): the script's own test
  common=(olmo3_tiny train.seq_len=64 train.compute_dtype=float32 train.attn_impl=auto
          train.profile=tpu data.embedded=true train.splash_block=128)
  m600=(train.global_batch_size=2 train.micro_batch_size=2 train.remat=full)
  m370=(train.global_batch_size=2 train.micro_batch_size=1 train.remat=save_proj)
fi
legs=(--leg base --leg unroll train.unroll_layers=true --leg b1024 train.splash_block=1024)
more370=(--leg chunk train.loss_chunk_rows=4096)
more600=(--leg kernels train.remat=save_kernels train.unroll_layers=true train.loss_chunk_rows=4096)
[[ "$tpu" == 1 ]] || { legs=(--leg base --leg unroll train.unroll_layers=true); more370=(); more600=(); }
rc=0
for row in 600m 370m; do
  left=$((budget - (SECONDS - t0)))
  [[ "$row" == 600m ]] && limit=$((left * 55 / 100)) || limit=$((left - 5))
  echo "== A/B olmo3-$row [$((SECONDS - t0)) s], $limit s for it"
  args=("${common[@]}")
  row_legs=("${legs[@]}")
  if [[ "$row" == 600m ]]; then args+=("${m600[@]}"); row_legs+=("${more600[@]}")
  else args+=("${m370[@]}"); row_legs+=("${more370[@]}"); fi
  json=()
  [[ -n "$out" ]] && json=(--json "$out/ab_$row.json" --force)
  timeout "$limit" "$PY" -m olmax.cli bench ab "${args[@]}" "${row_legs[@]}" --rounds 3 "${json[@]}" || rc=$?
done
echo "== done [$((SECONDS - t0)) s]"
exit "$rc"
