"""Subcommands of the ``olmax`` CLI, one module each.

``olmax.commands.<name>`` defines ``add_parser(subparsers)`` (registering the command with
``help=HELP[name]`` and setting ``func``) and the function it runs: a thin layer over a library
function that tests call directly. A new command is one module plus one entry in :data:`HELP`.
"""

HELP: dict[str, str] = {   # in the order ``olmax --help`` lists them
    "quickstart": "train the tiny OLMo 3 recipe on the embedded corpus",
    "convert": "convert between Hugging Face and olmax checkpoints",
    "merge": "average checkpoints (weights and Adam's state), as OLMo-core's merge script",
    "parity": "logit parity of HF transformers vs olmax",
    "tokenize": "tokenize text into OLMo token files (doc + EOS, raw uint32 LE)",
    "data": "inspect training data",
    "train": "train a model from a recipe",
    "eval": "held-out perplexity and OLMES downstream tasks",
    "curves": "compare loss curves of runs (plot + summary)",
    "bench": "benchmark training throughput, profile the step op by op, the matmul ceiling",
    "launch": "write a SLURM, Kubernetes or TPU VM job for a recipe",
    "plan": "compile a recipe's step ahead of time: memory, FLOPs, estimated speed, collectives",
}


def number(*, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False):
    """An ``argparse`` type for a float option: a finite number within the bounds (``low_open``:
    ``> low``, else ``>= low``; likewise ``high``). Anything else (``nan``, ``inf``, ``1e999``,
    a word) is argparse's one line naming the option and the value, exit status 2."""
    import argparse
    import math

    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high:g}")
    want = "a finite number" + (f" {' and '.join(bounds)}" if bounds else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if not math.isfinite(value) or (low is not None and (value <= low if low_open else value < low)) \
                or (high is not None and (value >= high if high_open else value > high)):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text}")
        return value

    parse.__name__ = "number"
    return parse
