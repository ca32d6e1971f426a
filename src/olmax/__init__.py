"""olmax: faithful OLMo 3 pre-training in JAX."""

__version__ = "0.1.0"
