"""olmax.perf: throughput benchmarks of the trainer's own step (``olmax bench``)."""
