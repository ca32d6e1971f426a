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
