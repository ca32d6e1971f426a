"""olmax.train.callbacks."""
