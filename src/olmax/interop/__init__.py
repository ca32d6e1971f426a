"""olmax.interop."""
