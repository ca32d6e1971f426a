"""``olmax merge CKPT... --out OUT [--weights W...] [--weights-only]``: the average of checkpoints.

Each CKPT is an olmax checkpoint (a step dir, a run dir or a ``checkpoints/`` dir) or an OLMo-core
``step<N>/`` folder (local, or an https/s3/gs URL, read without torch). The output is an olmax
checkpoint: the weights and Adam's moments and count averaged as OLMo-core's
``merge_core_checkpoints.py`` averages them, everything else the first checkpoint's; with
``--weights-only`` the weights alone. ``--weights``: one positive weight per checkpoint,
normalised to sum to 1 (default: equal). Streamed a block at a time, written atomically; inputs of
different architectures, or without optimizer state unless ``--weights-only``, are refused in one
line. The output's meta names each input; every command takes it (a warm start at any skip
window, ``convert`` both ways, ``eval``, ``parity``). See :mod:`olmax.checkpoint.merge`.
"""

from __future__ import annotations

import argparse
import sys

from olmax.commands import HELP


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("merge", help=HELP["merge"], description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", metavar="CKPT",
                   help="olmax checkpoints or OLMo-core step folders (paths or URLs), in order")
    p.add_argument("--out", required=True, metavar="OUT", help="the merged olmax checkpoint")
    p.add_argument("--weights", nargs="+", type=float, metavar="W",
                   help="one positive weight per checkpoint, normalised to sum to 1 (default: equal)")
    p.add_argument("--weights-only", action="store_true",
                   help="average the weights alone (no optimizer state in the output)")
    p.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    from olmax.checkpoint.merge import check_weights, merge, olmax_source
    from olmax.interop.olmo_core.checkpoint import is_olmo_core_checkpoint
    from olmax.interop.olmo_core.convert import merge_source, olmax_opt_state
    from olmax.io import check_output_dir
    from olmax.train.optim import build_optimizer

    check_output_dir(args.out)
    check_weights(args.weights, len(args.checkpoints))
    with_optimizer = not args.weights_only
    sources = [merge_source(p, with_optimizer=with_optimizer) if is_olmo_core_checkpoint(p)
               else olmax_source(p, with_optimizer=with_optimizer) for p in args.checkpoints]
    out = merge(sources, args.out, weights=args.weights, weights_only=args.weights_only,
                opt_state=lambda optim, mu, nu, count: olmax_opt_state(build_optimizer(optim), mu,
                                                                       nu, count))
    what = "weights" if args.weights_only else "weights and Adam's state"
    print(f"wrote {out}: the average of {len(sources)} checkpoints ({what})")
    if not args.weights_only and sources[0].meta.get("warm_start_only"):   # the soup's run state
        #                                                                  is the first input's
        print(f"note: {sources[0].meta['warm_start_only']}", file=sys.stderr)
    return 0
