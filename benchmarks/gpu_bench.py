"""GPU check: matmul ceiling, then training tokens/s and MFU of a 7B-width OLMo 3 slice, with
32x128 heads (OLMo 3 7B) and the 16x256 reshape, in one table. Driven by ``gpu_h200.sh``.

Slice: OLMo 3 7B layers (d_model 4096, MLP 11008, windows [4096, 4096, 4096, full], QK-norm,
reordered post-norm), ``--layers`` of them (default 4), the full dolma2 vocabulary (embedding and
LM head included), seq 8192, bf16 compute with fp32 master weights and accumulation, SkipStep
AdamW: the trainer's own step. Attention ``cudnn`` (cuDNN flash attention with the sliding window;
the script reports whether the compiled program really contains the cuDNN kernel).

Without a GPU (or with ``--tiny``) the same code runs on a tiny shape so that the script itself is
tested anywhere.
"""

from __future__ import annotations

import argparse
import sys
import time

from cpu_side_by_side import write_json


def cudnn_in_program(window: int, seq: int, heads: int, head_dim: int) -> str:
    """Which kernel the ``cudnn`` attention compiles to on this machine, for one sliding layer."""
    import jax
    import jax.numpy as jnp

    from olmax.model.attention_impls import cudnn_attention

    x = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16)
    try:
        native = jax.default_backend() == "gpu"
        fn = lambda q, k, v: cudnn_attention(q, k, v, window, head_dim ** -0.5, native=native)  # noqa: E731
        lowered = jax.jit(fn).lower(x, x, x)
        lowered.compile()
    except Exception as e:  # report, do not hide
        return f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    # The cuDNN path is a custom call named __cudnn$fmha...; the fallback is plain XLA ops.
    return "cuDNN fused attention" if "__cudnn$fmha" in lowered.as_text() else "XLA chunked (fallback)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shape (automatic without a GPU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attn", default="cudnn")
    p.add_argument("--remat", default="none")
    p.add_argument("--variants", default="olmo3-7b,olmo3-7b-16x256")
    p.add_argument("--json", dest="json_out")
    p.add_argument("--out", help="a folder for each variant's compiled HLO (hlo_VARIANT.txt.gz) and a "
                                 "profile of 3 steps (trace_VARIANT/), and the measured rates "
                                 "(gpu_rates.json, as `olmax bench matmul --table` writes them)")
    p.add_argument("--rates", action="store_true", help="measure the rates table into --out")
    a = p.parse_args()

    import jax

    from olmax.perf.bench import bench_train, matmul_ceiling
    from olmax.config import RunConfig, TrainConfig
    from olmax.model.presets import resolve_model

    gpu = jax.default_backend() == "gpu"
    tiny = a.tiny or not gpu
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}"
          + ("  [tiny shape]" if tiny else ""), flush=True)

    t0 = time.perf_counter()
    ceil = matmul_ceiling(size=256 if tiny else 8192, dtype="float32" if tiny else "bfloat16",
                          iters=3 if tiny else 20)
    print(f"matmul ceiling: {ceil['flops_per_s'] / 1e12:.3g} TFLOP/s ({ceil['size']}^3 {ceil['dtype']})",
          flush=True)

    rows = []
    for name in a.variants.split(","):
        if tiny:
            heads = 2 if "16x256" in name else 4
            model = resolve_model({"d_model": 64, "n_layers": 4, "n_heads": heads, "n_kv_heads": heads,
                                   "head_dim": 64 // heads, "mlp_hidden": 128, "vocab_size": 120,
                                   "padded_vocab_size": 128, "window_pattern": [32, 32, 32, None]})
            train = TrainConfig(seq_len=96, global_batch_size=2, compute_dtype="float32",
                                attn_impl=a.attn, remat=a.remat)
        else:
            model = resolve_model({"preset": name, "n_layers": a.layers})
            train = TrainConfig(seq_len=a.seq, global_batch_size=a.batch, compute_dtype="bfloat16",
                                attn_impl=a.attn, remat=a.remat)
        kernel = (cudnn_in_program(model.window_pattern[0], train.seq_len, model.n_heads, model.head_dim)
                  if a.attn == "cudnn" else a.attn)
        tag = f"{model.n_heads}x{model.head_dim}"
        extra = {} if not a.out else {"hlo_out": f"{a.out}/hlo_{tag}.txt.gz",
                                      "trace_dir": f"{a.out}/trace_{tag}"}
        try:
            r = bench_train(RunConfig(model=model, train=train), steps=2 if tiny else a.steps,
                            warmup=1 if tiny else a.warmup, ceiling_flops=ceil["flops_per_s"], **extra)
        except Exception as e:  # e.g. out of memory: report the row, keep going
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            print(f"{name}: failed: {rows[-1]['error']}", flush=True)
            continue
        row = {"variant": f"{name} ({model.n_heads}x{model.head_dim})", "attention": kernel, **r.to_dict()}
        rows.append(row)
        print(f"{name}: {r.tokens_per_s:,.0f} tokens/s, step {r.step_s * 1e3:.0f} ms, compile "
              f"{r.compile_s:.0f} s", flush=True)

    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}"  # noqa: E731
    peak = "n/a" if not ceil["peak_flops"] else f"{ceil['peak_flops'] / 1e12:.0f} TFLOP/s"
    print(f"\nOLMo 3 7B-width slice: {model.n_layers} layers, seq {train.seq_len}, batch "
          f"{train.global_batch_size}, {train.compute_dtype}, remat={a.remat}; ceiling "
          f"{ceil['flops_per_s'] / 1e12:.3g} TFLOP/s, peak {peak}")
    print("| variant | attention | tokens/s | step ms | MFU % (OLMo-core conv.) | MFU % (causal) "
          "| % of ceiling (causal) | peak mem GiB | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error']} | | | | | | | |")
            continue
        mem = "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.1f}"
        print(f"| {r['variant']} | {r['attention']} | {r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.0f} | "
              f"{pct(r['mfu_olmo_core'])} | {pct(r['mfu_causal'])} | {pct(r['pct_of_ceiling_causal'])} | "
              f"{mem} | {r['compile_s']:.0f} |")
    if a.rates and a.out:
        from olmax.perf.gpu_rates import measure
        from olmax.io import write_json_atomic

        try:
            rates = measure(log=lambda s: print(s, flush=True))
            write_json_atomic(f"{a.out}/gpu_rates.json", rates)
            if gpu:     # where olmax plan reads it: the table named after this GPU's hardware row
                from pathlib import Path

                from olmax.hardware import accelerator_of

                acc = accelerator_of(dev)
                if acc is not None:
                    table = Path(__file__).resolve().parents[1] / "src/olmax/perf/gpu_tables" / f"{acc.name}.json"
                    write_json_atomic(table, rates)
                    print(f"rates table written to {table} (olmax plan reads it for {acc.name}"
                          f"{'' if acc.rates == acc.name else '; name it in the row: rates'})")
        except Exception as e:  # report, keep the rows
            print(f"rates: failed: {type(e).__name__}: {e}", flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    write_json(a.json_out, {"ceiling": ceil, "rows": rows, "args": vars(a)})
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
