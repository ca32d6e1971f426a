"""``olmax data overlap --train MIX_OR_PATHS --eval SETS``: contamination report.

``--train``: token files, an OLMo-core mix file (``.txt``) or ``embedded``. ``--eval``: held-out
entries (``LABEL=PATH[,PATH]``, token files/globs, a mix ``.txt``, ``embedded``) and/or OLMES task
names or suites (their context + gold continuation texts, tokenized with dolma2). Exit status 1 when
any evaluation set overlaps the training data (verbatim documents or near duplicates).
"""

from __future__ import annotations

import argparse

import numpy as np

from olmax.commands import number
from olmax.errors import ConfigError
from olmax.data.sources import (data_config_for, heldout_sets, is_heldout_entry, resolve_paths,
                                token_file_exists)
from olmax.data.tokenizer import get_tokenizer
from olmax.eval.contamination import documents_from_token_files, downstream_documents, overlap
from olmax.eval.tasks import expand_tasks, get_task
from olmax.io import as_inputs, refuse_existing, write_json_atomic


def add_overlap_parser(data_subparsers) -> None:
    q = data_subparsers.add_parser("overlap", help="exact-document and 13-gram overlap with evaluation data",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("--train", nargs="+", required=True, metavar="MIX_OR_PATHS",
                   help="training token files, an OLMo-core mix file, or 'embedded'")
    q.add_argument("--root", help="where a mix file's relative paths live")
    q.add_argument("--eval", nargs="+", required=True, metavar="SETS",
                   help="held-out token files / LABEL=PATHS / 'embedded' and/or OLMES tasks or suites")
    q.add_argument("--ngram", type=int, default=13)
    q.add_argument("--threshold", type=number(low=0, high=1), default=0.5,
                   help="fraction of a document's n-grams seen in training that makes it a near duplicate")
    q.add_argument("--max-train-tokens", type=int, default=None, help="scan at most this many training tokens")
    q.add_argument("--limit", type=int, default=None, help="first N documents of each OLMES task")
    q.add_argument("--dtype", default="uint32")
    q.add_argument("--json", dest="json_out", help="write the report here")
    q.add_argument("--force", action="store_true", help="replace an existing --json file")
    q.set_defaults(func=run_overlap)


def run_overlap(args: argparse.Namespace) -> int:
    if args.json_out:
        refuse_existing(args.json_out, args.force, flag="--json",
                        inputs=as_inputs([*args.train, *args.eval], "a file the overlap reads"))
    held = [e for e in args.eval if is_heldout_entry(e)]
    tasks = expand_tasks([e for e in args.eval if not is_heldout_entry(e)])
    for t in tasks:
        get_task(t)
    tok = get_tokenizer("dolma2")
    dtype = np.dtype(args.dtype)
    train, _ = resolve_paths(data_config_for(args.train, args.root))
    for p in train:
        if not token_file_exists(p):
            raise ConfigError(f"--train: token file not found: {p}")
    sets = {label: documents_from_token_files(files, eos_token_id=tok.eos_token_id, dtype=dtype)
            for label, files in heldout_sets(held).items()}
    sets.update(downstream_documents(tasks, tok, args.limit))
    report = overlap(train, sets, eos_token_id=tok.eos_token_id,
                     ngram=args.ngram, threshold=args.threshold, dtype=dtype,
                     max_train_tokens=args.max_train_tokens)
    print(f"training: {report.train_files} files, {report.train_tokens_scanned:,} tokens, "
          f"{report.train_documents_scanned:,} documents{' (partial scan)' if report.partial else ''}")
    for s in report.sets:
        print(("OVERLAP  " if s.contaminated else "clean    ") + s.describe())
    if args.json_out:
        write_json_atomic(args.json_out, report.to_dict(), overwrite=args.force)
    return 1 if report.contaminated else 0
