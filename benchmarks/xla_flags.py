"""A/B-measure XLA flags on the trainer's step: each flag set against the baseline, interleaved.

XLA reads ``XLA_FLAGS`` once per process, so every variant runs in a worker process of its own
(``--worker``), compiled once and kept alive. One baseline worker lives for the whole run; the
variants are measured one at a time beside it (two workers in memory, not one per variant), with
their timed steps interleaved (baseline, variant, baseline, variant, ...) so that both see the same
load on a shared machine. Per variant it reports the compile time, the median step time, the
speed-up over the baseline (the median of the per-round ratios, robust to load drifting), and
whether its losses equal the baseline's bit for bit: a flag that changes the numbers breaks the
determinism contract and is reported as such, however fast it is.

    python benchmarks/xla_flags.py [--recipe olmo3_tiny] [--rounds 5] [--set key=value ...]
        [--variant NAME=FLAGS ...] [--json benchmarks/results/xla_flags_cpu.json]

Without ``--variant`` the default candidates for the platform (``--platform``, default: what
``JAX_PLATFORMS`` or the machine has) are measured. Flags that already are in ``XLA_FLAGS`` apply to
every worker, baseline included (e.g. a forced host device count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from cpu_side_by_side import write_json

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


def worker(recipe: str, overrides: list[str]) -> int:
    """Compile the trainer's step, print ``READY compile_s``, then one ``STEP seconds loss`` line
    per ``step`` line read from stdin."""
    import jax

    from olmax.perf.bench import TrainStepRunner
    from olmax.train.recipes import load_recipe

    runner = TrainStepRunner(load_recipe(recipe, overrides))
    print("READY", runner.compile_s, jax.__version__, jax.devices()[0].device_kind, flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        dt = runner.run()
        print("STEP", dt, repr(float(runner.metrics["loss"])), flush=True)
    return 0


class Worker:
    def __init__(self, name: str, flags: str, recipe: str, overrides: list[str]) -> None:
        env = dict(os.environ)
        env["XLA_FLAGS"] = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), flags) if x)
        self.name, self.flags = name, flags
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", "--recipe", recipe,
                                      *[f"--set={o}" for o in overrides]],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            err = self.proc.stderr.read().strip().splitlines()
            self.close()
            raise RuntimeError(err[-1] if err else f"worker exited with {self.proc.returncode}")
        self.compile_s, self.jax_version, self.device = float(line[1]), line[2], " ".join(line[3:])
        self.times: list[float] = []
        self.losses: list[str] = []

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "STEP":
            raise RuntimeError(f"{self.name}: worker died: {self.proc.stderr.read()[-2000:]}")
        self.times.append(float(line[1]))
        self.losses.append(line[2])
        return self.times[-1]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def default_platform() -> str:
    plat = os.environ.get("JAX_PLATFORMS", "")
    if plat:
        return "gpu" if plat.split(",")[0] in ("cuda", "gpu", "rocm") else "cpu"
    return "gpu" if Path("/dev/nvidia0").exists() else "cpu"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
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
    if a.worker:
        return worker(a.recipe, overrides)

    variants = dict(v.split("=", 1) for v in a.variant) if a.variant else \
        (CPU_VARIANTS if platform == "cpu" else GPU_VARIANTS)
    base = Worker("baseline", "", a.recipe, overrides)
    for _ in range(a.warmup):
        base.step()
    print(f"baseline ready (compile {base.compile_s:.1f} s, jax {base.jax_version}, {base.device})",
          file=sys.stderr, flush=True)
    rows = []
    result = {"recipe": a.recipe, "overrides": overrides, "platform": platform,
              "xla_flags_common": os.environ.get("XLA_FLAGS", ""), "jax": base.jax_version,
              "device": base.device, "rounds": a.rounds, "rows": rows}
    for name, flags in variants.items():
        try:
            var = Worker(name, flags, a.recipe, overrides)
        except RuntimeError as e:
            rows.append({"variant": name, "flags": flags, "error": str(e)})
            print(f"{name}: failed to start: {e}", file=sys.stderr, flush=True)
            continue
        for _ in range(a.warmup):
            var.step()
        b0 = len(base.times)
        load = []
        for i in range(a.rounds):
            pair = (base, var) if i % 2 == 0 else (var, base)
            for w in pair:
                w.step()
            load.append(os.getloadavg()[0])
        bt, vt = base.times[b0:], var.times[-a.rounds:]
        ratios = [x / y for x, y in zip(bt, vt)]
        # the variant's losses vs the baseline's over the same steps 1..warmup+rounds from init
        ref = base.losses[:len(var.losses)]
        same = var.losses == ref
        rel = max(abs(float(x) - float(y)) / abs(float(y)) for x, y in zip(var.losses, ref))
        rows.append({"variant": name, "flags": flags, "compile_s": var.compile_s,
                     "baseline_compile_s": base.compile_s,
                     "step_s_median": statistics.median(vt), "baseline_step_s_median": statistics.median(bt),
                     "speedup_median": statistics.median(ratios), "speedup_per_round": ratios,
                     "losses_bit_identical": same, "loss_max_rel_diff": rel, "loadavg": load})
        print(f"{name}: step {statistics.median(vt):.3f} s vs baseline {statistics.median(bt):.3f} s, "
              f"speed-up {statistics.median(ratios):.3f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)}), "
              f"compile {var.compile_s:.1f} s vs {base.compile_s:.1f} s, losses "
              f"{'bit-identical' if same else f'differ (max rel {rel:.1e})'}", file=sys.stderr, flush=True)
        var.close()
        write_json(a.json_out, result)
    base.close()

    print("\n| variant | XLA flags | compile s | step s (median) | speed-up vs baseline | losses |")
    print("|---|---|---|---|---|---|")
    print(f"| baseline | (none) | {base.compile_s:.1f} | {statistics.median(base.times[a.warmup:]):.3f} | 1.000x | - |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | `{r['flags']}` | failed: {r['error']} | | | |")
            continue
        same = "bit-identical" if r["losses_bit_identical"] else f"differ ({r['loss_max_rel_diff']:.1e} rel)"
        print(f"| {r['variant']} | `{r['flags']}` | {r['compile_s']:.1f} | {r['step_s_median']:.3f} | "
              f"{r['speedup_median']:.3f}x ({', '.join(f'{x:.2f}' for x in r['speedup_per_round'])}) | {same} |")
    write_json(a.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
