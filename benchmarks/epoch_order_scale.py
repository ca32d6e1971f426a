"""The stage-1 epoch order at full scale, measured by hand (not part of the test run: a build takes
minutes and 3 GiB):

    PYTHONPATH=src python benchmarks/epoch_order_scale.py --dir /tmp/scale --processes 2 --json out.json

A mix of 1016 sparse token files (no disk used) with stage 1's 5.93e12 tokens, split among the
files by a fixed log-normal draw; ``--processes`` processes (stand-ins for the hosts of a job,
sharing one cache folder) each build ``TrainData`` at seq_len 8192, global batch 512, seed 34521
and read their rows of the first batch through ``iterate()`` with 2 prefetch threads, as the
trainer does. Per process: seconds to its first batch, peak RSS (``ru_maxrss``) and how many
times it shuffled the 724 M-instance order. ``--src`` runs another checkout's ``src`` (an earlier
olmax, to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

FILES, TOKENS, SEQ, BATCH, SEED = 1016, 5_929_965_715_456, 8192, 512, 34521


def make_mix(root: Path) -> list[str]:
    """1016 sparse uint32 files holding ``TOKENS`` tokens in all (sizes from a fixed draw)."""
    rng = np.random.default_rng(0)
    weights = rng.lognormal(0.0, 1.0, FILES)
    sizes = np.floor(weights / weights.sum() * TOKENS).astype(np.int64)
    sizes[-1] += TOKENS - sizes.sum()
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, n in enumerate(sizes):
        p = root / f"part-{i:04d}.npy"
        if not p.exists() or p.stat().st_size != 4 * int(n):
            with open(p, "wb") as f:
                f.truncate(4 * int(n))
        paths.append(str(p))
    return paths


def one_process(paths: list[str], cache: str, rank: int, processes: int) -> dict:
    """In a child: what one host of the job does before its first step."""
    import olmax.data.instances as instances
    from olmax.data.loader import TrainData
    from olmax.data.tokenizer import get_tokenizer

    shuffles = []
    real = instances.shuffled_indices

    def counted(*a, **k):
        shuffles.append(time.time())
        return real(*a, **k)

    instances.shuffled_indices = counted
    t0 = time.perf_counter()
    data = TrainData(paths, seq_len=SEQ, global_batch_size=BATCH, seed=SEED,
                     tokenizer=get_tokenizer("dolma2").identity, prefetch=2, cache_dir=cache)
    it = data.iterate(0, rank, processes)
    b, host = next(it)
    return {"rank": rank, "instances": data.num_instances, "seconds_to_first_batch":
            round(time.perf_counter() - t0, 1), "peak_rss_gib":
            round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "shuffles": len(shuffles), "rows": int(host["tokens"].shape[0])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="scratch folder (the sparse mix and the cache)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3, metavar=("CACHE", "RANK", "PROCESSES"))
    args = ap.parse_args()
    paths = make_mix(Path(args.dir) / "mix")
    if args.child:
        cache, rank, processes = args.child
        print(json.dumps(one_process(paths, cache, int(rank), int(processes))), flush=True)
        os._exit(0)      # leave the prefetch threads behind
    cache = Path(args.dir) / f"cache-{time.time_ns()}"
    env = {**os.environ, "PYTHONPATH": args.src}
    procs = [subprocess.Popen([sys.executable, __file__, "--dir", args.dir, "--child", str(cache),
                               str(r), str(args.processes)], env=env, stdout=subprocess.PIPE,
                              text=True) for r in range(args.processes)]
    rows = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    result = {"src": args.src, "processes": args.processes, "per_process": rows,
              "shuffles_in_all": sum(r["shuffles"] for r in rows),
              "cache_files": sorted(p.name for p in (cache / "indices").iterdir())}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
