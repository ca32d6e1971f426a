"""Every parameter's gradient on one batch, fp32, is the same on every platform profile's code path
and under every remat policy: within 1e-6 relative (per tensor, ``|g - g_ref| / |g_ref|``) of the
``cpu`` profile without remat.

The profiles differ in the kernels (written-out CPU backward passes vs autodiff), the attention
(``chunked``; splash in Pallas interpret mode; cuDNN's fallback), the layer scan (unrolled vs
rolled), the RoPE tables (trace-time constants vs traced) and the loss chunks; the policies in what
the backward pass recomputes. The model has GQA, QK-norm, a sliding window of 8 and a full layer,
on sequences of 64 tokens (8 windows), and a loss with a masked instance and z-loss, so every path
carries weight in the gradient.

Two layers, not more: fp32 rounding alone moves these gradients by up to ~1e-6 at four layers --
the *same* code jitted and run op by op differs by 7.2e-7 there (XLA fuses, and approximates
transcendentals, differently) -- so 1e-6 would measure the rounding, not the paths. At two layers
that floor is 4-6e-7 (five seeds). Deeper scans are compared elsewhere: the layer-group scan against
a per-layer loop (tests/model/test_remat_scan.py) and 24 training steps of every profile against
OLMo-core (tests/train/test_oc_parity.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import ModelConfig, TrainConfig
from olmax.model.documents import segment_ids_from_doc_lens
from olmax.model.params import init_params
from olmax.model.runtime import REMAT_POLICIES, Runtime
from olmax.platforms import PROFILES
from olmax.train.loss import loss_and_sums, loss_denominator, make_labels
from olmax.train.step import loss_chunk

CFG = ModelConfig(d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, mlp_hidden=128,
                  vocab_size=200, padded_vocab_size=256, window_pattern=(8, None),
                  max_seq_len=64)
B, T = 8, 64


def _batch():
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(np.minimum(rng.geometric(0.15, size=(B, T)) - 1, 31), jnp.int32)
    mask = jnp.arange(B) != 1
    labels = make_labels(tokens, mask)
    return tokens, labels, loss_denominator(labels, mask)


# Packed rows for the intra-document masking case: documents shorter and longer than the window
# of 8, a one-token document, a row of one document (OLMo-core doc_lens, zero-padded).
DOC_LENS = np.array([[3, 20, 1, 40], [64, 0, 0, 0], [10, 10, 10, 34], [1, 63, 0, 0],
                     [30, 34, 0, 0], [5, 5, 50, 4], [64, 0, 0, 0], [16, 16, 16, 16]], np.int32)


def _grads(profile: str, remat: str, documents: bool = False):
    train = TrainConfig(seq_len=T, global_batch_size=B, profile=profile, remat=remat, attn_impl="auto")
    runtime = Runtime.of(train)
    chunk = loss_chunk(train, 1, None, runtime)
    tokens, labels, denom = _batch()
    params = init_params(CFG, jax.random.key(1))

    seg = segment_ids_from_doc_lens(jnp.asarray(DOC_LENS), T) if documents else None

    def loss(p):
        return loss_and_sums(p, tokens, labels, denom, CFG, runtime, z_loss_multiplier=1e-4,
                             chunk_size=chunk, segment_ids=seg)[0]
    return jax.jit(jax.grad(loss))(params)


@pytest.fixture(scope="module")
def reference():
    return _grads("cpu", "none")


def _assert_close(ours, reference, label):
    worst = 0.0
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(ours)[0], jax.tree.leaves(reference)):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.linalg.norm(r) > 0, jax.tree_util.keystr(path)
        rel = np.linalg.norm(g - r) / np.linalg.norm(r)
        worst = max(worst, rel)
        assert rel <= 1e-6, (jax.tree_util.keystr(path), rel)
    print(f"\n{label}: worst per-tensor relative gradient difference {worst:.2e}")


# rocm computes on a CPU the program gpu does (cuDNN's fallback there is rocm's chunked attention):
# one cell proves its path; every remat policy is proven on the other profiles.
CELLS = [(p, r) for p in sorted(PROFILES) if p != "rocm" for r in sorted(REMAT_POLICIES)] + [("rocm", "save_proj")]
DOCUMENT_CELLS = [(p, r) for p in sorted(PROFILES) if p != "rocm" for r in ("none", "save_proj")] + [("rocm", "none")]


@pytest.mark.parametrize("profile,remat", CELLS)
def test_gradients_equal_across_profiles_and_remat(reference, profile, remat):
    _assert_close(_grads(profile, remat), reference, f"{profile}/{remat}")


@pytest.fixture(scope="module")
def reference_documents():
    return _grads("cpu", "none", documents=True)


@pytest.mark.parametrize("profile,remat", DOCUMENT_CELLS)
def test_gradients_with_documents_equal_across_profiles(reference_documents, reference, profile, remat):
    """The same with packed rows (segment ids from ``DOC_LENS``): every profile's attention with
    the document mask, per-document RoPE positions, the same gradients; and they are not the
    gradients without documents."""
    _assert_close(_grads(profile, remat, documents=True), reference_documents,
                  f"{profile}/{remat} with documents")
    diff = [np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
            for a, b in zip(jax.tree.leaves(reference_documents), jax.tree.leaves(reference))]
    assert max(diff) > 1e-2
