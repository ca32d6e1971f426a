"""TPU check (driven by ``tpu.sh``): the measured matmul ceiling, then ``olmax bench train`` over a
ladder of OLMo 3 sizes at sequence 4096 in bf16, each at the micro-batch and remat policy
``auto`` chooses on the chip (splash attention; of the steps that fit, the one estimated fastest
from the chip's measured rates, ``train.auto_choice``), in one table: step ms, tokens/s, MFU in both
conventions, % of the measured ceiling, the compiled peak against the chip's memory, the device
counter beside it. Each row is also written as a calibration case of ``olmax plan``
(``benchmarks/calibration/`` format, ``peer.program: olmax``), and, while time is left, planned
on the chip's host by ``olmax plan --topology v5e:1x1`` at the row's settings (fit and estimate
beside the measurement). The measurements run in a process of their own and the plans after it
has ended: libtpu lets one process at a time hold the chip, and a plan loads libtpu too.

The ladder (``--rows``): ``olmo3-190m`` and ``olmo3-370m`` at 16 x 4096, ``olmo3-600m`` at
8 x 4096, and ``7b-slice``: OLMo 3 7B's own layer shapes (d_model 4096, 32 heads of 128, MLP
11008, QK-norm), one sliding-window layer (4096) and one full layer, at 4 x 4096, with the
vocabulary cut to 32,768 rows, so that its fp32 weights and Adam moments fit one v5e chip (the 7B's
100,352-row embedding and LM head alone would take 9.9 GB of the 15.75; a 4-layer period of the
7B's pattern at 32,768 rows needs 18.0 GiB at the least, micro-batch 4 with full remat, compiled
for v5e:1x1); MFU counts the slice's own FLOPs. Compiled for v5e:1x1 here, the slice fits at
micro-batch 4 with no remat: 14.04 GiB of 15.75.

A time budget (``--budget-s``) keeps the whole within one call: a row that would start after it is
listed as not run. Without a TPU (or with ``--tiny``) the same code runs on tiny shapes, so that
the script itself is tested anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = {
    "olmo3-190m": ({"preset": "olmo3-190m"}, 16),
    "olmo3-370m": ({"preset": "olmo3-370m"}, 16),
    "olmo3-600m": ({"preset": "olmo3-600m"}, 8),
    "7b-slice": ({"preset": "olmo3-7b", "n_layers": 2, "window_pattern": [4096, None],
                  "vocab_size": 32000, "padded_vocab_size": 32768}, 4),
}
SEQ = 4096
TINY = {"preset": "olmo3-tiny", "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
        "mlp_hidden": 128, "vocab_size": 120, "padded_vocab_size": 128,
        "window_pattern": [32, 32, 32, None], "max_seq_len": 128}


def overrides(model: dict, batch: int, seq: int, tiny: bool) -> list[str]:
    """The row as ``olmax`` overrides (what ``olmax bench train olmo3_tiny ...`` and ``olmax plan``
    take, and the calibration case records)."""
    out = [f"model.{k}={json.dumps(v) if isinstance(v, list) else ('null' if v is None else v)}"
           for k, v in model.items()]
    if not tiny and "max_seq_len" not in model:
        out.append(f"model.max_seq_len={seq}")
    return out + [f"train.seq_len={seq}", f"train.global_batch_size={batch}",
                  f"train.compute_dtype={'float32' if tiny else 'bfloat16'}", "train.attn_impl=auto",
                  "train.micro_batch_size=auto", "train.remat=auto", "data.embedded=true"]


def case(name: str, row: dict, args: list[str], versions: dict, date: str) -> dict:
    """The row as a calibration case of ``olmax plan`` (benchmarks/calibration/ format)."""
    fixed = [a for a in args if not a.startswith(("train.micro_batch_size=", "train.remat="))]
    fixed += [f"train.micro_batch_size={row['micro_batch_size']}", f"train.remat={row['remat']}"]
    # the kernels', the layer loop's, the loss chunk's, the gradient accumulation's and the
    # compiler's settings pinned as measured (the TPU profile's and v5e's where the run left them
    # to them): a later default must not change the case's program
    from olmax.platforms import PROFILES
    from olmax.train.recipes import load_recipe

    train = load_recipe("olmo3_tiny", args, find_mix=False).train
    tpu = PROFILES["tpu"]
    micro = int(row["micro_batch_size"])
    resolved = {"splash_block": train.splash_block, "splash_fused_bwd": train.splash_fused_bwd,
                "unroll_layers": tpu.unroll_layers if train.unroll_layers is None else train.unroll_layers,
                "loss_chunk_rows": train.loss_chunk_rows or tpu.loss_chunk(micro, 1) * micro,
                "accumulate_by_layer": train.accumulate_by_layer,
                "accumulate_embedding_by_row": train.accumulate_embedding_by_row}
    for key, value in resolved.items():
        if not any(a.startswith(f"train.{key}=") for a in fixed):
            fixed.append(f"train.{key}={str(value).lower() if isinstance(value, bool) else value}")
    # the compiler's options as the step had them: v5e's own (olmax.hardware) under the run's
    from olmax.platforms import compiler_options

    options = compiler_options("tpu", ["TPU v5 lite"], train.compiler_options_dict()) or {}
    fixed = [a for a in fixed if not a.startswith("train.compiler_options=")]
    if options:
        fixed.append("train.compiler_options=[" + ", ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sorted(options.items())) + "]")
    return {"name": f"olmax_{name.replace('-', '_')}_v5e_1x1", "accelerator": "v5e", "topology": "v5e:1x1",
            "devices": 1,
            "peer": {"program": "olmax", "version": f"olmax {versions['olmax']} (jax {versions['jax']}, "
                                                    f"libtpu {versions['libtpu']})",
                     "launcher": "benchmarks/tpu.sh (benchmarks/tpu_bench.py)", "topology": "v5e:1x1",
                     "recipe": "olmo3_tiny", "args": fixed},
            "measured": {"step_s": row["step_s"], "mfu": row["mfu_causal"], "convention": "causal",
                         "source": f"measured with olmax on one TPU v5e chip, {date}: median of "
                                   f"{row['steps']} timed steps after warm-up (benchmarks/tpu.sh)"}}


def plan_row(args: list[str], timeout: float, topology: str | None) -> dict:
    """``olmax plan --topology v5e:1x1`` of a row at its settings (tiny shapes: the local devices),
    in a process of its own."""
    out = HERE / ".plan.json"
    cmd = [sys.executable, "-m", "olmax.cli", "plan", "olmo3_tiny", *args, "--json", str(out),
           "--force", *(["--topology", topology] if topology else [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"plan took over {timeout:.0f} s"}
    if proc.returncode not in (0, 1) or not out.exists():
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    p = json.loads(out.read_text())
    out.unlink()
    return {"fits": p["memory"]["fits"], "peak_bytes": p["memory"]["peak_bytes"],
            "hbm_bytes": p["memory"]["hbm_bytes"], "step_s": (p.get("estimate") or {}).get("step_s"),
            "method": (p.get("estimate") or {}).get("method")}


def measure(a: argparse.Namespace, t_start: float) -> dict:
    """The ceiling and each row's step, measured in this process (the one that holds the chip)."""
    from olmax.reporting import route_startup_noise

    route_startup_noise()          # JAX's Cloud TPU warnings (hugepages): not the table's business
    import jax

    import olmax
    from olmax.perf.bench import bench_train, matmul_ceiling
    from olmax.train.recipes import load_recipe

    tpu = jax.default_backend() == "tpu"
    tiny = a.tiny or not tpu
    dev = jax.devices()[0]
    try:
        from importlib.metadata import version
        libtpu = version("libtpu")
    except Exception:
        libtpu = None
    versions = {"olmax": olmax.__version__, "jax": jax.__version__, "libtpu": libtpu,
                "python": sys.version.split()[0], "device": dev.device_kind}
    print(f"device: {dev.device_kind} ({dev.platform}) x{jax.device_count()}, jax {jax.__version__}, "
          f"libtpu {libtpu}" + ("  [tiny shapes]" if tiny else ""), flush=True)
    ceil = matmul_ceiling(size=256 if tiny else 8192, dtype="float32" if tiny else "bfloat16",
                          iters=3 if tiny else 20)
    print(f"matmul ceiling: {ceil['flops_per_s'] / 1e12:.3g} TFLOP/s ({ceil['size']}^3 {ceil['dtype']})"
          + (f", {100 * ceil['flops_per_s'] / ceil['peak_flops']:.1f}% of the "
             f"{ceil['peak_flops'] / 1e12:.0f} TFLOP/s peak" if ceil["peak_flops"] else ""), flush=True)

    rows: list[dict] = []
    for name in a.rows.split(","):
        model, batch = (dict(TINY), 4) if tiny else ROWS[name]
        args = overrides(model, batch, 64 if tiny else SEQ, tiny) + a.extra
        if time.perf_counter() - t_start > a.budget_s:
            rows.append({"row": name, "args": args, "error": "not run: the time budget was spent"})
            continue
        try:
            r = bench_train(load_recipe("olmo3_tiny", args), steps=a.steps, warmup=1,
                            ceiling_flops=ceil["flops_per_s"]).to_dict()
        except Exception as e:   # a row that fails is reported, the ladder goes on
            from olmax.reporting import describe_error

            rows.append({"row": name, "args": args, "error": describe_error(e)})
            print(f"{name}: {rows[-1]['error']}", flush=True)
            continue
        rows.append({"row": name, "args": args, **r})
        print(f"{name}: micro-batch {r['micro_batch_size']}, remat {r['remat']}: step "
              f"{r['step_s'] * 1e3:.0f} ms, {r['tokens_per_s']:,.0f} tokens/s, MFU "
              f"{100 * (r['mfu_causal'] or 0):.1f}% causal (compile {r['compile_s']:.0f} s, "
              f"{len(r['fit_trials'])} candidates, chosen by {r.get('fit_chosen_by', 'memory')})",
              flush=True)
    return {"versions": versions, "matmul": ceil, "date": datetime.date.today().isoformat(),
            "tiny": tiny, "rows": rows}


