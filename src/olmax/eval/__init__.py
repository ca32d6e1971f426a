"""olmax.eval."""
