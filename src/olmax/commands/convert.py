"""``olmax convert``: Hugging Face Olmo3ForCausalLM or OLMo-core checkpoints <-> olmax checkpoint.

    olmax convert hf-to-olmax HF_DIR OUT_DIR [--dtype float32|bfloat16]
    olmax convert olmax-to-hf CKPT_DIR OUT_DIR [--dtype float32|bfloat16]
    olmax convert olmo-core-to-olmax SRC OUT [--weights-only] [--recipe NAME|FILE]
    olmax convert olmax-to-olmo-core CKPT OUT [--weights-only]

hf-to-olmax stores float32 by default (training keeps fp32 master weights); olmax-to-hf writes
the dtype of the HF directory the checkpoint came from (else float32), so a round trip
reproduces every tensor bit for bit. See ``olmax.interop.hf``.

olmo-core-to-olmax reads an OLMo-core ``step<N>/`` folder (local, or an https/s3/gs URL) without
torch: weights, Adam's moments and count, the trainer's step and data position; its optimizer
settings must be the recipe's (``--recipe``; default: olmax's optimizer defaults, OLMo 3's).
olmax-to-olmo-core writes the folder ai2-olmo-core 3.0's own checkpointer writes, key for key:
its Trainer resumes it with ``load_trainer_state=True`` and its tools read it (``load_keys``, its
merge script, its HF conversion). Round trips are bit for bit. See ``olmax.interop.olmo_core``.
"""

from __future__ import annotations

import argparse

from olmax.checkpoint.weights import load_model_config
from olmax.commands import HELP
from olmax.interop.hf import convert_hf_to_olmax, convert_olmax_to_hf

DTYPE_CHOICES = ("float32", "bfloat16")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("convert", help=HELP["convert"],
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION")
    sub.required = True
    a = sub.add_parser("hf-to-olmax", help="HF Olmo3ForCausalLM directory -> olmax checkpoint")
    a.add_argument("hf_dir", metavar="HF_DIR")
    a.add_argument("out_dir", metavar="OUT_DIR")
    a.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32",
                   help="dtype of the stored params (default float32)")
    a.set_defaults(func=_hf_to_olmax)
    b = sub.add_parser("olmax-to-hf", help="olmax checkpoint -> HF Olmo3ForCausalLM directory")
    b.add_argument("ckpt_dir", metavar="CKPT_DIR",
                   help="a step dir, a run dir or a checkpoints/ dir (latest step)")
    b.add_argument("out_dir", metavar="OUT_DIR")
    b.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="safetensors dtype (default: that of the imported HF directory, else float32)")
    b.set_defaults(func=_olmax_to_hf)
    c = sub.add_parser("olmo-core-to-olmax", help="OLMo-core checkpoint -> olmax checkpoint")
    c.add_argument("src", metavar="SRC", help="an OLMo-core step folder: a path or an https/s3/gs URL")
    c.add_argument("out", metavar="OUT")
    c.add_argument("--weights-only", action="store_true", help="the model only, no optimizer state")
    c.add_argument("--recipe", default=None,
                   help="recipe whose optimizer the checkpoint's settings must match "
                        "(default: olmax's optimizer defaults, OLMo 3's)")
    c.set_defaults(func=_olmo_core_to_olmax)
    d = sub.add_parser("olmax-to-olmo-core", help="olmax checkpoint -> OLMo-core checkpoint")
    d.add_argument("ckpt", metavar="CKPT", help="a step dir, a run dir or a checkpoints/ dir")
    d.add_argument("out", metavar="OUT")
    d.add_argument("--weights-only", action="store_true",
                   help="a model-only DCP folder (no optimizer or trainer state)")
    d.set_defaults(func=_olmax_to_olmo_core)


def _hf_to_olmax(args) -> int:
    out = convert_hf_to_olmax(args.hf_dir, args.out_dir, dtype=args.dtype)
    cfg = load_model_config(out)
    print(f"wrote {out} ({args.dtype}; {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"vocab {cfg.vocab_size} padded to {cfg.padded_vocab_size}, "
          f"windows {list(cfg.window_pattern)})")
    return 0


def _olmax_to_hf(args) -> int:
    out = convert_olmax_to_hf(args.ckpt_dir, args.out_dir, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def _olmo_core_to_olmax(args) -> int:
    from olmax.interop.olmo_core.convert import convert_olmo_core_to_olmax
    from olmax.train.optim import skip_step_adamw

    optim = model = None
    if args.recipe:
        from olmax.train.recipes import load_recipe

        recipe = load_recipe(args.recipe, read_init=False)
        optim, model = recipe.optim, recipe.model
    out = convert_olmo_core_to_olmax(args.src, args.out, weights_only=args.weights_only,
                                     optim=optim, model=model, optimizer=skip_step_adamw)
    print(f"wrote {out}")
    _note_warm_start_only(out)
    return 0


def _note_warm_start_only(out) -> None:
    """Say what an import without OLMo-core's trainer state cannot know (on stderr)."""
    import sys

    from olmax.checkpoint.weights import load_meta

    note = load_meta(out).get("warm_start_only")
    if note:
        print(f"note: {note}", file=sys.stderr)


def _olmax_to_olmo_core(args) -> int:
    from olmax.interop.olmo_core.convert import convert_olmax_to_olmo_core

    out = convert_olmax_to_olmo_core(args.ckpt, args.out, weights_only=args.weights_only)
    print(f"wrote {out}")
    return 0
