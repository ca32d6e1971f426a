"""``olmax parity``: logits of HF transformers (torch, CPU) vs olmax on the same tokens.

    olmax parity HF_DIR [--checkpoint CKPT_DIR] [--seq-len N] [--batch B]
                 [--dtype float32|bfloat16] [--hf-dtype float32|bfloat16] [--profile auto|cpu|tpu|gpu]
                 [--attn-impl auto|IMPL] [--hf-attn eager|sdpa] [--seed S] [--json OUT.json]
                 [--tokens FILE | --text FILE]

--save-reference FILE.npz also writes the token ids and HF's logits; on a machine without torch
(a TPU host) --reference FILE.npz compares olmax against them instead of running HF, for the same
HF directory only (config and weights are fingerprinted).

Without --checkpoint the HF weights are converted in memory. Reports KL(HF||olmax) mean and max
per position, top-1 agreement and max |logit diff| over the first vocab_size logits. The default
sequence length is twice the largest sliding window (capped at max_position_embeddings). Needs
torch and transformers. See ``olmax.interop.parity``.

--profile runs olmax's code path of another platform on this machine (``olmax.platforms``): on
CPU, ``tpu`` runs the TPU's path with splash attention in Pallas interpret mode (slow), ``gpu``
the GPU's path with the attention it uses where cuDNN is not available (``chunked``).

--hf-attn picks the reference's attention: ``eager`` (the default) holds [heads, T, T] fp32 scores,
32 GiB per head at 65,536 tokens; ``sdpa`` (torch's scaled_dot_product_attention, causal) holds
none, for stage 3's long context (on a CPU, a 2-layer model of width 32 at 65,536 tokens peaks
near 20 GB of host memory with both models).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

from olmax.commands import HELP
from olmax.config import AttnImpl
from olmax.device_memory import raising_does_not_fit
from olmax.errors import ConfigError, OlmaxError
from olmax.interop.parity import HF_ATTN, format_report, run_parity
from olmax.io import as_inputs, refuse_existing, write_json_atomic
from olmax.platforms import PROFILE_NAMES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("parity", help=HELP["parity"],
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", metavar="HF_DIR", help="HF Olmo3ForCausalLM directory")
    p.add_argument("--checkpoint", metavar="CKPT_DIR", default=None,
                   help="olmax or OLMo-core checkpoint to compare (default: convert HF_DIR in "
                        "memory)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N")
    p.add_argument("--batch", type=int, default=1, metavar="B")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default=None,
                   help="the reference's dtype (default: --dtype); e.g. olmax bf16 against HF fp32")
    p.add_argument("--profile", choices=PROFILE_NAMES, default="auto",
                   help="platform profile whose code path olmax runs (default: this machine's)")
    p.add_argument("--attn-impl", choices=get_args(AttnImpl), default="auto",
                   help="attention implementation (default: the profile's)")
    p.add_argument("--hf-attn", choices=HF_ATTN, default="eager",
                   help="the reference's attention: eager (default; [heads, T, T] scores) or sdpa "
                        "(no scores held: long sequences)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random token ids")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tokens", metavar="FILE", default=None,
                     help="token ids instead of random ones (a .npy array or a raw uint32 token "
                          "file, told apart by content)")
    src.add_argument("--text", metavar="FILE", default=None,
                     help="a text file, tokenized with HF_DIR's tokenizer.json (else dolma2)")
    p.add_argument("--save-reference", metavar="FILE.npz", default=None,
                   help="also write the token ids and HF's logits there, for --reference on a "
                        "machine without torch")
    p.add_argument("--reference", metavar="FILE.npz", default=None,
                   help="compare with HF's logits saved by --save-reference (for this HF "
                        "directory) instead of running HF: no torch needed")
    p.add_argument("--json", metavar="OUT.json", default=None, help="also write the report as JSON")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    p.set_defaults(func=_run)


def _run(args) -> int:
    read = as_inputs([x for x in (args.tokens, args.text, args.reference) if x], "an input")
    for flag, out in (("--json", args.json), ("--save-reference", args.save_reference)):
        if out:
            refuse_existing(out, args.force, flag=flag, inputs=read)
    if args.reference:
        fixed = [flag for flag, given in (("--tokens", args.tokens), ("--text", args.text),
                                          ("--seq-len", args.seq_len), ("--hf-dtype", args.hf_dtype),
                                          ("--save-reference", args.save_reference),
                                          ("--batch", args.batch != 1), ("--seed", args.seed != 0),
                                          ("--hf-attn", args.hf_attn != "eager")) if given]
        if fixed:
            raise ConfigError(f"--reference fixes the inputs and the reference's settings; "
                              f"{fixed[0]} cannot be given with it")
    text = None
    if args.text is not None:
        path = Path(args.text)
        if not path.is_file():
            raise OlmaxError(f"text file not found: {path}")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise OlmaxError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    hints = [f"--batch (now {args.batch})", f"--seq-len (now {args.seq_len or 'the model context'})"]
    if args.dtype == "float32":
        hints.append("--dtype bfloat16")
    with raising_does_not_fit(f"the parity forward pass (batch {args.batch})", hints):
        report = run_parity(args.hf_dir, checkpoint=args.checkpoint, seq_len=args.seq_len,
                            batch=args.batch, dtype=args.dtype, seed=args.seed,
                            token_file=args.tokens, text=text, profile=args.profile,
                            attn_impl=args.attn_impl, hf_dtype=args.hf_dtype, hf_attn=args.hf_attn,
                            reference=args.reference, save_reference=args.save_reference)
    print(format_report(report))
    if args.json:
        write_json_atomic(args.json, report, overwrite=args.force)
        print(f"wrote {args.json}")
    if args.save_reference:
        print(f"wrote {args.save_reference} (HF's logits: olmax parity HF_DIR --reference "
              f"{args.save_reference} compares against them without torch)")
    return 0
