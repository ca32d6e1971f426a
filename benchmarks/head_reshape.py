"""Head reshape on OLMo 3 7B layer shapes: 32 heads x 128 versus 16 heads x 256 (a benchmark
variant, never a parity target: the same parameters and FLOPs, a different attention).

The case list: one 7B sliding layer (d_model 4096, MLP 11008, window 128), a vocabulary of 1024,
batch 1 x seq 256, fp32, chunked attention, reduced to fit a CPU. The two legs run the trainer's
step in worker processes, their steps interleaved (:mod:`olmax.perf.abtest`); the ratio is the
median of per-round ratios. Results: ``results/head_reshape_cpu.{json,md}`` and the README section
"Head reshape"; ``gpu_h200.sh`` runs the full-width slice at seq 8192 on a GPU.

    python benchmarks/head_reshape.py [--rounds 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys

from olmax.io import write_json_atomic
from olmax.perf.abtest import Leg, interleave

SLICE = ["model.n_layers=1", "model.window_pattern=[128]", "model.vocab_size=1016",
         "model.padded_vocab_size=1024", "train.seq_len=256", "train.global_batch_size=1",
         "train.compute_dtype=float32", "train.attn_impl=chunked"]
LEGS = [Leg("32x128", "olmo3_tiny", ["model.preset=olmo3-7b", *SLICE]),
        Leg("16x256", "olmo3_tiny", ["model.preset=olmo3-7b-16x256", *SLICE])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    result = interleave(LEGS, rounds=a.rounds, warmup=1)
    print("| heads | step s (median) | speed vs 32x128 (per-round ratios) |\n|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['leg']} | {r['step_s_median']:.2f} | {r['speed_vs_first']:.3f}x "
              f"({', '.join(f'{x:.2f}' for x in r['speed_vs_first_per_round'])}) |")
    if a.json_out:
        write_json_atomic(a.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
