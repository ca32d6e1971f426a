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

``--sparse`` (for models larger than the disk, e.g. ``--preset olmo3-32b``: 64.7 GB in bf16)
writes each shard as its header and a hole of the data's length (``truncate``), then the first
and last row of every tensor (1-D tensors whole) with random finite values: zeros elsewhere,
which the file system does not store and Orbax compresses to almost nothing. Only the import
runs (an export would write the whole model); the check reads the checkpoint back tensor by
tensor through the export's reader (``iter_hf_tensors``) and compares the written rows bit for
bit and counts every other value zero.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from cpu_side_by_side import write_json

# The child's own peak (VmHWM of /proc/self/status): ru_maxrss would also count the pages of the
# benchmark process it was forked from, which Linux carries across exec.
WRAPPER = ("import re, sys\nfrom olmax.cli import main\nrc = main(sys.argv[1:])\n"
           "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
           "print('MAXRSS_KB', hwm, flush=True)\nsys.exit(rc)\n")


def synthetic(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic random finite bf16 values (|x| in [2^-8, 2^-7) or thereabouts, either sign)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    bits = np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= np.uint16(0x807F)          # sign + mantissa
    bits |= np.uint16(0x3B80)          # a fixed exponent: finite, nonzero
    return bits.view(ml_dtypes.bfloat16)


def write_index_and_config(out: Path, weight_map: dict, total: int, cfg) -> None:
    """The HF directory's index (when the weights span files) and its config.json."""
    from olmax.interop import hf_config, safetensors

    if len(set(weight_map.values())) > 1:
        (out / safetensors.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                              "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config.hf_config_from_model(cfg, dtype="bfloat16"),
                                                indent=2))


def write_synthetic_hf(out: Path, preset: str, shard_bytes: int) -> tuple[int, int]:
    from olmax.interop import hf, safetensors
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
    write_index_and_config(out, weight_map, total, cfg)
    return total, len(shapes)


def marker_rows(name: str, shape: tuple[int, ...]) -> list[tuple[int, np.ndarray]]:
    """The rows ``--sparse`` writes of a tensor: (first row index, rows) -- a 1-D tensor whole,
    else its first and last row."""
    if len(shape) == 1:
        return [(0, synthetic(name, shape))]
    row = (1, *shape[1:])
    return [(0, synthetic(name + ":first", row)), (shape[0] - 1, synthetic(name + ":last", row))]


def write_sparse_hf(out: Path, preset: str, shard_bytes: int) -> tuple[int, int, int]:
    """The HF directory of ``write_synthetic_hf`` with holes for data but :func:`marker_rows`.
    Returns (data bytes, tensors, bytes the files occupy on disk)."""
    from olmax.interop import hf, safetensors
    from olmax.model.presets import get_preset

    cfg = get_preset(preset)
    out.mkdir(parents=True)
    shapes = hf.hf_tensor_shapes(cfg)
    weight_map = safetensors.plan_shards(shapes, 2, shard_bytes)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    total = 0
    for fname in dict.fromkeys(weight_map.values()):
        layout = [(name, shapes[name], bf16) for name, f in weight_map.items() if f == fname]
        head, nbytes = safetensors.safetensors_header(layout)
        start = len(head)
        with open(out / fname, "wb") as f:
            f.write(head)
            f.truncate(start + nbytes)     # the data: a hole, read back as zeros
            offset = 0
            for name, shape, _ in layout:
                row = math.prod(shape[1:]) * 2
                for first, rows in marker_rows(name, shape):
                    f.seek(start + offset + first * row)
                    f.write(rows.reshape(-1).view(np.uint8).data)
                offset += math.prod(shape) * 2
        total += nbytes
        print(f"  wrote {fname} ({nbytes / 1e9:.2f} GB, sparse)", file=sys.stderr, flush=True)
    write_index_and_config(out, weight_map, total, cfg)
    return total, len(shapes), disk_usage(out)


