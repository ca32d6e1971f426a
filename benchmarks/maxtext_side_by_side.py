"""MaxText (its own Python >= 3.12 virtual environment) and olmax on the CPU side-by-side shape.

MaxText runs in another interpreter, so steps cannot be interleaved in one process as with
OLMo-core; instead the run is a sandwich -- olmax, MaxText, olmax -- and the ratio uses the median
olmax step of both olmax legs against MaxText's median step. The shape is ``cpu_side_by_side.py``'s
(OLMo 3 190M widths, 4 layers, windows [W, W, W, full], vocab 100352, fp32), given to MaxText's
own OLMo 3 model (``model_name=olmo3-7b`` with the widths overridden; ``attention=dot_product``,
which applies the sliding window; ``remat_policy=minimal``, its least-recompute policy; synthetic
data; z-loss 1e-5; clipping 1.0). MaxText's step time is its own "completed step: N, seconds: S"
log line; its first two steps (compilation, warm-up) are dropped.

    python benchmarks/maxtext_side_by_side.py --maxtext-python /path/to/py312-venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_side_by_side import (  # noqa: E402
    D_MODEL, MLP, N_HEADS, N_LAYERS, VOCAB, OlmaxStep, write_json,
)

STEP_RE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+).*?loss: ([0-9.]+)")


def run_maxtext(a) -> dict:
    code = "import maxtext, os; print(os.path.dirname(maxtext.__file__))"
    root = subprocess.run([a.maxtext_python, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    out_dir = tempfile.mkdtemp(prefix="maxtext-bench-")
    cmd = [a.maxtext_python, "-m", "maxtext.trainers.pre_train.train", f"{root}/configs/base.yml",
           "run_name=bench", f"base_output_directory={out_dir}", "model_name=olmo3-7b",
           "override_model_config=true", f"base_emb_dim={D_MODEL}", f"base_num_query_heads={N_HEADS}",
           f"base_num_kv_heads={N_HEADS}", f"head_dim={D_MODEL // N_HEADS}", f"base_mlp_dim={MLP}",
           f"base_num_decoder_layers={N_LAYERS}", f"sliding_window_size={a.window}",
           f"vocab_size={VOCAB}", f"max_target_length={a.seq}", f"per_device_batch_size={a.batch}",
           "dataset_type=synthetic", f"steps={a.steps + 2}", "hardware=cpu",
           "skip_jax_distributed_system=true", "enable_checkpointing=false", "dtype=float32",
           "weight_dtype=float32", "remat_policy=minimal", "attention=dot_product",
           "z_loss_multiplier=1e-5", "gradient_clipping_threshold=1.0", "log_period=1"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    steps = [(int(m[1]), float(m[2]), float(m[3])) for m in STEP_RE.finditer(proc.stdout + proc.stderr)]
    if proc.returncode or len(steps) < 3:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"MaxText failed (rc {proc.returncode}): {' | '.join(tail)}")
    ver = subprocess.run([a.maxtext_python, "-c", "from importlib.metadata import version as v; "
                          "print(v('maxtext'), v('jax'))"], capture_output=True, text=True).stdout.split()
    times = [s for i, s, _ in steps if i >= 2]
    return {"framework": "MaxText (dot_product, float32, remat=minimal)",
            "version": f"maxtext {ver[0]}, jax {ver[1]}" if len(ver) == 2 else "?",
            "step_s": times, "step_s_median": statistics.median(times), "loss": steps[-1][2]}


def run_olmax(a) -> dict:
    s = OlmaxStep(a, a.attn)
    for _ in range(a.warmup):
        s.run()
    times = [s.run() for _ in range(a.steps)]
    return {"framework": s.name, "version": s.version, "step_s": times,
            "step_s_median": statistics.median(times), "loss": s.loss}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--maxtext-python", required=True)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--attn", default="chunked")
    p.add_argument("--timeout", type=int, default=2400)
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    a.dtype, a.remat = "float32", "none"

    legs = [run_olmax(a)]
    print(f"olmax leg 1: {legs[-1]['step_s']}", file=sys.stderr, flush=True)
    legs.append(run_maxtext(a))
    print(f"MaxText: {legs[-1]['step_s']}", file=sys.stderr, flush=True)
    legs.append(run_olmax(a))
    print(f"olmax leg 2: {legs[-1]['step_s']}", file=sys.stderr, flush=True)
    olmax_med = statistics.median(legs[0]["step_s"] + legs[2]["step_s"])
    mt_med = legs[1]["step_s_median"]
    tokens = a.batch * a.seq
    print(f"\nsame shape as cpu_side_by_side.py; batch {a.batch} x seq {a.seq}, windows [{a.window}]*3+[full]; "
          f"sequential sandwich olmax / MaxText / olmax; 1-min load avg at end {os.getloadavg()[0]:.1f}\n")
    print("| framework | version | step s (median) | tokens/s | speed vs MaxText |")
    print("|---|---|---|---|---|")
    print(f"| {legs[1]['framework']} | {legs[1]['version']} | {mt_med:.2f} | {tokens / mt_med:.0f} | 1.00x |")
    print(f"| {legs[0]['framework']} | {legs[0]['version']} | {olmax_med:.2f} | {tokens / olmax_med:.0f} | "
          f"{mt_med / olmax_med:.2f}x |")
    write_json(a.json_out, {"args": vars(a), "legs": legs, "speedup_vs_maxtext": mt_med / olmax_med})
    return 0


if __name__ == "__main__":
    sys.exit(main())
