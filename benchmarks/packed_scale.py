"""The cost of packing OLMo 3's long-context mix (``OLMo-longmino-mix-0625``: 998 files, sequence
length 65,536, ``source_group_size=8``), measured by hand (not part of the test run: minutes and a
few GB of disk):

    PYTHONPATH=src python benchmarks/packed_scale.py --dir /tmp/pscale --json out.json

Each measurement runs in a fresh child process (seconds, peak RSS from ``ru_maxrss``), for olmax
and, side by side, for ai2-olmo-core 3.0.0 on the same files:

``scan``   the whole mix as 998 sparse (all-zero) files: no document boundaries, so nothing is
           packed; this is the cost of reading every token and looking for EOS (from the page
           cache's zero pages: no disk time), for all 125 groups.
``group``  one group of 8 real files of the mix's file size with a modelled document-length
           distribution (:func:`document_lengths`): boundaries, sort, best-fit packing and the
           cache file, i.e. one group's whole build. olmax's instances are checked against
           OLMo-core's (same documents in the same instances).
``read``   global batches (64 x 65,536) read from that group as the trainer reads them: packed
           (tokens, label mask, doc_lens) against fixed-length chunks of the same files.

Sizes: the mix file lists paths only. Stage 3 of OLMo 3 7B ran 11,921 steps of 64 x 65,536
tokens (``OLMo-3-1025-7B.csv``: stage3/step11921 at 6,073,675,153,408 tokens, the last) and the
official script trains one pass, so the mix packs into 11,921 x 64 = 762,944 to 763,007 instances:
about 50.0e9 tokens, taken here as 11,921 x 4,194,304 split evenly over the 998 files (50.1 M
tokens, 200 MB each); padding, under 1 % with best-fit packing, is ignored.
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

FILES, GROUP, SEQ = 998, 8, 65536
TOKENS = 11_921 * 64 * SEQ
EOS, PAD, VOCAB = 100257, 100277, 100278
FILE_TOKENS = TOKENS // FILES
# Dolma 3 Longmino (OLMo 3 report, table 11): 66 % of tokens from the midtraining mix (short
# documents), 34 % long-context data. Long olmOCR PDF documents per length bucket (documents):
PDF_BUCKETS = [(8_192, 16_384, 1_090_349), (16_384, 32_768, 508_354), (32_768, 65_536, 142_983),
               (65_536, 131_072, 54_992), (131_072, 262_144, 20_893), (262_144, 524_288, 8_130),
               (524_288, 1_048_576, 3_394), (1_048_576, 4_194_304, 1_172)]
SHORT_SHARE, SHORT_MEDIAN, SHORT_SIGMA = 0.66, 500, 1.2


def document_lengths(n_tokens: int, seed: int) -> np.ndarray:
    """Lengths summing to ``n_tokens``: short documents log-normal (median 500 tokens, sigma 1.2,
    mean about 1,030) for 66 % of the tokens; long ones drawn by the PDF buckets' document counts,
    log-uniform within a bucket, for the rest. (The synthetic CWE/REX long-context data is folded
    into the long share.)"""
    rng = np.random.default_rng(seed)
    lo, hi, counts = (np.array(c, dtype=np.float64) for c in zip(*PDF_BUCKETS))
    long_target = int(n_tokens * (1 - SHORT_SHARE))
    long_lens = []
    total = 0
    while total < long_target:
        b = rng.choice(len(counts), p=counts / counts.sum())
        n = int(np.exp(rng.uniform(np.log(lo[b]), np.log(hi[b]))))
        long_lens.append(n)
        total += n
    short = np.maximum(1, rng.lognormal(np.log(SHORT_MEDIAN), SHORT_SIGMA,
                                        int((n_tokens - total) / 900) + 1000).astype(np.int64))
    short = short[np.cumsum(short) <= n_tokens - total]
    lengths = np.concatenate([np.array(long_lens, dtype=np.int64), short])
    rng.shuffle(lengths)
    return lengths


def make_sparse_mix(root: Path) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(FILES):
        p = root / f"{i:06d}.npy"
        if not p.exists() or p.stat().st_size != 4 * FILE_TOKENS:
            with open(p, "wb") as f:
                f.truncate(4 * FILE_TOKENS)
        paths.append(str(p))
    return paths


def make_group(root: Path) -> tuple[list[str], int]:
    """8 files of FILE_TOKENS tokens: documents of the modelled lengths (token 1, then EOS);
    the tokens after a file's last EOS belong to no document, as in real files."""
    root.mkdir(parents=True, exist_ok=True)
    paths, docs = [], 0
    for i in range(GROUP):
        p = root / f"{i:06d}.npy"
        lengths = document_lengths(FILE_TOKENS, seed=i)
        docs += len(lengths)
        if not p.exists() or p.stat().st_size != 4 * FILE_TOKENS:
            tokens = np.ones(FILE_TOKENS, dtype="<u4")
            tokens[np.cumsum(lengths) - 1] = EOS
            tokens.tofile(p)
        paths.append(str(p))
    return paths, docs


