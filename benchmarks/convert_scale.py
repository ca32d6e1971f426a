"""HF <-> olmax conversion at full model scale: time, peak memory, bit-exact round trip.

No released weights are reachable offline, so the script writes a synthetic HF ``Olmo3ForCausalLM``
directory of the preset's exact shapes (random finite bf16 values, 5 GB shards with an index, as
AI2 publishes them), then runs ``olmax convert hf-to-olmax`` and ``olmax convert olmax-to-hf`` as
separate processes (each reports its peak resident memory), and finally compares every exported
tensor with the synthetic original, bit for bit.

    python benchmarks/convert_scale.py [--preset olmo3-7b] [--dtype bfloat16] [--work DIR]
        [--keep] [--json benchmarks/results/convert_7b.json]

Needs about 3x the model's size on disk (HF in, olmax checkpoint, HF out); both conversions
stream, so memory stays at a few chunks whatever the model size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from cpu_side_by_side import write_json

WRAPPER = ("import resource, sys\nfrom olmax.cli import main\nrc = main(sys.argv[1:])\n"
           "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
           "sys.exit(rc)\n")


def synthetic(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic random finite bf16 values (|x| in [2^-8, 2^-7) or thereabouts, either sign)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    bits = np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= np.uint16(0x807F)          # sign + mantissa
    bits |= np.uint16(0x3B80)          # a fixed exponent: finite, nonzero
    return bits.view(ml_dtypes.bfloat16)


def write_synthetic_hf(out: Path, preset: str, shard_bytes: int) -> tuple[int, int]:
    from olmax.interop import hf, hf_config, safetensors
    from olmax.model.presets import get_preset

    cfg = get_preset(preset)
    out.mkdir(parents=True)
    shapes = hf.hf_tensor_shapes(cfg)
    weight_map = safetensors.plan_shards(shapes, 2, shard_bytes)
    total = 0
    for fname in dict.fromkeys(weight_map.values()):
        layout = [(name, shapes[name], np.dtype(ml_dtypes.bfloat16))
                  for name, f in weight_map.items() if f == fname]
        nbytes = safetensors.write_safetensors(out / fname, layout,
                                       ((name, synthetic(name, shape)) for name, shape, _ in layout))
        total += nbytes
        print(f"  wrote {fname} ({nbytes / 1e9:.2f} GB)", file=sys.stderr, flush=True)
    if len(set(weight_map.values())) > 1:
        (out / safetensors.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                      "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config.hf_config_from_model(cfg, dtype="bfloat16"), indent=2))
    return total, len(shapes)


def run_convert(args: list[str]) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", WRAPPER, "convert", *args], capture_output=True,
                         text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"olmax convert {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    rss = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("MAXRSS_KB")]
    print("  " + out.stdout.strip().splitlines()[0], file=sys.stderr, flush=True)
    return {"seconds": wall, "peak_rss_bytes": rss[0] * 1024}


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="olmo3-7b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the olmax checkpoint (the HF files are bf16)")
    p.add_argument("--shard-gb", type=float, default=5.0)
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the three directories")
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()

    from olmax.interop.safetensors import SafetensorsDir

    work = Path(a.work or tempfile.mkdtemp(prefix="olmax-convert-scale-"))
    hf_in, ckpt, hf_out = work / "hf_in", work / "olmax", work / "hf_out"
    result: dict = {"preset": a.preset, "olmax_dtype": a.dtype}
    try:
        t0 = time.perf_counter()
        total, n_tensors = write_synthetic_hf(hf_in, a.preset, int(a.shard_gb * 1e9))
        result.update(hf_bytes=total, n_tensors=n_tensors, write_synthetic_s=time.perf_counter() - t0)
        print(f"synthetic HF dir: {total / 1e9:.2f} GB, {n_tensors} tensors", file=sys.stderr, flush=True)

        result["import"] = run_convert(["hf-to-olmax", str(hf_in), str(ckpt), "--dtype", a.dtype])
        result["olmax_bytes_on_disk"] = du(ckpt)
        result["export"] = run_convert(["olmax-to-hf", str(ckpt), str(hf_out), "--dtype", "bfloat16"])

        t0 = time.perf_counter()
        got = SafetensorsDir(hf_out)
        mismatched = []
        for name in SafetensorsDir(hf_in).names():
            a_ = got.read(name)
            b_ = synthetic(name, a_.shape)
            if a_.dtype != b_.dtype or not np.array_equal(a_.view(np.uint16), b_.view(np.uint16)):
                mismatched.append(name)
            del a_, b_
        result.update(compare_s=time.perf_counter() - t0, tensors_compared=n_tensors,
                      tensors_mismatched=mismatched, round_trip_bit_exact=not mismatched)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    gb = 1e9
    print(f"\n{a.preset}: HF {result['hf_bytes'] / gb:.2f} GB bf16 ({result['n_tensors']} tensors)\n"
          f"  hf-to-olmax ({a.dtype}): {result['import']['seconds']:.0f} s, peak RSS "
          f"{result['import']['peak_rss_bytes'] / gb:.2f} GB, checkpoint {result['olmax_bytes_on_disk'] / gb:.2f} GB\n"
          f"  olmax-to-hf (bf16): {result['export']['seconds']:.0f} s, peak RSS "
          f"{result['export']['peak_rss_bytes'] / gb:.2f} GB\n"
          f"  round trip bit-exact: {result['round_trip_bit_exact']} "
          f"({len(result['tensors_mismatched'])} of {n_tensors} tensors differ)")
    write_json(a.json_out, result)
    return 0 if result["round_trip_bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
