"""Contamination guard: overlap between training data and evaluation data."""

from olmax.eval.contamination.overlap import (NGRAM, OverlapReport, check_heldout_disjoint, ngram_hashes,
                                              overlap)

__all__ = ["NGRAM", "OverlapReport", "check_heldout_disjoint", "ngram_hashes", "overlap"]
