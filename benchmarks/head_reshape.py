"""Head reshape on OLMo 3 7B layer shapes: 32 heads x 128 versus 16 heads x 256.

Same parameter count and the same FLOPs (q/k/v/o are 4096 x 4096 either way and the attention
term is 12 * n_heads * head_dim per key), a different attention: a benchmark variant, never a
parity target. Both train with the olmax trainer's step; timed steps are interleaved so both see
the same machine load; the reported ratio is the median of per-round ratios.

On a CPU the slice is reduced to fit: ``--layers`` 7B layers (d_model 4096, MLP 11008) with windows
[W, full] (an odd count: sliding layers only, the majority type in OLMo 3), a small vocabulary (the LM head is identical in both variants and would only dilute the
difference), short sequences. ``gpu_h200.sh`` runs the full-width slice at seq 8192 on a GPU.

    python benchmarks/head_reshape.py [--layers 2 --seq 256 --window 128 --rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from cpu_side_by_side import write_json


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=1024, help="padded vocabulary of the reduced slice")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attn", default="chunked")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()

    from olmax.perf.bench import TrainStepRunner
    from olmax.config import RunConfig, TrainConfig
    from olmax.model.flops import flops_per_token
    from olmax.model.presets import resolve_model

    variants = {}
    for preset in ("olmo3-7b", "olmo3-7b-16x256"):
        model = resolve_model({"preset": preset, "n_layers": a.layers, "vocab_size": a.vocab - 8,
                               "padded_vocab_size": a.vocab,
                               "window_pattern": [a.window, None] if a.layers % 2 == 0 else [a.window]})
        cfg = RunConfig(model=model, train=TrainConfig(seq_len=a.seq, global_batch_size=a.batch,
                                                       compute_dtype=a.dtype, attn_impl=a.attn))
        runner = TrainStepRunner(cfg)
        runner.run()
        variants[f"{model.n_heads}x{model.head_dim}"] = (runner, model)
        print(f"ready: {preset} (compile {runner.compile_s:.1f} s)", file=sys.stderr, flush=True)
    names = list(variants)
    times = {n: [] for n in names}
    for i in range(a.rounds):
        for n in names:
            times[n].append(variants[n][0].run())
        print(f"round {i + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names),
              file=sys.stderr, flush=True)
    tokens = a.batch * a.seq
    rows = []
    for n in names:
        runner, model = variants[n]
        med = statistics.median(times[n])
        rows.append({"heads": n, "step_s_median": med, "step_s": times[n], "tokens_per_s": tokens / med,
                     "flops_per_token_causal": flops_per_token(model, a.seq, "causal"),
                     "speedup_vs_32x128": statistics.median(
                         [x / y for x, y in zip(times[names[0]], times[n])]),
                     "compile_s": runner.compile_s})
    pattern = f"[{a.window}, full]" if a.layers % 2 == 0 else f"[{a.window}] (sliding only)"
    print(f"\n7B layer shapes (d_model 4096, MLP 11008), {a.layers} layers, windows {pattern}, "
          f"vocab {a.vocab}; batch {a.batch} x seq {a.seq}; {a.dtype}, attn={a.attn}; "
          f"{a.rounds} interleaved rounds\n")
    print("| heads | FLOPs/token (causal) | step s (median) | tokens/s | speed vs 32x128 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['heads']} | {r['flops_per_token_causal'] / 1e9:.3f} G | {r['step_s_median']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['speedup_vs_32x128']:.3f}x |")
    write_json(a.json_out, {"args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
