"""``olmax data``: inspect the training stream, fetch remote token files; ``data overlap``
(:mod:`olmax.commands.data_overlap`).

``olmax data inspect (--mix MIXFILE --root DIR | --paths FILE...) --seq-len L --global-batch-size B
--seed S`` without ``--batches`` says how long one epoch is: its instances, and its steps and tokens
at that batch size (what ``train.max_epochs=1`` resolves to; ``--json``: ``{"instances", "files",
"seq_len", "global_batch_size", "steps_per_epoch", "tokens_per_epoch"}``).
``olmax data inspect ... [--epoch E] --batches START:END [--repetition-filter] --json`` prints a JSON list with one
object per global batch b in [START, END): ``{"batch": b, "instances": [global instance ids in batch
order], "sha256": hex sha256 of the batch's tokens as uint32 little-endian in batch order,
"filtered": [true where the repetition filter rejects the instance]}``; with ``--packed``
(OLMo-core's ``NumpyPackedFSLDataset``: ``--source-group-size``, ``--long-doc-strategy``) also
``"doc_lens"``: each instance's document lengths (the padding last, as one segment) and
``"padding"``: its padding tokens. ``--source-permutation-seed`` shuffles the file order first,
as OLMo-core's ``source_permutation_seed``. Batch b counts from the
start of epoch E and rolls over into later epochs, as in training (step s reads b = s - 1).
Paths, ``--root`` and mix entries may be ``s3://``, ``gs://`` or ``http(s)://`` URLs (read in place).

``olmax data fetch (MIX | PATH...) --root URL --to DIR [--workers N]`` copies remote token files
to DIR (keeping their paths below the root; never outside DIR): parallel, resumable after any
interruption (Ctrl-C stops at once), each file verified against the store's size and checksum, a
file already there kept only when it is a verified copy; prints a summary of bytes and tokens.
"""

from __future__ import annotations

import argparse
import json
import sys

from olmax.commands import HELP
from olmax.commands.data_overlap import add_overlap_parser
from olmax.config import DataConfig
from olmax.errors import ConfigError
from olmax.io import local_dir
from olmax.data.fetch import fetch, plan
from olmax.data.loader import batch_hash, build_train_data


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("data", help=HELP["data"])
    sub = p.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    sub.required = True

    q = sub.add_parser("inspect", help="instance ids and token hashes of global batches",
                       description="Global batches exactly as training reads them (OLMo-core order).")
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--mix", help="OLMo-core mix file (label,path lines with {TOKENIZER})")
    src.add_argument("--paths", nargs="+", metavar="FILE", help="token files in order")
    q.add_argument("--root", help="where the mix's relative paths live (default: the mix file's folder)")
    q.add_argument("--remap", action="append", default=[], metavar="OLD=NEW", help="path prefix rewrite")
    q.add_argument("--mix-tokenizer", default="allenai/dolma3-tokenizer",
                   help="value of {TOKENIZER} in the mix (default allenai/dolma3-tokenizer)")
    q.add_argument("--tokenizer", default="dolma2", help="tokenizer of the files (vocab, EOS, pad)")
    q.add_argument("--dtype", default="uint32")
    q.add_argument("--seq-len", type=int, required=True)
    q.add_argument("--max-target-seq-len", type=int, help="OLMo-core max_target_sequence_length")
    q.add_argument("--global-batch-size", type=int, required=True, help="sequences per global batch")
    q.add_argument("--seed", type=int, required=True)
    q.add_argument("--epoch", type=int, default=1, help="epoch of batch 0 (OLMo-core starts at 1)")
    q.add_argument("--batches", metavar="START:END",
                   help="global batch range, END exclusive (without it: the epoch's size only)")
    q.add_argument("--repetition-filter", action="store_true", help="apply OLMo-core's repetition filter")
    q.add_argument("--packed", action="store_true",
                   help="pack whole documents (OLMo-core NumpyPackedFSLDataset); show document lengths")
    q.add_argument("--source-group-size", type=int, default=1, help="with --packed: files packed together")
    q.add_argument("--long-doc-strategy", default="truncate",
                   help="with --packed: truncate or fragment documents longer than --seq-len")
    q.add_argument("--source-permutation-seed", type=int, help="shuffle the file order first (OLMo-core)")
    q.add_argument("--json", action="store_true", help="print the JSON list (default: a table)")
    q.add_argument("--cache-dir", help="read-through cache of remote files (data.cache_dir)")
    q.set_defaults(func=run_inspect)

    f = sub.add_parser("fetch", help="copy remote token files to a local folder (resumable, verified)",
                       description="Copy a mix's (or the given) remote token files to a local folder: "
                                   "parallel, resumable, verified against the store's size and checksum.")
    f.add_argument("sources", nargs="+", metavar="MIX | PATH",
                   help="an OLMo-core mix file (.txt), or token file paths below --root (or URLs)")
    f.add_argument("--root", help="s3://, gs:// or http(s):// URL the relative paths live under")
    f.add_argument("--to", required=True, metavar="DIR", help="local destination folder")
    f.add_argument("--workers", type=int, default=4, help="files copied at a time (default 4)")
    f.add_argument("--mix-tokenizer", default="allenai/dolma3-tokenizer",
                   help="value of {TOKENIZER} in the mix (default allenai/dolma3-tokenizer)")
    f.add_argument("--dtype", default="uint32", help="token dtype, for the token count (default uint32)")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")
    f.add_argument("--json", action="store_true", help="print the summary as JSON")
    f.set_defaults(func=run_fetch)

    add_overlap_parser(sub)


