"""``olmax plan RECIPE [key=value ...] [--topology NAME] [--profile P] [--json OUT]``

Compile the recipe's real training step ahead of time -- for a TPU topology (``--topology
tpu7x:2x2x2``, ``v5p:4x4x4``, ``v5e:2x2``, ``v6e:4x4``; needs the tpu extra, Python >= 3.12), for a GPU
target (``--topology h100:8``, ``h200:8``; needs JAX's CUDA plugin, not a GPU) or for this machine's
devices -- without allocating any parameter or batch, and report per device: memory
(arguments, outputs, temporaries, aliasing, generated code; the peak against the device's HBM),
FLOPs per step (analytic, both conventions, and XLA's count with loop trip counts and kernels), an
estimated step time with tokens/s/chip and MFU (labelled with its method), the collectives in the
compiled program, and the compile time. A step that does not fit, found when compiling for a
topology or from the compiled memory on the local devices, is one line with the bytes needed and
available, and exit status 1. ``--json`` and ``--hlo`` refuse an existing file unless ``--force``
(and the recipe itself always).

``--profile`` (the same as the override ``train.profile=...``) compiles another platform's code
path of the model (``olmax.platforms``); by default the target's own.
"""

from __future__ import annotations

import argparse

from olmax.commands import HELP
from olmax.errors import EXIT_DOES_NOT_FIT
from olmax.io import as_inputs, refuse_outputs, write_json_atomic
from olmax.device_memory import DoesNotFit
from olmax.perf.plan import format_plan, plan
from olmax.perf.targets import check_topology_name
from olmax.platforms import PROFILE_NAMES
from olmax.train.recipes import load_recipe


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help=HELP["plan"],
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe name or YAML path")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    p.add_argument("--topology", default=None,
                   help="TPU topology (e.g. tpu7x:2x2x2, v5p:4x4x4) or GPU target (h100:8, h200:8, h100:64x8) "
                        "to compile for; default: the local devices")
    p.add_argument("--profile", choices=PROFILE_NAMES, default=None,
                   help="platform profile of the model's code path (train.profile; default: the "
                        "recipe's, auto: the target's)")
    p.add_argument("--no-parts", action="store_true",
                   help="skip compiling the unscanned parts (no XLA FLOPs count, no estimate)")
    p.add_argument("--hlo", dest="hlo_out", help="also write the compiled step's optimized HLO text here")
    p.add_argument("--json", dest="json_out", help="also write the result here (JSON)")
    p.add_argument("--force", action="store_true", help="replace existing --json and --hlo files")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    refuse_outputs([("--json", args.json_out), ("--hlo", args.hlo_out)], args.force,
                   inputs=as_inputs([args.recipe], "the recipe"))
    if args.topology:
        check_topology_name(args.topology)
    overrides = [*args.overrides, *([f"train.profile={args.profile}"] if args.profile else [])]
    cfg = load_recipe(args.recipe, overrides, find_mix=False)   # the plan reads no data
    try:
        result = plan(cfg, args.topology, parts=not args.no_parts, hlo_out=args.hlo_out)
    except DoesNotFit as e:
        print(f"olmax plan: {e}")
        if args.json_out:
            write_json_atomic(args.json_out, {"recipe": args.recipe, "overrides": list(args.overrides),
                                              "topology": args.topology,
                                              "memory": {"peak_bytes": e.needed, "hbm_bytes": e.available,
                                                         "fits": False}, "error": str(e)},
                              overwrite=args.force)
        return EXIT_DOES_NOT_FIT
    print(format_plan(result))
    if args.json_out:
        write_json_atomic(args.json_out, {**result.to_dict(), "recipe": args.recipe,
                                          "overrides": list(args.overrides)}, overwrite=args.force)
    return 0

