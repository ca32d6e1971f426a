"""What OLMo-core (ai2-olmo-core 3.0.0) does with ``doc_lens`` on a CPU, pinned down.

- Its CPU attention backend (torch SDPA) refuses intra-document masking; only its flash-attention
  backends take ``cu_doc_lens`` (varlen attention). olmax's packed training is compared with
  OLMo-core running one forward per document in ``test_oc_parity.py``.
- Its RoPE runs on a CPU with ``cu_doc_lens``: positions restart at 0 in every document and index
  the (YaRN-scaled) tables; olmax's ``positions_in_documents`` and RoPE give the same rotated q, k,
  here at positions beyond YaRN's original context of 8192.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import YarnConfig
from olmax.model.documents import positions_in_documents, segment_ids_from_doc_lens
from olmax.model.rope import apply_rope, rope_tables
from helpers.reference import require

from helpers import olmo_core as ref

torch = require("torch")
require("olmo_core")


def test_olmo_core_cpu_backend_refuses_documents():
    from olmax.model.params import init_params
    import jax

    model = ref.oc_model(init_params(ref.CFG, jax.random.key(0)))
    ids = torch.zeros((1, ref.T), dtype=torch.long)
    doc_lens = torch.tensor([[10, ref.T - 10]], dtype=torch.int32)
    with torch.no_grad():
        model(ids)                                            # without documents: fine
        with pytest.raises(RuntimeError, match="intra-document masking"):
            model(ids, doc_lens=doc_lens, max_doc_lens=[ref.T - 10])


@pytest.mark.parametrize("yarn", [False, True])
def test_rope_positions_restart_per_document_as_olmo_core(yarn):
    from olmo_core.nn.rope import RotaryEmbedding, YaRNRoPEScalingConfig

    t, d, theta = 12_000, 16, 500_000
    doc_lens = np.array([[3_000, 9_000, 0], [1, 11_000, 999]], np.int32)
    scaling = YaRNRoPEScalingConfig(factor=8, beta_fast=32, beta_slow=1, old_context_len=8192)
    rope = RotaryEmbedding(head_size=d, theta=theta, full_precision=True,
                           scaling=scaling if yarn else None)
    rng = np.random.default_rng(0)
    q, k = (rng.normal(size=(2, t, 2, d)).astype(np.float32) for _ in range(2))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(doc_lens[doc_lens > 0])]), dtype=torch.int32)
    with torch.no_grad():
        q_oc, k_oc = (x.numpy() for x in rope(torch.from_numpy(q), torch.from_numpy(k),
                                              head_first=False, cu_doc_lens=cu))
    seg = segment_ids_from_doc_lens(jnp.asarray(doc_lens), t)
    ours = YarnConfig(factor=8.0, beta_fast=32.0, beta_slow=1.0,
                      original_max_position_embeddings=8192) if yarn else None
    sin, cos = rope_tables(positions_in_documents(seg), d, theta, ours)
    for x, x_oc in ((q, q_oc), (k, k_oc)):
        np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(x), sin, cos)), x_oc,
                                   atol=2e-5, rtol=1e-5)
    # and not the positions of the whole row
    sin_row, cos_row = rope_tables(jnp.arange(t), d, theta, ours)
    assert np.abs(np.asarray(apply_rope(jnp.asarray(q), sin_row, cos_row)) - q_oc).max() > 0.1
