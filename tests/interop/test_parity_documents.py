"""Logit parity with document boundaries (packed sequences, intra-document masking) against HF
transformers ``Olmo3ForCausalLM``, fp32, on every platform profile's code path.

olmax runs ``forward(..., segment_ids=segment_ids_from_doc_lens(doc_lens))``; HF gets each
document's own positions and no mask, from which it builds the block-diagonal causal mask itself
(``tests/helpers/documents.py``). Rows hold documents shorter and longer than the sliding window
(8), a one-token document and a row that is one document; models have GQA, MQA, sliding and full
layers, and YaRN. KL_max <= 1e-9 and 100 % top-1 agreement over every position.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.interop.hf import load_hf
from olmax.interop.parity import position_metrics
from olmax.model import forward
from olmax.model.documents import segment_ids_from_doc_lens
from olmax.model.runtime import Runtime
from helpers.reference import require

torch = require("torch")
transformers = require("transformers")

from helpers.documents import hf_packed_logits  # noqa: E402
from helpers.hf_models import FULL, SLIDING, make_hf_model  # noqa: E402

T = 48
# Zero-padded like OLMo-core's doc_lens; 20 and 22 are longer than the window of 8.
DOC_LENS = np.array([[5, 20, 1, 22], [48, 0, 0, 0], [9, 8, 31, 0]], np.int32)
MODELS = {
    "gqa-default-pattern": dict(heads=4, kv_heads=2, window=8),
    "mqa-alternating-headdim32": dict(heads=4, kv_heads=1, head_dim=32, window=8,
                                      layer_types=[SLIDING, FULL] * 2, tie=True),
    "yarn-on-full-layers": dict(window=8, yarn={"factor": 4.0, "original_max_position_embeddings": 16},
                                max_pos=64),
}
PROFILES = [("cpu", "chunked"), ("tpu", "splash"), ("gpu", "cudnn")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("doc-parity")
    tokens = np.random.default_rng(4).integers(0, 300, (len(DOC_LENS), T)).astype(np.int32)
    out = {}
    for name, kw in MODELS.items():
        hf = make_hf_model(root / name, **kw)
        params, cfg, _ = load_hf(root / name)
        out[name] = (hf, jax.tree.map(jnp.asarray, params), cfg, hf_packed_logits(hf, tokens, DOC_LENS))
    return tokens, out


def _olmax(params, cfg, tokens, runtime, segments=True):
    seg = segment_ids_from_doc_lens(jnp.asarray(DOC_LENS), T) if segments else None
    with jax.default_matmul_precision("highest"):
        logits = jax.jit(lambda p, t: forward(p, t, cfg, runtime, segment_ids=seg))(
            params, jnp.asarray(tokens))
    return np.asarray(logits)[..., :cfg.vocab_size]


def _metrics(ref, out):
    kl, agree, diff = position_metrics(ref.reshape(-1, ref.shape[-1]), out.reshape(-1, out.shape[-1]))
    return kl.reshape(ref.shape[:2]), agree, diff


@pytest.mark.parametrize("profile,attn", PROFILES)
@pytest.mark.parametrize("case", sorted(MODELS))
def test_fp32_parity_with_documents(models, case, profile, attn):
    tokens, by_case = models
    _, params, cfg, ref = by_case[case]
    runtime = Runtime.resolve("float32", profile=profile)
    assert runtime.attn_impl == attn
    out = _olmax(params, cfg, tokens, runtime)
    kl, agree, diff = _metrics(ref, out)
    print(f"\n{case} fp32 {profile} with documents: kl_max {kl.max():.3e} top1 {agree.mean():.4f} "
          f"max|dlogit| {diff:.3e}")
    assert kl.max() <= 1e-9
    assert agree.all()


def test_hf_packed_positions_equal_explicit_block_masks(models):
    """HF's own packed-sequence mask (from the positions) and the hand-built 4-D masks per layer
    type are the same computation: identical logits."""
    tokens, by_case = models
    for hf, _, _, ref in by_case.values():
        np.testing.assert_array_equal(hf_packed_logits(hf, tokens, DOC_LENS, masks=True), ref)


def test_documents_change_the_logits(models):
    """Negative control: the reference differs from olmax without segments from the first document
    boundary on. (Positions counted from the row's start instead of each document's would not
    show here: RoPE scores depend only on q - k, so inside a document a common shift changes the
    logits by fp32 rounding alone -- more so at long positions, whose angles fp32 rounds coarser.)"""
    tokens, by_case = models
    _, params, cfg, ref = by_case["gqa-default-pattern"]
    plain = _metrics(ref, _olmax(params, cfg, tokens, Runtime(), segments=False))[0]
    assert plain[0, :5].max() <= 1e-9 and plain[1].max() <= 1e-9   # first document / one-document row
    assert plain[0, 5:].min() > 1e-6
