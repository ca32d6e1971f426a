"""``olmax eval CKPT_DIR --tasks SUITE_OR_TASKS [--heldout PATHS] [--limit N] --json OUT``.

CKPT_DIR is an olmax checkpoint (a step dir, a run dir or its ``checkpoints/``), an OLMo-core
``step<N>/`` folder (read in place, local or a URL) or a Hugging Face ``Olmo3ForCausalLM``
directory (AI2's released checkpoints). Tasks are OLMES task names or suites
(``fast``: OLMo 3 stage 1's in-loop set; ``quick``); held-out entries are token files
(``LABEL=PATH[,PATH]``, a path or glob, an OLMo-core mix file, or ``embedded``), read with the
token ids the checkpoint records (its run's tokenizer; a soup's or an import's ``config.json``)
unless ``--tokenizer`` names a tokenizer; dolma2 where nothing is recorded (an HF directory).
"""

from __future__ import annotations

import argparse
import math
import sys

from olmax.commands import HELP
from olmax.config import TokenizerConfig, to_dict
from olmax.device_memory import raising_does_not_fit
from olmax.errors import ConfigError, OlmaxError
from olmax.data.tokenizer import get_tokenizer
from olmax.eval.runner import EvalSuite, load_model, log_metrics
from olmax.eval.scoring import Scorer
from olmax.eval.tasks import expand_tasks, get_task
from olmax.io import as_inputs, refuse_existing, write_json_atomic
from olmax.model.runtime import Runtime


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help=HELP["eval"],
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT_DIR",
                   help="olmax or OLMo-core checkpoint, or HF Olmo3 directory")
    p.add_argument("--tasks", action="append", default=[], metavar="SUITE_OR_TASKS",
                   help="suite name or comma-separated task names (repeatable)")
    p.add_argument("--heldout", action="append", default=[], metavar="PATHS",
                   help="held-out token files: LABEL=PATH[,PATH], PATH/glob, mix .txt, or 'embedded'")
    p.add_argument("--limit", type=int, default=None, help="first N documents of each task")
    p.add_argument("--heldout-max-docs", type=int, default=None, help="first N documents of each held-out set")
    p.add_argument("--max-length", type=int, default=None,
                   help="model context length for requests (default: the model's max_seq_len)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--tokenizer", default=None,
                   help="dolma2, an OLMo-core tokenizer preset or a tokenizer.json (default: the "
                        "tokenizer an olmax or OLMo-core checkpoint records, else dolma2)")
    p.add_argument("--json", dest="json_out", required=True, metavar="OUT", help="write results here")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _recorded_tokenizer(checkpoint: str) -> TokenizerConfig | None:
    """The tokenizer an olmax checkpoint records (its run's token ids, an import's or a soup's
    ``config.json``), or None (dolma2)."""
    from olmax.interop.weights_tokenizer import read_checkpoint_tokenizer

    found = read_checkpoint_tokenizer(checkpoint)
    return None if found is None else found.cfg


def run(args: argparse.Namespace) -> int:
    if not args.tasks and not args.heldout:
        raise ConfigError("give --tasks and/or --heldout")
    for flag, value in (("--limit", args.limit), ("--heldout-max-docs", args.heldout_max_docs),
                        ("--max-length", args.max_length), ("--batch-size", args.batch_size)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive (got {value})")
    refuse_existing(args.json_out, args.force, flag="--json",
                    inputs=as_inputs(args.heldout, "a held-out file"))
    for name in expand_tasks(args.tasks):  # unknown names fail before the model is loaded
        get_task(name)
    model = load_model(args.checkpoint)
    ctx = args.max_length or model.cfg.max_seq_len
    tok = get_tokenizer(args.tokenizer or (_recorded_tokenizer(args.checkpoint)
                                           if model.source == "olmax" else None))
    if tok.vocab_size > model.cfg.padded_vocab_size:
        raise OlmaxError(f"tokenizer '{tok.identity['name']}' has {tok.vocab_size} tokens but the "
                         f"model's vocabulary is {model.cfg.padded_vocab_size}")
    suite = EvalSuite.prepare(tasks=args.tasks, heldout=args.heldout, tokenizer=tok, model_ctx_len=ctx,
                              vocab_size=model.cfg.vocab_size, limit=args.limit,
                              heldout_max_docs=args.heldout_max_docs,
                              vocab_setting=f"the vocabulary of {args.checkpoint} (vocab_size "
                                            f"{model.cfg.vocab_size}; --tokenizer {args.tokenizer})")
    scorer = Scorer(model.cfg, Runtime.resolve(args.dtype, attn_impl="xla"), softmax_vocab=model.softmax_vocab)
    hints = [f"--batch-size (now {args.batch_size})", f"--max-length (now {ctx})"]
    if args.dtype == "float32":
        hints.append("--dtype bfloat16")
    with raising_does_not_fit(f"the evaluation (batches of {args.batch_size} x up to {ctx} tokens)", hints):
        results = suite.run(scorer, model.params, batch_size=args.batch_size,
                            progress=not args.no_progress and sys.stderr.isatty())
    report = {"checkpoint": str(args.checkpoint), "source": model.source, "model": to_dict(model.cfg),
              "compute_dtype": args.dtype, "model_ctx_len": ctx, "softmax_vocab": model.softmax_vocab,
              "limit": args.limit, **results, "metrics": log_metrics(results)}
    report, bad = _strict_json(report)
    if bad:   # (weights are checked finite on load; an overflow in low precision can still do it)
        print(f"warning: {bad} result(s) are not finite numbers; written as null", file=sys.stderr)
    write_json_atomic(args.json_out, report, overwrite=args.force)
    for label, r in results["heldout"].items():
        print(f"{label}: CE loss {r['CE loss']:.4f}  PPL {r['PPL']:.2f}  ({r['documents']} documents)")
    for task, r in results["downstream"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in r["metrics"].items()
                          if not k.startswith(("soft", "ce_loss")))
        print(f"{task} [{r['metric_type']}, {r['documents']} docs]: {shown}")
    print(f"results: {args.json_out} ({results['seconds']:.1f} s)")
    return 0


def _strict_json(obj):
    """``obj`` with every non-finite float replaced by None (strict JSON has no NaN), and how
    many there were."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, 1
    if isinstance(obj, dict):
        items = {k: _strict_json(v) for k, v in obj.items()}
        return {k: v for k, (v, _) in items.items()}, sum(n for _, n in items.values())
    if isinstance(obj, (list, tuple)):
        items = [_strict_json(v) for v in obj]
        return [v for v, _ in items], sum(n for _, n in items)
    return obj, 0