def measure_apart(t_start: float) -> dict:
    """:func:`measure` in a process of its own, so that the chip is free when it ends: libtpu lets
    one process at a time hold a TPU (its lock file), and ``olmax plan`` loads libtpu too."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "measured.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:],
                               "--measure-to", str(out)])
        if not out.exists():
            raise SystemExit(f"tpu_bench: the measuring process ended with exit {proc.returncode} "
                             "and wrote nothing")
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (automatic without a TPU)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"rows of the ladder ({', '.join(ROWS)})")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=480, help="start no row after this many seconds")
    p.add_argument("--no-plan", action="store_true", help="measure only")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="an override added to every row (repeatable), e.g. train.splash_fused_bwd=true")
    p.add_argument("--json", dest="json_out")
    p.add_argument("--cases", help="write each row's calibration case (YAML) into this folder")
    p.add_argument("--measure-to", help=argparse.SUPPRESS)   # the measuring process's result
    a = p.parse_args()
    t_start = time.perf_counter()
    if a.measure_to:
        from olmax.io import write_json_atomic

        write_json_atomic(a.measure_to, measure(a, t_start), overwrite=True)
        return 0
    # the plans load libtpu after the measuring process has let go of the chip
    result = measure(a, t_start) if a.no_plan else measure_apart(t_start)
    versions, ceil, date, tiny, rows = (result[k] for k in ("versions", "matmul", "date", "tiny", "rows"))
    import yaml

    for row in rows:
        if "error" in row or a.no_plan:
            continue
        left = a.budget_s + 60 - (time.perf_counter() - t_start)
        if left < 30:
            row["plan"] = {"error": "not planned: the time budget was spent"}
            continue
        fixed = [x for x in row["args"] if not x.startswith(("train.micro_batch_size=", "train.remat="))]
        row["plan"] = plan_row(fixed + [f"train.micro_batch_size={row['micro_batch_size']}",
                                        f"train.remat={row['remat']}"], min(left, 240),
                               None if tiny else "v5e:1x1")

    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}"  # noqa: E731
    from olmax.device_memory import gib
    print(f"\nOLMo 3 ladder at sequence {64 if tiny else SEQ}, {'float32' if tiny else 'bfloat16'}, "
          f"splash on TPU; ceiling {ceil['flops_per_s'] / 1e12:.3g} TFLOP/s")
    print("| row | batch x seq | micro | remat | step ms | tokens/s | MFU % causal | MFU % OLMo-core "
          "| % of ceiling (causal) | compiled peak / limit | device counter | plan: fits, "
          "estimate ms (est/meas) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['row']} | {r['error']} |||||||||||")
            continue
        plan = r.get("plan") or {}
        if "error" in plan:
            planned = plan["error"]
        elif plan:
            est = plan["step_s"]
            planned = (f"{'fits' if plan['fits'] else 'DOES NOT FIT'}, " +
                       ("n/a" if est is None else f"{est * 1e3:.0f} ({est / r['step_s']:.2f})"))
        else:
            planned = "n/a"
        remat = r["remat"] + (f" ({r['compiler_remat_ops']} recomputed by the compiler)"
                              if r.get("compiler_remat_ops") else "")
        print(f"| {r['row']} | {r['batch']} x {r['seq_len']} | {r['micro_batch_size']} | {remat} | "
              f"{r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:,.0f} | {pct(r['mfu_causal'])} | "
              f"{pct(r['mfu_olmo_core'])} | {pct(r['pct_of_ceiling_causal'])} | "
              f"{gib(r['peak_memory_bytes'])} / {gib(r['memory_limit_bytes'])} | "
              f"{gib(r['device_peak_bytes'])} | {planned} |")
    result = {"versions": versions, "matmul": ceil, "date": date, "tiny": tiny, "rows": rows}
    if a.json_out:
        from olmax.io import write_json_atomic

        write_json_atomic(a.json_out, result, overwrite=True)
    if a.cases:
        folder = Path(a.cases)
        folder.mkdir(parents=True, exist_ok=True)
        for r in rows:
            if "error" not in r:
                c = case(r["row"], r, r["args"], versions, date)
                (folder / f"{c['name']}.yaml").write_text(yaml.safe_dump(c, sort_keys=False))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
