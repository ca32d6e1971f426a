"""Packed-sequence references for the intra-document masking tests (torch/transformers needed).

HF ``Olmo3ForCausalLM`` is given each document's own positions (0, 1, ... restarting at every
document) and no attention mask: transformers' ``find_packed_sequence_indices`` then builds the
block-diagonal causal (and, on sliding layers, windowed) mask itself, and its RoPE reads the same
positions -- what OLMo-core computes from ``doc_lens``. (Only without a KV cache: the model must
be called with ``use_cache=False``, or it sees one sequence.) :func:`hf_block_masks` builds the same
masks by hand, as the per-layer-type dict of 4-D masks the model also accepts (a single 4-D tensor
would be used as-is on every layer, dropping the window of the sliding ones).
"""

from __future__ import annotations

import numpy as np


def doc_positions(doc_lens: np.ndarray, seq_len: int) -> np.ndarray:
    """[B, T] int64: each position's offset inside its document (numpy, independent of olmax)."""
    out = np.zeros((len(doc_lens), seq_len), np.int64)
    for b, lens in enumerate(doc_lens):
        lens = [int(n) for n in lens if n > 0]
        assert sum(lens) == seq_len, (lens, seq_len)
        out[b] = np.concatenate([np.arange(n) for n in lens])
    return out


def doc_index(doc_lens: np.ndarray, seq_len: int) -> np.ndarray:
    """[B, T] int64: each position's document number (numpy, independent of olmax)."""
    out = np.zeros((len(doc_lens), seq_len), np.int64)
    for b, lens in enumerate(doc_lens):
        lens = [int(n) for n in lens if n > 0]
        out[b] = np.concatenate([np.full(n, i) for i, n in enumerate(lens)])
    return out


def hf_block_masks(doc_lens: np.ndarray, seq_len: int, window: int, dtype):
    """{layer type: additive [B, 1, T, T] mask} with the documents, causality and the window."""
    import torch

    doc = doc_index(doc_lens, seq_len)
    q, k = np.arange(seq_len)[:, None], np.arange(seq_len)[None, :]
    same = doc[:, :, None] == doc[:, None, :]
    full = same & (k <= q)
    sliding = full & (k > q - window)
    neg = torch.finfo(dtype).min
    to = lambda m: torch.where(torch.from_numpy(m[:, None]), 0.0, neg).to(dtype)  # noqa: E731
    return {"full_attention": to(full), "sliding_attention": to(sliding)}


def hf_packed_logits(model, tokens: np.ndarray, doc_lens: np.ndarray, *, masks: bool = False
                     ) -> np.ndarray:
    """HF's fp32 logits [B, T, V] for packed rows: per-document positions and no attention mask
    (HF builds the block-diagonal mask), or with ``masks`` the hand-built 4-D masks as well."""
    import torch

    t = tokens.shape[1]
    # No KV cache: transformers looks for packed sequences only without one.
    kwargs = {"position_ids": torch.from_numpy(doc_positions(doc_lens, t)), "use_cache": False}
    if masks:
        kwargs["attention_mask"] = hf_block_masks(doc_lens, t, model.config.sliding_window,
                                                  model.dtype)
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64)), **kwargs).logits.float().numpy()
