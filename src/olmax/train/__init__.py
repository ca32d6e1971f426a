"""olmax.train."""
