"""olmax: faithful OLMo 3 pre-training in JAX."""

__version__ = "0.3.0"   # CHANGELOG.md; pyproject.toml reads it
