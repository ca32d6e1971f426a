#!/usr/bin/env bash
# The TPU step's defaults against the ones before them, as A/B runs on one chip (no network; < 9
# minutes on one v5e chip): each `olmax bench ab` compiles its legs, then steps one shared state
# with each leg in turn (steps interleaved, 3 rounds, the median per-round ratio to the first leg).
# Rows, each at the micro-batch and remat `auto` fits to a v5e chip (the 190m's at micro-batch 2,
# where `auto` now takes 4: 1,012 ms on the chip in benchmarks/tpu.sh, 2's 980.5 in this script):
#   olmo3-190m  16 x 4096, micro-batch 2, no remat
#   olmo3-370m  16 x 4096, micro-batch 1, no remat
#   olmo3-600m   8 x 4096, micro-batch 8, save_kernels (and full, its policy before)
#   7b-slice     4 x 4096, micro-batch 4, no remat (a sliding and a full layer of the 7B's shapes,
#                vocabulary 32,768: benchmarks/tpu_bench.py)
#   600m1        (not among the default rows) olmo3-600m, 8 x 4096, micro-batch 1, no remat, loss
#                chunks of 2,048 rows: its best step measured (55.6 % MFU, round 8)
# Legs:
#   base     the defaults: splash blocks of 1,024 with the fused backward, the layers unrolled,
#            loss chunks of 4,096 rows per device, 32 MiB of scoped VMEM (v5e's row in
#            olmax.hardware)
#   before   the defaults before them: blocks of 512, the layer scan rolled, loss chunks of 1,024
#            positions per sequence (train.loss_chunk_rows = 1,024 x the micro-batch)
#   full     (olmo3-600m) remat full instead of save_kernels, which runs splash's forward kernel
#            again in the backward pass
# With TPU_AB_LEGS=compiler, compiler settings instead of before and full (train.compiler_options):
#   vmem96   xla_tpu_scoped_vmem_limit_kib=98304: libtpu's scoped VMEM, what a kernel or fusion
#            may hold in a core's vector memory (libtpu's v5e default 16 MiB of 128; olmax's 32)
#   b2048    that and splash blocks of 2,048 (which overflow 16 MiB at heads of 64)
#   nolicm   xla_disable_hlo_passes=while-loop-invariant-code-motion: the micro-batch loop no
#            longer carries a bf16 copy of each layer's weights hoisted out of it, beside the
#            stacked copies it carries either way (compiled for v5e, olmo3-600m, 8 x 4096,
#            micro-batch 1, save_proj: 16.67 -> 15.89 GiB at the peak)
# With TPU_AB_LEGS=vmem, the defaults against libtpu's own scoped VMEM (leg vmem16: 16 MiB, what
# v5e compiled with before olmax's row set 32 MiB: 0.939-0.998x the step time at 32 MiB, round 6)
# With TPU_AB_LEGS=accumulate, the default per-layer gradient accumulation against the stacked
# accumulator before it (leg stacked: train.accumulate_by_layer=false; 0.965-0.968x on the 370m,
# round 7; a row of one micro-batch, the 600m's and the slice's, runs the same program twice)
# With TPU_AB_LEGS=embedding, the embedding's gradient added to its accumulator row by row (the
# default) against a whole table per micro-batch (leg whole: train.accumulate_embedding_by_row=
# false; 0.986x on the 370m at micro-batch 1 and on 600m1, round 8; one micro-batch: the same)
# With TPU_AB_LEGS=micro, the row's micro-batch against twice it (leg double): whether the
# larger is slower side by side (the 190m's 2 and 4: 980.6 and 1,011.9 ms side by side; compiled,
# a micro-step's smaller buffers stay in the core's VMEM where the larger ones go to HBM)
# With TPU_AB_LEGS=micros, the row at micro-batches 1, 2 and 4 (those dividing its per-device
# batch; legs m1, m2, m4, the row's remat): the ladder `train.auto_choice=estimate` chooses from
# by the estimated step (compiled for v5e, olmo3-190m without remat: 873.1, 894.6 and 915.8 ms),
# measured side by side. A leg that does not fit is reported and left out.
# Measured on a v5e chip, leg by leg: benchmarks/notes/2026-12-06-one-v5e-chip-round-three.md (the
# compiler's and micro-batch legs: 2026-12-07-one-v5e-chip-round-five.md; the VMEM legs:
# 2026-12-07-one-v5e-chip-round-six.md; the accumulation's: 2026-12-07-one-v5e-chip-round-seven.md;
# the embedding's: 2026-12-07-one-v5e-chip-round-eight.md). With
# $OUT set, ab_<row>.json and log.txt are written there. Without a TPU the same commands run on
# tiny shapes (a test of the script itself).
#
#   bash benchmarks/tpu_ab.sh [ROW ...]
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
rows=("$@")
[[ ${#rows[@]} -gt 0 ]] || rows=(190m 370m 600m slice)
tpu="$("$PY" -c 'import jax; print(int(jax.default_backend() == "tpu"))' 2>/dev/null)"
if [[ "$tpu" == 1 ]]; then
  common=(olmo3_tiny model.max_seq_len=4096 train.seq_len=4096 train.compute_dtype=bfloat16
          train.attn_impl=auto data.embedded=true)
  declare -A row_args=(
    [190m]="model.preset=olmo3-190m train.global_batch_size=16 train.micro_batch_size=2 train.remat=none"
    [370m]="model.preset=olmo3-370m train.global_batch_size=16 train.micro_batch_size=1 train.remat=none"
    [600m]="model.preset=olmo3-600m train.global_batch_size=8 train.micro_batch_size=8 train.remat=save_kernels"
    [slice]="model.preset=olmo3-7b model.n_layers=2 model.window_pattern=[4096,null] model.vocab_size=32000 model.padded_vocab_size=32768 train.global_batch_size=4 train.micro_batch_size=4 train.remat=none"
    [600m1]="model.preset=olmo3-600m train.global_batch_size=8 train.micro_batch_size=1 train.remat=none train.loss_chunk_rows=2048")
  declare -A micro=([190m]=2 [370m]=1 [600m]=8 [slice]=4 [600m1]=1)
  declare -A batch=([190m]=16 [370m]=16 [600m]=8 [slice]=4 [600m1]=8)
  old_block=512
  vmem="xla_tpu_scoped_vmem_limit_kib=98304" big_block=2048 libtpu_vmem="xla_tpu_scoped_vmem_limit_kib=16384"
else   # tiny shapes on the TPU's code path (Pallas interpret mode): the script's own test
  common=(olmo3_tiny train.seq_len=256 train.compute_dtype=float32 train.attn_impl=auto
          train.profile=tpu data.embedded=true)
  declare -A row_args=(
    [190m]="train.global_batch_size=2 train.micro_batch_size=1 train.remat=none"
    [370m]="train.global_batch_size=2 train.micro_batch_size=1 train.remat=none"
    [600m]="train.global_batch_size=2 train.micro_batch_size=2 train.remat=save_kernels"
    [slice]="train.global_batch_size=2 train.micro_batch_size=2 train.remat=none"
    [600m1]="train.global_batch_size=2 train.micro_batch_size=1 train.remat=none train.loss_chunk_rows=128")
  declare -A micro=([190m]=1 [370m]=1 [600m]=2 [slice]=2 [600m1]=1)
  declare -A batch=([190m]=2 [370m]=2 [600m]=2 [slice]=2 [600m1]=2)
  old_block=128
  vmem="xla_cpu_enable_fast_math=false" big_block=256   # an option this XLA has, in its place
  libtpu_vmem="xla_cpu_enable_fast_math=false"
fi
rc=0
n=${#rows[@]}
for i in "${!rows[@]}"; do
  row=${rows[$i]}
  [[ -n "${row_args[$row]:-}" ]] || { echo "tpu_ab.sh: unknown row '$row' (rows: 190m 370m 600m slice 600m1)"; exit 2; }
  left=$((budget - (SECONDS - t0)))
  limit=$((left / (n - i)))
  echo "== A/B $row [$((SECONDS - t0)) s], $limit s for it"
  # the loss chunk before: 1,024 positions of each sequence of a micro-batch (the tiny shapes: 64)
  positions=1024; [[ "$tpu" == 1 ]] || positions=64
  if [[ "${TPU_AB_LEGS:-}" == compiler ]]; then
    legs=(--leg base --leg vmem96 "train.compiler_options=[$vmem]"
          --leg b2048 "train.compiler_options=[$vmem]" train.splash_block=$big_block
          --leg nolicm "train.compiler_options=[xla_disable_hlo_passes=while-loop-invariant-code-motion]")
  elif [[ "${TPU_AB_LEGS:-}" == vmem ]]; then
    legs=(--leg base --leg vmem16 "train.compiler_options=[$libtpu_vmem]")
  elif [[ "${TPU_AB_LEGS:-}" == accumulate ]]; then
    legs=(--leg base --leg stacked train.accumulate_by_layer=false)
  elif [[ "${TPU_AB_LEGS:-}" == embedding ]]; then
    legs=(--leg base --leg whole train.accumulate_embedding_by_row=false)
  elif [[ "${TPU_AB_LEGS:-}" == micro ]]; then
    legs=(--leg base --leg double train.micro_batch_size=$((2 * ${micro[$row]})))
  elif [[ "${TPU_AB_LEGS:-}" == micros ]]; then
    legs=()
    for m in 1 2 4; do
      (( ${batch[$row]} % m == 0 )) && legs+=(--leg "m$m" train.micro_batch_size=$m)
    done
  else
    legs=(--leg base --leg before train.splash_block=$old_block train.unroll_layers=false
          train.loss_chunk_rows=$((positions * ${micro[$row]})))
    [[ "$row" == 600m ]] && legs+=(--leg full train.remat=full)
  fi
  json=()
  [[ -n "$out" ]] && json=(--json "$out/ab_$row.json" --force)
  # shellcheck disable=SC2086  # the row's overrides are words
  # legs whose compile would end within 90 s of the limit are reported as not compiled, so that
  # the steps of the compiled ones still fit (a command killed at its limit keeps nothing)
  compile_budget=$(( limit > 90 ? limit - 90 : 0 ))
  timeout "$limit" "$PY" -m olmax.cli bench ab "${common[@]}" ${row_args[$row]} "${legs[@]}" --rounds 3 \
    --compile-budget-s "$compile_budget" "${json[@]}" || rc=$?
done
echo "== done [$((SECONDS - t0)) s]"
exit "$rc"
