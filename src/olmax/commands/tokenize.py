"""``olmax tokenize INPUT... --out DIR``: text/JSONL/Parquet -> OLMo token files + manifest.json."""

from __future__ import annotations

import argparse
import os

from olmax.commands import HELP, number
from olmax.errors import ConfigError
from olmax.io import local_dir
from olmax.data.tokenize_files import TokenizeSettings, tokenize_files


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "tokenize", help=HELP["tokenize"],
        description="Tokenize plain text files (one document each), JSONL (.jsonl, .jsonl.gz, "
                    ".jsonl.zst) or Parquet into raw little-endian token files, each document "
                    "followed by one EOS, plus manifest.json. Interrupted runs resume.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders")
    p.add_argument("--out", required=True, help="output folder (new, or an unfinished run to resume)")
    p.add_argument("--tokenizer", default="dolma2", help="dolma2 (default) or a path to an HF tokenizer.json")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)),
                   help="worker processes (default: CPU count)")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column with the text")
    p.add_argument("--max-file-tokens", type=int, default=1 << 28,
                   help="split output files at this many tokens (default 2^28)")
    p.add_argument("--group-mb", type=number(low=0, low_open=True, high=1e6), default=32.0,
                   help="input megabytes per unit of work (resume granularity; default 32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError("--workers must be >= 1")
    settings = TokenizeSettings(tokenizer=args.tokenizer, text_field=args.text_field,
                                max_file_tokens=args.max_file_tokens,
                                group_bytes=max(1, int(args.group_mb * (1 << 20))))
    local_dir(args.out, "--out")
    m = tokenize_files(args.inputs, args.out, settings, workers=args.workers,
                       progress=not args.no_progress)
    secs = m["_seconds"]
    rate = m["_new_tokens"] / secs if secs > 0 else float("nan")
    print(f"{m['documents']} documents, {m['tokens']} tokens in {len(m['files'])} file(s) -> "
          f"{os.path.join(args.out, 'manifest.json')} ({rate:,.0f} tokens/s)")
    return 0
