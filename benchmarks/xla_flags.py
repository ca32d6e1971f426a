"""A/B-measure XLA flags on the trainer's step: each flag set against the baseline, interleaved.

XLA reads ``XLA_FLAGS`` once per process, so every variant runs in a worker process of its own
(``olmax.perf.abtest``), measured beside a fresh baseline worker (two workers in memory, not one
per variant), their timed steps interleaved so that both see the same load on a shared machine.
Per variant it reports the compile time, the median step time, the speed-up over the baseline (the
median of the per-round ratios, robust to load drifting), whether the compiled program differs at
all (``program_hash``), and whether its losses equal the baseline's bit for bit: a flag that
changes the numbers breaks the determinism contract and is reported as such, however fast it is.

    python benchmarks/xla_flags.py [--recipe olmo3_tiny] [--rounds 5] [--set key=value ...]
        [--variant NAME=FLAGS ...] [--json benchmarks/results/xla_flags_cpu.json]

Without ``--variant`` the default candidates for the platform (``--platform``, default: what
``JAX_PLATFORMS`` or the machine has) are measured. Flags that already are in ``XLA_FLAGS`` apply to
every worker, baseline included (e.g. a forced host device count).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from olmax.io import write_json_atomic
from olmax.perf.abtest import Leg, interleave

# Candidates worth measuring; none is assumed to help.
CPU_VARIANTS = {
    "onednn": "--xla_cpu_use_onednn=true",
    "onednn_custom_call": "--xla_cpu_experimental_onednn_custom_call=true",
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "xnn_graph_fusion": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "concurrency_scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "fast_math": "--xla_cpu_enable_fast_math=true",
    "eigen_single_thread": "--xla_cpu_multi_thread_eigen=false",
}
GPU_VARIANTS = {
    "latency_hiding_scheduler": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    "no_command_buffer": "--xla_gpu_enable_command_buffer=",
    "autotune_4": "--xla_gpu_autotune_level=4",
}
# The CPU side-by-side shape (OLMo 3 190M widths, 4 layers, dolma2 vocabulary), fp32.
CPU_SHAPE = ["model.preset=olmo3-190m", "model.n_layers=4", "model.window_pattern=[128,128,128,null]",
             "train.seq_len=512", "train.global_batch_size=1", "train.attn_impl=chunked",
             "train.compute_dtype=float32"]


def default_platform() -> str:
    plat = os.environ.get("JAX_PLATFORMS", "")
    if plat:
        return "gpu" if plat.split(",")[0] in ("cuda", "gpu", "rocm") else "cpu"
    return "gpu" if Path("/dev/nvidia0").exists() else "cpu"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="olmo3_tiny")
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                   help="recipe override (repeatable); default on CPU: the side-by-side shape")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="a flag set to measure (repeatable); default: the platform's candidates")
    p.add_argument("--platform", choices=["cpu", "gpu"], default=None)
    p.add_argument("--rounds", type=int, default=5, help="timed steps per worker, interleaved")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per worker")
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    platform = a.platform or default_platform()
    overrides = a.overrides if a.overrides is not None else (CPU_SHAPE if platform == "cpu" else [])
    variants = dict(v.split("=", 1) for v in a.variant) if a.variant else \
        (CPU_VARIANTS if platform == "cpu" else GPU_VARIANTS)
    common = os.environ.get("XLA_FLAGS", "")
    rows = []
    result = {"recipe": a.recipe, "overrides": overrides, "platform": platform,
              "xla_flags_common": common, "rounds": a.rounds, "rows": rows}
    base = None
    for name, flags in variants.items():
        env = {"XLA_FLAGS": " ".join(x for x in (common, flags) if x)}
        try:
            run = interleave([Leg("baseline", a.recipe, overrides), Leg(name, a.recipe, overrides, env)],
                             rounds=a.rounds, warmup=a.warmup)
        except RuntimeError as e:
            rows.append({"variant": name, "flags": flags, "error": str(e)})
            print(f"{name}: failed to start: {e}", file=sys.stderr, flush=True)
            continue
        base, var = run["rows"]
        result.update(jax=base["jax"], device=base["device"])
        same = var["losses"] == base["losses"]
        rel = max(abs(x - y) / abs(y) for x, y in zip(var["losses"], base["losses"]))
        rows.append({"variant": name, "flags": flags, "compile_s": var["compile_s"],
                     "baseline_compile_s": base["compile_s"], "step_s_median": var["step_s_median"],
                     "baseline_step_s_median": base["step_s_median"],
                     "speedup_median": var["speed_vs_first"], "speedup_per_round": var["speed_vs_first_per_round"],
                     "program_identical": var["program_hash"] == base["program_hash"],
                     "losses_bit_identical": same, "loss_max_rel_diff": rel, "loadavg": run["loadavg"]})
        print(f"{name}: step {var['step_s_median']:.3f} s vs baseline {base['step_s_median']:.3f} s, "
              f"speed-up {var['speed_vs_first']:.3f}x, compile {var['compile_s']:.1f} s vs "
              f"{base['compile_s']:.1f} s, losses {'bit-identical' if same else f'differ (max rel {rel:.1e})'}",
              file=sys.stderr, flush=True)
        if a.json_out:   # after every variant: a killed run keeps the variants done
            write_json_atomic(a.json_out, result)

    print("\n| variant | XLA flags | compile s | step s (median) | speed-up vs baseline | losses |")
    print("|---|---|---|---|---|---|")
    if base is not None:
        print(f"| baseline | (none) | {base['compile_s']:.1f} | {base['step_s_median']:.3f} | 1.000x | - |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | `{r['flags']}` | failed: {r['error']} | | | |")
            continue
        same = "bit-identical" if r["losses_bit_identical"] else f"differ ({r['loss_max_rel_diff']:.1e} rel)"
        print(f"| {r['variant']} | `{r['flags']}` | {r['compile_s']:.1f} | {r['step_s_median']:.3f} | "
              f"{r['speedup_median']:.3f}x ({', '.join(f'{x:.2f}' for x in r['speedup_per_round'])}) | {same} |")
    if a.json_out:
        write_json_atomic(a.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