def peak_rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def cpu_seconds() -> float:
    """User + system CPU time of this process (less disturbed than wall time on a shared host)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(mode: str, impl: str, dirname: str) -> dict:
    root = Path(dirname)
    paths = make_sparse_mix(root / "sparse") if mode == "scan" else make_group(root / "group")[0]
    cache = root / f"cache-{impl}-{mode}-{time.time_ns()}"
    t0, c0 = time.perf_counter(), cpu_seconds()
    if impl == "olmax":
        from olmax.data.packed import PackedIndex
        index = PackedIndex(paths, SEQ, np.uint32, eos_token_id=EOS, pad_token_id=PAD,
                            source_group_size=GROUP, cache_dir=cache)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        grp = index.group(0)
        out = {"instances": index.num_instances, "documents": int(sum(
            len(index.group(g).lengths) for g in range(len(index.groups)))),
            "padding_tokens": index.padding_tokens,
            "instance_sizes_sha": _sha(np.diff(grp.offsets)), "first_docs_sha": _sha(grp.lengths)}
    else:
        from olmo_core.data.numpy_dataset import NumpyPackedFSLDataset
        ds = NumpyPackedFSLDataset(*paths, sequence_length=SEQ, pad_token_id=PAD, eos_token_id=EOS,
                                   vocab_size=VOCAB, dtype=np.uint32, source_group_size=GROUP)
        ds.work_dir = cache
        instances = 0
        for group in ds._source_path_groups:   # one worker's whole job, group by group
            instances += ds._pack_documents_from_source_into_instances(*group)[0]
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        out = {"instances": instances}
        if mode == "group":
            g = ds._source_path_groups[0]
            offsets = np.fromfile(ds._get_instance_offsets_path(*g), dtype=np.uint64).reshape(-1, 2)
            doc_ids = np.fromfile(ds._get_docs_by_instance_path(*g), dtype=np.uint64)
            indices = np.fromfile(ds._get_document_indices_path(*g), dtype=np.uint64).reshape(-1, 2)
            lengths = (indices[:, 1] - indices[:, 0]).astype(np.int64)[doc_ids.astype(np.int64)]
            out.update({"instance_sizes_sha": _sha((offsets[:, 1] - offsets[:, 0]).astype(np.int64)),
                        "first_docs_sha": _sha(lengths)})
    return {"mode": mode, "impl": impl, "files": len(paths), "tokens": len(paths) * FILE_TOKENS,
            "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "peak_rss_gib": peak_rss_gib(),
            **out}


def read_child(dirname: str, kind: str, batches: int = 8) -> dict:
    """Global batches of 64 x 65,536 from the real group, as the trainer reads them: packed
    (``kind="packed"``: tokens, label mask, doc_lens) or fixed-length chunks of the same files."""
    from olmax.data.loader import TrainData
    from olmax.data.packed import Packing
    from olmax.data.tokenizer import get_tokenizer
    root = Path(dirname)
    paths = make_group(root / "group")[0]
    packing = Packing(source_group_size=GROUP, doc_lens=True) if kind == "packed" else None
    data = TrainData(paths, seq_len=SEQ, global_batch_size=64, seed=34521, cache_dir=str(root / "read-cache"),
                     tokenizer=get_tokenizer("dolma2").identity, packing=packing)
    data.global_batch(0)                      # the packing cache and the epoch order
    t0 = time.perf_counter()
    docs = 0
    for b in range(1, batches + 1):
        batch = data.global_batch(b % data.batches_per_epoch)
        docs += int((batch["doc_lens"] > 0).sum()) if kind == "packed" else 0
    seconds = time.perf_counter() - t0
    return {"mode": "read", "impl": f"olmax {kind}", "batches": batches,
            "tokens_per_s": round(batches * 64 * SEQ / seconds), "ms_per_batch": round(1000 * seconds / batches, 1),
            "segments_per_batch": docs // batches, "doc_lens_width": data.doc_lens_width}


def _sha(a: np.ndarray) -> str:
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(a, dtype="<i8").tobytes()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="scratch folder (sparse mix, one real group, caches)")
    ap.add_argument("--modes", default="group,read,scan")
    ap.add_argument("--impls", default="olmax,olmo-core")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "IMPL"))
    args = ap.parse_args()
    if args.child:
        mode, impl = args.child
        out = read_child(args.dir, impl) if mode == "read" else child(mode, impl, args.dir)
        print(json.dumps(out), flush=True)
        return
    root = Path(args.dir)
    _, docs = make_group(root / "group")
    make_sparse_mix(root / "sparse")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    rows = []
    for mode in args.modes.split(","):
        for impl in (("packed", "fsl") if mode == "read" else args.impls.split(",")):
            out = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--child", mode, impl],
                                 env=env, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    result = {"files": FILES, "group_size": GROUP, "seq_len": SEQ, "tokens": TOKENS,
              "file_tokens": FILE_TOKENS, "group_documents_modelled": docs, "runs": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
