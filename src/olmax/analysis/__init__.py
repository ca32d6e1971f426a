"""olmax.analysis."""
