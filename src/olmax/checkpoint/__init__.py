"""olmax.checkpoint: the one checkpoint format, below the trainer, evaluation and interop.

- ``format``: the step-directory layout, ``format_version`` and its rule, finding the step of a run.
- ``checkpointer``: :class:`Checkpointer`, the trainer's async, atomic, resharding saves and restores.
- ``params``: parameters and model config of any step directory, and ``save_params`` for converters.
"""
