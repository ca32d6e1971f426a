"""Remote token-file reads vs local: training batches from the same files on local disk, over
plain HTTP and over S3, both from moto's S3 server on 127.0.0.1 (HTTP: its path-style object
URLs, read with ranged GETs as from any file server), rounds interleaved.

    python benchmarks/remote_read.py [--files 4] [--tokens-per-file 4000000] [--seq-len 2048]
        [--batch 64] [--batches 8] [--rounds 3] [--json benchmarks/results/remote_read.json]

Reports batches/s and MB/s of token payload per source, and whether every batch hash agrees. The
loopback servers are Python processes sharing this machine's cores, so the remote figures bound
the client's overhead (request issue, retries' bookkeeping, copies), not a real store's
bandwidth or latency.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from olmax.io import write_json_atomic

DOLMA2 = {"name": "dolma2", "vocab_size": 100278, "eos_token_id": 100257, "pad_token_id": 100277,
          "bos_token_id": None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--tokens-per-file", type=int, default=4_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    from olmax.data.loader import TrainData

    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="olmax-remote-read-"))
    names, blobs = [], {}
    for i in range(a.files):
        name = f"part-{i:03d}.npy"
        data = rng.integers(0, 100000, a.tokens_per_file).astype("<u4").tobytes()
        (work / name).write_bytes(data)
        names.append(name)
        blobs[name] = data
    kw = dict(seq_len=a.seq_len, global_batch_size=a.batch, seed=1, tokenizer=DOLMA2)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)    # moto's server: no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = "http://%s:%d" % server.get_host_and_port()
    try:
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x",
                          AWS_DEFAULT_REGION="us-east-1")
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="bench")
        for n, b in blobs.items():
            s3.put_object(Bucket="bench", Key=n, Body=b, ACL="public-read")   # HTTP reads: no signature
        sources = {"local": [str(work / n) for n in names],
                   "http": [f"{endpoint}/bench/{n}" for n in names],
                   "s3": [f"s3://bench/{n}" for n in names]}
        data = {k: TrainData(v, **kw) for k, v in sources.items()}
        for d in data.values():  # warm-up: connections, first metadata
            d.global_batch(0)
        seconds = {k: [] for k in data}
        hashes = {k: [] for k in data}
        for r in range(a.rounds):
            for k, d in data.items():
                t0 = time.perf_counter()
                got = [d.global_batch(1 + r * a.batches + b)["tokens"] for b in range(a.batches)]
                seconds[k].append(time.perf_counter() - t0)
                hashes[k].append([hashlib.sha256(t.tobytes()).hexdigest() for t in got])
    finally:
        server.stop()
    payload = a.batches * a.batch * a.seq_len * 4
    result = {"files": a.files, "tokens_per_file": a.tokens_per_file, "seq_len": a.seq_len,
              "global_batch": a.batch, "batches_per_round": a.batches, "rounds": a.rounds,
              "same_batches": all(hashes[k] == hashes["local"] for k in hashes), "sources": {}}
    for k, s in seconds.items():
        best = min(s)
        result["sources"][k] = {"seconds_per_round": s, "batches_per_s": a.batches / best,
                                "MB_per_s": payload / best / 1e6,
                                "requests_per_s": a.batches * a.batch / best}
        print(f"{k:>5}: {a.batches / best:8.1f} batches/s  {payload / best / 1e6:8.1f} MB/s  "
              f"({a.batch} ranged reads of {a.seq_len * 4} B per batch; best of {a.rounds})")
    print(f"same batches from every source: {result['same_batches']}")
    if a.json_out:
        write_json_atomic(a.json_out, result)
    return 0 if result["same_batches"] else 1


if __name__ == "__main__":
    sys.exit(main())
