"""OLMo-core <-> olmax conversion at the 7B's tensor shapes: time and peak host memory both ways,
and reading in place from a loopback HTTP server against reading from disk.

No AI2 checkpoint is reachable offline, so the script writes a synthetic OLMo-core checkpoint with
olmax's own writer (``model_and_optim/`` DCP, ``train/rank0.pt``, ``config.json``): the preset's
exact tensor shapes (the 100352-row embedding and LM head, a layer's 4096 x 4096 and
11008 x 4096 matrices) with ``--layers`` of its layers (per-layer costs add up), fp32 values
that are zero except for one row in 64 (``--weights-only``: the model alone). Then, each in its own
process reporting its peak resident memory:

1. ``olmax convert olmo-core-to-olmax`` from disk;
2. the same from ``http://127.0.0.1`` (a threaded server with Range support over the same files);
3. ``olmax convert olmax-to-olmo-core`` of the result;

and compares the exported ``model_and_optim/`` with the synthetic original, tensor by tensor.

    python benchmarks/olmo_core_convert.py [--preset olmo3-7b] [--layers 2] [--weights-only]
        [--work DIR] [--json benchmarks/results/olmo_core_convert_7b.json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

# The child's own peak (VmHWM of /proc/self/status): ru_maxrss would also count the pages of the
# benchmark process it was forked from, which Linux carries across exec.
WRAPPER = ("import re, sys\nfrom olmax.cli import main\nrc = main(sys.argv[1:])\n"
           "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
           "print('MAXRSS_KB', hwm, flush=True)\nsys.exit(rc)\n")


def synthetic(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Zeros with one row in 64 of small random values (a compressible, finite fp32 tensor)."""
    a = np.zeros(shape, np.float32)
    rows = a.reshape(shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
    rows[::64] = np.random.default_rng(seed).standard_normal(rows[::64].shape, np.float32) * 0.02
    return a


def write_checkpoint(out: Path, preset: str, layers: int, weights_only: bool) -> int:
    from olmax.config import OptimConfig
    from olmax.interop.olmo_core.convert import (GROUP_KEYS, olmo_core_config,
                                                 trainer_state_dict)
    from olmax.interop.olmo_core.dcp import write_dcp
    from olmax.interop.olmo_core.torch_zip import write_torch_save
    from olmax.model.params import olmo_core_tensors
    from olmax.model.presets import get_preset

    cfg = get_preset(preset).replace(n_layers=layers, window_pattern=(4096,) * (layers - 1) + (None,)
                                     if layers > 1 else (None,))
    tensors = olmo_core_tensors(cfg)
    optim = OptimConfig()

    def items():
        for i, t in enumerate(tensors):
            yield f"model.{t.name}", synthetic(t.shape, i)
        if weights_only:
            return
        for i, t in enumerate(tensors):
            yield f"optim.state.{t.name}.step", np.asarray(1000.0, np.float32)
            yield f"optim.state.{t.name}.exp_avg", synthetic(t.shape, 10_000 + i)
            yield f"optim.state.{t.name}.exp_avg_sq", np.abs(synthetic(t.shape, 20_000 + i))
        for t in tensors:
            decay = 0.0 if t.path[-1] in optim.no_decay else optim.weight_decay
            group = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps,
                     "weight_decay": decay, "initial_lr": optim.lr}
            for key in GROUP_KEYS:
                yield f"optim.param_groups.{t.name}.{key}", group[key]

    (out / "model_and_optim").mkdir(parents=True)
    write_dcp(out / "model_and_optim", items(), checkpoint_id=str(out / "model_and_optim"))
    meta = {"step": 1000, "data_position": 1000, "seed": 1,
            "config": {"train": {"global_batch_size": 512, "seq_len": 8192}}}
    (out / "train").mkdir()
    with open(out / "train" / "rank0.pt", "wb") as f:
        write_torch_save(f, trainer_state_dict(meta, cfg))
    (out / "config.json").write_text(json.dumps(olmo_core_config(cfg, None)))
    (out / ".metadata.json").write_text(json.dumps({"version": "3.0.0"}))
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def run(argv: list[str]) -> tuple[float, float]:
    """Seconds and peak RSS (GB) of one olmax command in its own process."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *argv], capture_output=True, text=True,
                          check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
    kb = int(next(line.split()[1] for line in proc.stdout.splitlines()
                  if line.startswith("MAXRSS_KB")))
    return seconds, kb * 1024 / 1e9


class _RangeHandler(BaseHTTPRequestHandler):
    """HEAD and ranged GET of the files under the server's root (what a bucket's HTTP gives)."""

    protocol_version = "HTTP/1.1"
    root = Path(".")

    def log_message(self, *args):
        pass

    def _file(self) -> Path | None:
        path = (self.root / self.path.split("?", 1)[0].lstrip("/")).resolve()
        if not path.is_file() or self.root.resolve() not in path.parents:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return path

    def do_HEAD(self) -> None:
        path = self._file()
        if path is not None:
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

    def do_GET(self) -> None:
        path = self._file()
        if path is None:
            return
        size = path.stat().st_size
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        start, end = (int(m.group(1)), min(int(m.group(2) or size - 1), size - 1)) if m \
            else (0, size - 1)
        self.send_response(206 if m else 200)
        if m:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start + 1
            while left > 0:
                block = f.read(min(left, 1 << 20))
                self.wfile.write(block)
                left -= len(block)


def serve(root: Path) -> tuple[ThreadingHTTPServer, str]:
    handler = type("Handler", (_RangeHandler,), {"root": root})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def same(a: Path, b: Path) -> tuple[int, int]:
    from olmax.interop.olmo_core.dcp import DcpReader, Files

    ra, rb = DcpReader(Files(a)), DcpReader(Files(b))
    keys = sorted(ra.meta.tensors)
    equal = sum(1 for k in keys if k in rb.meta.tensors
                and ra.tensor(k).tobytes() == rb.tensor(k).tobytes())
    return equal, len(keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="olmo3-7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--weights-only", action="store_true")
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="oc-convert-"))
    flag = ["--weights-only"] if args.weights_only else []
    try:
        src = work / "oc" / "step1000"
        t0 = time.perf_counter()
        size = write_checkpoint(src, args.preset, args.layers, args.weights_only)
        print(f"synthetic OLMo-core checkpoint: {size / 1e9:.2f} GB "
              f"({time.perf_counter() - t0:.0f} s to write)", flush=True)
        results = {"preset": args.preset, "layers": args.layers, "weights_only": args.weights_only,
                   "checkpoint_bytes": size}
        s, rss = run(["convert", "olmo-core-to-olmax", str(src), str(work / "olmax-disk"), *flag])
        results["olmo_core_to_olmax_disk"] = {"seconds": s, "peak_rss_gb": rss}
        print(f"olmo-core-to-olmax, disk: {s:.0f} s, peak RSS {rss:.2f} GB", flush=True)
        srv, url = serve(work / "oc")
        try:
            s, rss = run(["convert", "olmo-core-to-olmax", f"{url}/step1000",
                          str(work / "olmax-http"), *flag])
        finally:
            srv.shutdown()
        results["olmo_core_to_olmax_http"] = {"seconds": s, "peak_rss_gb": rss}
        print(f"olmo-core-to-olmax, loopback HTTP: {s:.0f} s, peak RSS {rss:.2f} GB", flush=True)
        back = work / "back"
        s, rss = run(["convert", "olmax-to-olmo-core", str(work / "olmax-disk"), str(back), *flag])
        results["olmax_to_olmo_core"] = {"seconds": s, "peak_rss_gb": rss}
        print(f"olmax-to-olmo-core: {s:.0f} s, peak RSS {rss:.2f} GB", flush=True)
        equal, total = same(src / "model_and_optim",
                            back if args.weights_only else back / "model_and_optim")
        results["round_trip_equal_tensors"] = [equal, total]
        print(f"round trip: {equal} of {total} tensors bit for bit", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
