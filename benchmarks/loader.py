"""Data pipeline benchmark: tokenizer throughput, loader throughput, index memory.

    python benchmarks/loader.py                      # all three, small defaults
    python benchmarks/loader.py --only index --plan-instances 724000000

* tokenizer: dolma2 ``encode_batch`` on the embedded corpus (one process), tokens/s and MB/s.
* loader: TrainData over synthetic raw uint32 files (real file reads, page cache warm after the first
  pass) at seq_len 8192: ``host_batch`` directly and through ``iterate()`` (grain threads), with and
  without the repetition filter; compared with what a training host consumes (``--consume``,
  default 70,000 tokens/s: an 8-GPU H100 host of OLMo 3 7B's stage 1 at about 43 % MFU).
* index: the epoch permutation of an ``--plan-instances`` mix (OLMo 3 stage 1: 5.93 T tokens / 8192
  = 724 M instances): build time, peak RSS while building, cache file size, and the RSS of a fresh
  process that reads 200 random global batches of 512 ids, and a TrainData over a 1016-file mix of
  that size (sparse files, so no disk is used) reading host slices. Each measurement runs in its
  own subprocess so ``ru_maxrss`` is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_tokenizer(max_docs: int) -> dict:
    from olmax.data.embedded import embedded_documents
    from olmax.data.tokenizer import get_tokenizer

    tok = get_tokenizer("dolma2")
    docs = embedded_documents("train")[:max_docs]
    nbytes = sum(len(d.encode()) for d in docs)
    tok.encode_batch(docs[:8])  # warm up
    t0 = time.perf_counter()
    n = sum(len(ids) for ids in tok.encode_batch(docs))
    dt = time.perf_counter() - t0
    return {"documents": len(docs), "tokens": n, "seconds": round(dt, 3),
            "tokens_per_s": round(n / dt), "mb_per_s": round(nbytes / dt / 1e6, 2)}


def _make_files(directory: Path, n_files: int, tokens: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n_files):
        p = directory / f"part-{i:03d}.npy"
        rng.integers(0, 100257, tokens, dtype=np.uint32).astype("<u4").tofile(p)
        paths.append(str(p))
    return paths


def bench_loader(n_files: int, file_tokens: int, seq_len: int, batch: int, n_batches: int,
                 consume: float, threads: int) -> dict:
    from olmax.data.filters import RepetitionFilter
    from olmax.data.loader import TrainData
    from olmax.data.tokenizer import get_tokenizer

    ident = get_tokenizer("dolma2").identity
    out: dict = {"seq_len": seq_len, "global_batch": batch, "files": n_files, "file_tokens": file_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        paths = _make_files(Path(tmp), n_files, file_tokens)

        def run(label: str, fn, data) -> None:
            fn(data, 0)  # warm the page cache for the first batch and the plan
            t0 = time.perf_counter()
            fn(data, n_batches)
            dt = time.perf_counter() - t0
            tps = n_batches * batch * seq_len / dt
            out[label] = {"batches_per_s": round(n_batches / dt, 2), "tokens_per_s": round(tps),
                          "vs_consumption": round(tps / consume, 1)}

        def direct(data, n):
            for b in range(n):
                data.global_batch(b + 1)

        def grain_iter(data, n):
            it = data.iterate(1)
            for _ in range(n):
                next(it)

        plain = TrainData(paths, seq_len=seq_len, global_batch_size=batch, seed=34521, tokenizer=ident,
                          prefetch=threads)
        run("direct", direct, plain)
        run("grain", grain_iter, plain)
        filtered = TrainData(paths, seq_len=seq_len, global_batch_size=batch, seed=34521,
                             tokenizer=ident, prefetch=threads, repetition_filter=RepetitionFilter())
        run("grain_repetition_filter", grain_iter, filtered)
    out["consume_tokens_per_s"] = consume
    return out


def _child_build(n: int, cache: str) -> None:
    from olmax.data.instances import epoch_indices

    t0 = time.perf_counter()
    arr = epoch_indices(n, 34521, 1, cache_dir=cache)
    dt = time.perf_counter() - t0
    files = list((Path(cache) / "indices").glob("*.npy"))
    print(json.dumps({"build_seconds": round(dt, 1), "build_peak_rss_mb": round(_rss_mb()),
                      "cache_file_mb": round(files[0].stat().st_size / 1e6) if files else None,
                      "on_disk": not isinstance(arr, np.ndarray)}))


def _child_read(n: int, cache: str) -> None:
    from olmax.data.instances import BatchPlan

    base = _rss_mb()
    plan = BatchPlan(n, 512, 34521, 1, cache_dir=cache)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for b in rng.integers(0, plan.batches_per_epoch, 200):
        plan.instance_ids(int(b))
    dt = time.perf_counter() - t0
    print(json.dumps({"read_200_batches_seconds": round(dt, 3), "reader_peak_rss_mb": round(_rss_mb()),
                      "reader_rss_before_mb": round(base), "batches_per_epoch": plan.batches_per_epoch}))


def _child_mix(n: int, cache: str) -> None:
    """A 1016-file mix of n instances as sparse files (no disk used): plan it and read batches."""
    from olmax.data.loader import TrainData
    from olmax.data.tokenizer import get_tokenizer

    ident = get_tokenizer("dolma2").identity
    base = _rss_mb()
    files = 1016
    per_file = np.full(files, n // files, dtype=np.int64)
    per_file[: n % files] += 1
    mix_dir = Path(cache) / "sparse-mix"
    mix_dir.mkdir(exist_ok=True)
    paths = []
    for i, k in enumerate(per_file.tolist()):
        p = mix_dir / f"part-{i:04d}.npy"
        with open(p, "wb") as f:
            f.truncate(k * 8192 * 4 + 1234 * 4)  # k instances plus a remainder
        paths.append(str(p))
    t0 = time.perf_counter()
    data = TrainData(paths, seq_len=8192, global_batch_size=512, seed=34521, tokenizer=ident,
                     cache_dir=cache)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    data.host_batch(0, 0, 64)  # builds (or finds in the cache) the epoch order
    first_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for b in rng.integers(0, data.batches_per_epoch, 20):
        data.host_batch(int(b), 3, 64)  # host 3 of 64 reads its 8 rows
    read_s = (time.perf_counter() - t0) / 20
    print(json.dumps({"mix_files": files, "mix_instances": data.num_instances,
                      "mix_plan_seconds": round(plan_s, 2), "first_host_batch_seconds": round(first_s, 2),
                      "host_batch_seconds": round(read_s, 4),
                      "mix_process_peak_rss_mb": round(_rss_mb()), "mix_rss_before_mb": round(base)}))


def bench_index(n: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        out = {"instances": n}
        for mode in ("build", "read", "mix"):
            proc = subprocess.run([sys.executable, __file__, f"--_child-{mode}", str(n), cache],
                                  capture_output=True, text=True, check=True)
            out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        out["bytes_per_instance"] = 4
        return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1].startswith("--_child-"):
        children = {"--_child-build": _child_build, "--_child-read": _child_read, "--_child-mix": _child_mix}
        children[sys.argv[1]](int(sys.argv[2]), sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["tokenizer", "loader", "index"], action="append")
    ap.add_argument("--tokenizer-docs", type=int, default=400)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--file-tokens", type=int, default=1 << 23)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--consume", type=float, default=70_000.0, help="tokens/s a training host consumes")
    ap.add_argument("--plan-instances", type=int, default=50_000_000)
    args = ap.parse_args()
    which = args.only or ["tokenizer", "loader", "index"]
    report = {}
    if "tokenizer" in which:
        report["tokenizer"] = bench_tokenizer(args.tokenizer_docs)
    if "loader" in which:
        report["loader"] = bench_loader(args.files, args.file_tokens, args.seq_len, args.global_batch,
                                        args.batches, args.consume, args.threads)
    if "index" in which:
        report["index"] = bench_index(args.plan_instances)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
