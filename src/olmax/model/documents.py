"""Packed sequences: documents inside one training sequence (intra-document masking).

A batch may carry ``doc_lens`` int32 [B, D]: the lengths of the documents packed in each row,
zero-padded, summing to the sequence length (OLMo-core ``generate_doc_lengths=True``; its
``get_cumulative_document_lengths`` drops the zeros). The model reads it as ``segment_ids``
[B, T], the document of every position (:func:`segment_ids_from_doc_lens`).

What OLMo-core (ai2-olmo-core 3.0.0) does with them, and olmax does the same:

- **Attention** stays inside each document: ``Transformer`` turns ``doc_lens``/``max_doc_lens``
  into ``cu_doc_lens`` (``nn/transformer/model.py``), which the flash-attention backends take as
  varlen ``cu_seqlens`` (``nn/attention/backend.py``) -- a block-diagonal causal mask, the
  sliding window applied within a document. Its ``torch`` (SDPA) backend, the one that runs on a
  CPU, refuses ``cu_doc_lens`` ("doesn't support intra-document masking").
- **RoPE positions restart at 0 in every document**: ``Attention._apply_rope`` passes
  ``cu_doc_lens`` to ``RotaryEmbedding.forward``, which indexes its (YaRN-scaled, where
  configured) sin/cos tables by the position inside the document ("matching per-document
  forwards", ``nn/rope.py``). A packed forward therefore equals one forward per document.
- **Labels are unchanged**: ``get_labels`` (``data/utils.py``) shifts the input ids left whatever
  the documents; the train module passes ``doc_lens`` to the model only. The last token of a
  document (its EOS in OLMo's data) is scored against the first token of the next.

HF transformers computes the same when given the per-document ``position_ids`` (0, 1, ... restarting
at every document) and no attention mask: its ``find_packed_sequence_indices`` turns them into a
block-diagonal mask, and RoPE reads the same positions (:func:`positions_in_documents`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_ids_from_doc_lens(doc_lens: jnp.ndarray, seq_len: int) -> jnp.ndarray:
    """int32 [B, T]: the index of the document each position falls in, from ``doc_lens`` [B, D].
    Zero lengths (padding) take no positions; positions past the last document (lengths summing to
    less than T) form one more segment of their own."""
    ends = jnp.cumsum(doc_lens.astype(jnp.int32), axis=-1)               # [B, D]
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    return jax.vmap(lambda e: jnp.searchsorted(e, pos, side="right"))(ends).astype(jnp.int32)


def positions_in_documents(segment_ids: jnp.ndarray) -> jnp.ndarray:
    """int32 [B, T]: each position's offset from the start of its document (its RoPE position)."""
    t = segment_ids.shape[-1]
    pos = jnp.arange(t, dtype=jnp.int32)
    starts_here = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], dtype=bool),
                                   segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(starts_here, pos, 0), axis=1)
    return pos - start