def parse_range(text: str) -> tuple[int, int]:
    try:
        start_s, end_s = text.split(":")
        start, end = int(start_s), int(end_s)
    except ValueError:
        raise ConfigError(f"--batches: expected START:END, got {text!r}") from None
    if start < 0 or end < start:
        raise ConfigError(f"--batches: need 0 <= START <= END, got {text!r}")
    return start, end


def inspect_batches(data, start: int, end: int) -> list[dict]:
    """The ``data inspect`` records for global batches [start, end) of a TrainData."""
    out = []
    for b in range(start, end):
        batch = data.global_batch(b)
        record = {"batch": b, "instances": batch["instance_ids"].tolist(),
                  "sha256": batch_hash(batch["tokens"]),
                  "filtered": (~batch["instance_mask"]).tolist()}
        if "doc_lens" in batch:
            record["doc_lens"] = [row[row > 0].tolist() for row in batch["doc_lens"]]
            record["padding"] = (~batch["label_mask"]).sum(axis=1).tolist()
        out.append(record)
    return out


def epoch_summary(data, seq_len: int, global_batch_size: int) -> dict:
    """How long one epoch of the data is: instances, and the steps (global batches, the tail
    dropped as OLMo-core's loader drops it) and tokens of one epoch at this batch size: what
    ``train.max_epochs=1`` resolves to."""
    steps = data.batches_per_epoch
    return {"instances": data.num_instances, "files": len(data.index.paths), "seq_len": seq_len,
            "global_batch_size": global_batch_size, "steps_per_epoch": steps,
            "tokens_per_epoch": steps * global_batch_size * seq_len}


def run_inspect(args: argparse.Namespace) -> int:
    start, end = parse_range(args.batches) if args.batches is not None else (0, 0)
    cfg = DataConfig(paths=tuple(args.paths or ()), mix=args.mix, root=args.root, remap=tuple(args.remap),
                     mix_tokenizer=args.mix_tokenizer, tokenizer=args.tokenizer, dtype=args.dtype,
                     epoch=args.epoch, repetition_filter=args.repetition_filter,
                     max_target_seq_len=args.max_target_seq_len, cache_dir=args.cache_dir,
                     instances="packed" if args.packed else "fsl", doc_lens=args.packed,
                     source_group_size=args.source_group_size, long_doc_strategy=args.long_doc_strategy,
                     source_permutation_seed=args.source_permutation_seed)
    data = build_train_data(cfg, seq_len=args.seq_len, global_batch_size=args.global_batch_size,
                            seed=args.seed)
    summary = epoch_summary(data, args.seq_len, args.global_batch_size)
    records = inspect_batches(data, start, end)
    if args.json:
        json.dump(records if args.batches is not None else summary, sys.stdout)
        sys.stdout.write("\n")
        return 0
    print(f"{summary['instances']} instances of {args.seq_len} tokens, {summary['files']} files; "
          f"one epoch = {summary['steps_per_epoch']} steps at global batch "
          f"{args.global_batch_size} = {summary['tokens_per_epoch']:,} tokens")
    for r in records:
        ids = r["instances"]
        shown = ", ".join(map(str, ids[:6])) + (", ..." if len(ids) > 6 else "")
        print(f"batch {r['batch']:>8} epoch {data.epoch_of(r['batch'])}  sha256 {r['sha256'][:16]}  "
              f"filtered {sum(r['filtered'])}  [{shown}]")
        for k, lens, pad in zip(ids, r.get("doc_lens", []), r.get("padding", [])):
            docs = len(lens) - (pad > 0)
            shown_lens = ", ".join(map(str, lens[:12])) + (", ..." if len(lens) > 12 else "")
            print(f"    instance {k:>10}: {docs} documents, {pad} padding  doc_lens [{shown_lens}]")
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    local_dir(args.to, "--to")
    items = plan(args.sources, root=args.root, to=args.to, mix_tokenizer=args.mix_tokenizer)
    summary = fetch(items, workers=args.workers, dtype=args.dtype,
                    progress=not args.no_progress and sys.stderr.isatty())
    if args.json:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
        return 0
    gb = 1e9
    rate = summary["bytes_transferred"] / max(summary["seconds"], 1e-9) / 1e6
    replaced = (f" ({summary['replaced']} replacing a file there that was not a verified copy)"
                if summary["replaced"] else "")
    print(f"{summary['files']} files in {args.to}: {summary['copied']} copied{replaced}, "
          f"{summary['already_present']} already present; {summary['bytes'] / gb:.3f} GB = "
          f"{summary['tokens']:,} tokens ({summary['dtype']}); transferred "
          f"{summary['bytes_transferred'] / gb:.3f} GB in {summary['seconds']:.1f} s ({rate:.1f} MB/s)")
    return 0
