"""Held-out perplexity: a hand-checkable case and OLMo-core's LMEvaluator on the same losses."""

import jax
import numpy as np
import pytest

from olmax.eval.perplexity import perplexity, position_labels
from olmax.eval.scoring import Scorer
from olmax.model import olmo3
from helpers.reference import require


def _docs(lengths, T, pad=99, seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.full((len(lengths), T), pad, np.int32)
    mask = np.zeros((len(lengths), T), bool)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(0, 97, n)
        mask[i, :n] = True
    return tokens, mask


def test_uniform_model_hand_checkable(tiny):
    """All-zero weights -> uniform logits: every prediction costs ln(V); OLMo-core divides the sum
    of n-1 predictions per document by n (its unshifted label mask)."""
    cfg, params = tiny
    zero = jax.tree.map(np.zeros_like, params)
    lengths = [5, 3, 12, 1]
    tokens, mask = _docs(lengths, 16)
    for vocab in (cfg.padded_vocab_size, cfg.vocab_size):
        res = perplexity(Scorer(cfg, softmax_vocab=vocab), zero, tokens, mask, batch_size=3)
        preds = sum(n - 1 for n in lengths)
        assert res.mask_tokens == sum(lengths) and res.predicted == preds
        np.testing.assert_allclose(res.ce_loss, preds * np.log(vocab) / sum(lengths), rtol=1e-6)
        np.testing.assert_allclose(res.ce_loss_predicted, np.log(vocab), rtol=1e-6)
        m = res.metrics("x")
        np.testing.assert_allclose(m["x/PPL"], np.exp(m["x/CE loss"]))


def test_document_truncated_at_seq_len_has_no_label_at_the_end():
    tokens, mask = _docs([4], 4)
    targets, has_label = position_labels(tokens, mask)
    assert has_label.tolist() == [[True, True, True, False]]
    assert targets[0, :3].tolist() == tokens[0, 1:].tolist()


@pytest.mark.reference
def test_equals_olmo_core_lm_evaluator(tiny):
    """Per-token CE from OLMo-core's get_labels + cross_entropy over our logits, reduced by
    OLMo-core's LMEvaluator, equals our padded-form CE (and bucketing/batching does not matter)."""
    torch = require("torch")
    require("olmo_core")
    from olmo_core.data.utils import get_labels
    from olmo_core.eval.lm_evaluator import LMEvaluator

    cfg, params = tiny
    tokens, mask = _docs([20, 7, 33, 2, 40], 40, seed=3)
    logits = np.array(olmo3.forward(params, tokens, cfg))
    labels = get_labels({"input_ids": torch.from_numpy(tokens.astype(np.int64)),
                         "label_mask": torch.from_numpy(mask)})
    ce = torch.nn.functional.cross_entropy(torch.from_numpy(logits).flatten(0, 1), labels.flatten(),
                                           ignore_index=-100, reduction="none").view(labels.shape)
    ev = LMEvaluator(name="lm", batches=[], labels=["set"], device=torch.device("cpu"))
    ev.update_metrics({"metadata": [{"label": "set"}] * len(tokens), "label_mask": torch.from_numpy(mask)},
                      ce, None)
    ref = {k: float(v) for k, v in ev.compute_metrics().items()}
    res = perplexity(Scorer(cfg), params, tokens, mask, batch_size=2).metrics("set")
    np.testing.assert_allclose(res["set/CE loss"], ref["set/CE loss"], rtol=2e-6)
    np.testing.assert_allclose(res["set/PPL"], ref["set/PPL"], rtol=2e-6)
