"""olmax.parallel."""
