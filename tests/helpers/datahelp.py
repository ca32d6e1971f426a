"""Shared helpers for the data tests: small raw uint32 token files."""

from __future__ import annotations

import numpy as np

VOCAB = 100278
EOS = 100257
PAD = 100277
DOLMA2 = {"name": "dolma2", "vocab_size": VOCAB, "eos_token_id": EOS, "pad_token_id": PAD,
          "bos_token_id": None}


def write_tokens(path, tokens) -> str:
    np.asarray(tokens, dtype="<u4").tofile(path)
    return str(path)
