"""MaxText (its own Python >= 3.12 virtual environment) and olmax on a CPU side-by-side shape.

MaxText runs in another interpreter, so steps cannot be interleaved in one process as with
OLMo-core; instead the run is a sandwich -- olmax, MaxText, olmax -- and the ratio uses the median
olmax step of both olmax legs against the fastest MaxText leg's median step. The shape is one of
``benchmarks/shapes.py``'s (``--shape``: ``d768``, ``A``, ``B``; fp32 parameters), given to MaxText's
own OLMo 3 model (``model_name=olmo3-7b`` with the widths overridden; ``attention=dot_product``,
which applies the sliding window; ``remat_policy=minimal``, its least-recompute policy; synthetic
data; z-loss 1e-5; clipping 1.0). MaxText's step time is its own "completed step: N, seconds: S"
log line; its first two steps (compilation, warm-up) are dropped. Each leg's peak resident memory
is that of its process (``ru_maxrss``; the olmax legs run in a child process each, like MaxText).

    python benchmarks/maxtext_side_by_side.py --maxtext-python /path/to/py312-venv/bin/python \
        [--shape A] [--dtype bfloat16] [--maxtext-dtypes float32,bfloat16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from cpu_side_by_side import OlmaxStep, _shape_args, apply_host_malloc, write_json
from shapes import SHAPES

STEP_RE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+).*?loss: ([0-9.]+)")


def run_measured(cmd: list[str], env: dict, timeout: int) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``cmd``; its output and its own peak RSS in bytes (``wait4``'s rusage of that child)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                child.kill()
                raise SystemExit(f"timed out after {timeout} s: {' '.join(cmd[:3])} ...")
            time.sleep(0.5)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return (subprocess.CompletedProcess(cmd, child.returncode, out.read(), err.read()),
                usage.ru_maxrss * 1024)


def run_maxtext(a, dtype: str) -> dict:
    code = "import maxtext, os; print(os.path.dirname(maxtext.__file__))"
    root = subprocess.run([a.maxtext_python, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    out_dir = tempfile.mkdtemp(prefix="maxtext-bench-")
    s = _shape_args(a)
    cmd = [a.maxtext_python, "-m", "maxtext.trainers.pre_train.train", f"{root}/configs/base.yml",
           "run_name=bench", f"base_output_directory={out_dir}", "model_name=olmo3-7b",
           "override_model_config=true", f"base_emb_dim={s['d_model']}", f"base_num_query_heads={s['n_heads']}",
           f"base_num_kv_heads={s['n_heads']}", f"head_dim={s['d_model'] // s['n_heads']}",
           f"base_mlp_dim={s['mlp_hidden']}", f"base_num_decoder_layers={s['n_layers']}",
           f"sliding_window_size={s['window']}", f"vocab_size={s['vocab']}",
           f"max_target_length={s['seq']}", f"per_device_batch_size={s['batch']}",
           "dataset_type=synthetic", f"steps={a.steps + 2}", "hardware=cpu",
           "skip_jax_distributed_system=true", "enable_checkpointing=false", f"dtype={dtype}",
           "weight_dtype=float32", "remat_policy=minimal", "attention=dot_product",
           "z_loss_multiplier=1e-5", "gradient_clipping_threshold=1.0", "log_period=1"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if a.host_malloc == "keep":   # the same allocator set-up as the olmax legs, via glibc's tunables
        from olmax.host_memory import GLIBC_TUNABLES
        env["GLIBC_TUNABLES"] = GLIBC_TUNABLES
    proc, rss = run_measured(cmd, env, a.timeout)
    steps = [(int(m[1]), float(m[2]), float(m[3])) for m in STEP_RE.finditer(proc.stdout + proc.stderr)]
    if proc.returncode or len(steps) < 3:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"MaxText failed (rc {proc.returncode}): {' | '.join(tail)}")
    ver = subprocess.run([a.maxtext_python, "-c", "from importlib.metadata import version as v; "
                          "print(v('maxtext'), v('jax'))"], capture_output=True, text=True).stdout.split()
    times = [s for i, s, _ in steps if i >= 2]
    return {"framework": f"MaxText (dot_product, {dtype}, fp32 weights, remat=minimal)",
            "version": f"maxtext {ver[0]}, jax {ver[1]}" if len(ver) == 2 else "?",
            "step_s": times, "step_s_median": statistics.median(times), "loss": steps[-1][2],
            "peak_rss_bytes": rss}


def olmax_leg(a) -> dict:
    """One olmax leg in this process (``--leg``): warm-up, timed steps, peak RSS."""
    s = OlmaxStep(a, a.attn, a.dtype)
    for _ in range(a.warmup):
        s.run()
    times = [s.run() for _ in range(a.steps)]
    return {"framework": s.name, "version": s.version, "step_s": times,
            "step_s_median": statistics.median(times), "loss": s.loss,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_olmax(a) -> dict:
    cmd = [sys.executable, __file__, "--leg", "--maxtext-python", a.maxtext_python, "--shape", a.shape,
           "--dtype", a.dtype, "--steps", str(a.steps), "--warmup", str(a.warmup), "--attn", a.attn,
           "--host-malloc", a.host_malloc]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode:
        raise SystemExit(f"olmax leg failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--maxtext-python", required=True)
    p.add_argument("--shape", default="d768", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", help="olmax compute dtype")
    p.add_argument("--maxtext-dtypes", default="float32",
                   help="MaxText legs' compute dtypes (comma list; weights fp32 either way)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--attn", default="chunked")
    p.add_argument("--timeout", type=int, default=2400)
    p.add_argument("--json", dest="json_out")
    p.add_argument("--host-malloc", choices=("system", "keep"), default="system",
                   help="keep: every leg (MaxText's through GLIBC_TUNABLES) keeps large host blocks "
                        "mapped between steps, as the olmax command does with OLMAX_HOST_MALLOC=keep; "
                        "system: glibc's defaults")
    p.add_argument("--leg", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.remat, a.batch, a.seq, a.window = "none", None, None, None
    if a.leg:
        apply_host_malloc(a.host_malloc)
        print(json.dumps(olmax_leg(a)))
        return 0

    legs = [run_olmax(a)]
    print(f"olmax leg 1: {legs[-1]['step_s']}", file=sys.stderr, flush=True)
    mts = []
    for dt in a.maxtext_dtypes.split(","):
        mts.append(run_maxtext(a, dt))
        print(f"MaxText {dt}: {mts[-1]['step_s']}", file=sys.stderr, flush=True)
    legs.append(run_olmax(a))
    print(f"olmax leg 2: {legs[-1]['step_s']}", file=sys.stderr, flush=True)
    olmax_med = statistics.median(legs[0]["step_s"] + legs[1]["step_s"])
    best = min(m["step_s_median"] for m in mts)
    s = _shape_args(a)
    tokens = s["batch"] * s["seq"]
    gib = lambda leg: f"{leg['peak_rss_bytes'] / 2**30:.2f} GiB" if leg.get("peak_rss_bytes") else "-"  # noqa: E731
    print(f"\nshape {a.shape}: {s['label']}; batch {s['batch']} x seq {s['seq']}; sequential sandwich "
          f"olmax / MaxText / olmax; 1-min load avg at end {os.getloadavg()[0]:.1f}\n")
    print("| framework | version | step s (median) | tokens/s | speed vs fastest MaxText | peak RSS |")
    print("|---|---|---|---|---|---|")
    for m in mts:
        print(f"| {m['framework']} | {m['version']} | {m['step_s_median']:.2f} | "
              f"{tokens / m['step_s_median']:.0f} | {best / m['step_s_median']:.2f}x | {gib(m)} |")
    print(f"| {legs[0]['framework']}, both legs | {legs[0]['version']} | {olmax_med:.2f} | "
          f"{tokens / olmax_med:.0f} | {best / olmax_med:.2f}x | {gib(legs[0])} / {gib(legs[1])} |")
    write_json(a.json_out, {"args": vars(a), "olmax_legs": legs, "maxtext_legs": mts,
                            "speedup_vs_fastest_maxtext": best / olmax_med})
    return 0


if __name__ == "__main__":
    sys.exit(main())
