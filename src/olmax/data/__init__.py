"""olmax.data."""