def check_sparse(ckpt: Path, hf_in: Path) -> list[str]:
    """Names of the tensors whose export (read from the checkpoint one at a time) is not the
    sparse original: its marker rows bit for bit, zeros everywhere else."""
    from olmax.checkpoint.weights import stored_arrays
    from olmax.interop.hf import iter_hf_tensors
    from olmax.interop.safetensors import SafetensorsDir

    shapes = {name: SafetensorsDir(hf_in).info(name)[0] for name in SafetensorsDir(hf_in).names()}
    params, cfg = stored_arrays(ckpt)
    bad = []
    for name, w in iter_hf_tensors(params, cfg, "bfloat16"):
        bits = w.view(np.uint16)
        marked = np.zeros(bits.shape, bool)
        ok = tuple(w.shape) == shapes.pop(name)
        for first, rows in marker_rows(name, w.shape):
            ok = ok and np.array_equal(bits[first:first + len(rows)], rows.view(np.uint16))
            marked[first:first + len(rows)] = True
        ok = ok and not bits[~marked].any()
        if not ok:
            bad.append(name)
        del w, bits, marked
    return bad + sorted(shapes)      # and any tensor the export did not give


def disk_usage(path: Path) -> int:
    """Bytes the files under ``path`` occupy (allocated blocks: holes do not count)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


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
    p.add_argument("--sparse", action="store_true",
                   help="header + holes + marker rows, import only (models larger than the disk)")
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()

    from olmax.interop.safetensors import SafetensorsDir

    work = Path(a.work or tempfile.mkdtemp(prefix="olmax-convert-scale-"))
    hf_in, ckpt, hf_out = work / "hf_in", work / "olmax", work / "hf_out"
    result: dict = {"preset": a.preset, "olmax_dtype": a.dtype}
    try:
        if a.sparse:
            return sparse_run(a, hf_in, ckpt, result)
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


def sparse_run(a: argparse.Namespace, hf_in: Path, ckpt: Path, result: dict) -> int:
    """``--sparse``: write the sparse directory, import it, check the checkpoint (see the module
    docstring)."""
    t0 = time.perf_counter()
    total, n_tensors, on_disk = write_sparse_hf(hf_in, a.preset, int(a.shard_gb * 1e9))
    result.update(sparse=True, hf_bytes=total, hf_bytes_on_disk=on_disk, n_tensors=n_tensors,
                  write_synthetic_s=time.perf_counter() - t0)
    print(f"sparse synthetic HF dir: {total / 1e9:.2f} GB ({on_disk / 1e6:.1f} MB on disk), "
          f"{n_tensors} tensors", file=sys.stderr, flush=True)
    result["import"] = run_convert(["hf-to-olmax", str(hf_in), str(ckpt), "--dtype", a.dtype])
    result["olmax_bytes_on_disk"] = disk_usage(ckpt)
    t0 = time.perf_counter()
    bad = check_sparse(ckpt, hf_in)
    result.update(compare_s=time.perf_counter() - t0, tensors_compared=n_tensors,
                  tensors_mismatched=bad, checkpoint_equal=not bad)
    gb = 1e9
    print(f"\n{a.preset} (sparse): HF {total / gb:.2f} GB bf16 ({n_tensors} tensors, "
          f"{on_disk / 1e6:.1f} MB on disk)\n"
          f"  hf-to-olmax ({a.dtype}): {result['import']['seconds']:.0f} s, peak RSS "
          f"{result['import']['peak_rss_bytes'] / gb:.2f} GB, checkpoint "
          f"{result['olmax_bytes_on_disk'] / 1e6:.1f} MB on disk\n"
          f"  checkpoint read back as HF tensors ({result['compare_s']:.0f} s): "
          f"{n_tensors - len(bad)} of {n_tensors} equal to the original")
    write_json(a.json_out, result)
    return 0 if not bad else 1

if __name__ == "__main__":
    sys.exit(main())
