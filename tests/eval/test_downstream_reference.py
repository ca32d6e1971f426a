"""Our OLMES scoring equals AI2's own EV code (olmo_eval 0.9.0) run on HF transformers.

The same tiny random ``Olmo3ForCausalLM`` is scored twice: by EV's ``OEEvalTask`` + ``collate_fn`` +
``ICLMetric`` on transformers' logits, and by olmax (weights imported with ``olmax.interop.hf``).
Per-request log-likelihoods and every metric must agree.
"""

import numpy as np
import pytest

from helpers.evref import EVTokenizer, ev_metric, ev_modules, tiny_hf_model
from olmax.eval.downstream import _Encoder, oe_eval_instances, score_instances, to_fast_mc
from olmax.eval.metrics import compute_metrics
from olmax.eval.scoring import Scorer
from olmax.eval.tasks import TaskSpec


class CharTok:
    """One token per character (ids 2..91): multi-token continuations, single-token letters."""

    bos_token_id = None

    def encode(self, text):
        return [2 + (ord(c) % 90) for c in text]


def _requests():
    rng = np.random.default_rng(0)
    words = ["the cat", "a dog", "blue sky", "green tree", "red car", "old house", "x", "quiet"]
    reqs = []
    for doc in range(6):
        ctx = " ".join(rng.choice(words, size=3 + 4 * doc)) + "\nAnswer:"  # the last ones exceed ctx len
        label = int(rng.integers(0, 4))
        for idx in range(4):
            cont = " " + str(rng.choice(words))
            reqs.append({"request_type": "loglikelihood", "doc": {}, "doc_id": doc, "idx": idx,
                         "label": label, "request": {"context": ctx, "continuation": cont}})
    return reqs


def _letter_requests():
    reqs = []
    for doc in range(5):
        ctx = f"Question {doc}: pick one\n A. x\n B. y\n C. z\nAnswer:"
        for idx, letter in enumerate("ABC"):
            reqs.append({"request_type": "loglikelihood", "doc": {}, "doc_id": doc, "idx": idx,
                         "label": doc % 3, "request": {"context": ctx, "continuation": letter}})
    return reqs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from olmax.interop.hf import load_hf

    model, path = tiny_hf_model(tmp_path_factory.mktemp("hf"))
    params, cfg, _ = load_hf(path)
    return model, params, cfg


def _assert_loglikelihoods_equal(scored, metric):
    """Request by request: our summed continuation log-probs equal EV's."""
    ours = {(s.doc_id, s.cont_id): s.logprob for s in scored}
    theirs = {(d, c): v for d, c, v in metric.loglikelihoods}
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=2e-5, atol=2e-5)


@pytest.mark.reference
@pytest.mark.parametrize("metric_type", ["acc", "len_norm", "bpb"])
def test_rc_requests_equal_ev_on_transformers(models, metric_type):
    ev_tasks, ev_metrics = ev_modules()
    model, params, cfg = models
    ctx_len = 48  # shorter than the longest query: exercises left truncation
    reqs = _requests()
    metric, ref = ev_metric(ev_tasks, ev_metrics, {"metric_type": metric_type}, reqs,
                            EVTokenizer(CharTok()), model, ctx_len)
    spec = TaskSpec("t", "OEEvalTask", (("metric_type", metric_type),))
    instances, mt = oe_eval_instances(spec, reqs, None, _Encoder(CharTok()), ctx_len)
    assert any(len(i.query) == ctx_len for i in instances)
    scored = score_instances(Scorer(cfg, softmax_vocab=cfg.vocab_size), params, instances, batch_size=3)
    if metric_type == "acc":  # EV keeps the raw sum for acc: compare request by request
        _assert_loglikelihoods_equal(scored, metric)
    got = compute_metrics(scored, mt)
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=2e-6, err_msg=k)


@pytest.mark.reference
def test_fast_mc_equals_ev_on_transformers(models):
    ev_tasks, ev_metrics = ev_modules()
    model, params, cfg = models
    reqs = _letter_requests()
    metric, ref = ev_metric(ev_tasks, ev_metrics, {"metric_type": "acc", "fast_mc": True}, reqs,
                            EVTokenizer(CharTok()), model, 256)
    spec = TaskSpec("t", "OEEvalTask", (("fast_mc", True), ("metric_type", "acc")))
    instances, mt = oe_eval_instances(spec, reqs, None, _Encoder(CharTok()), 256)
    instances = to_fast_mc(instances, "t")
    assert len(instances) == 5 and all(len(i.choices) == 3 for i in instances)
    scored = score_instances(Scorer(cfg, softmax_vocab=cfg.vocab_size), params, instances, batch_size=2)
    _assert_loglikelihoods_equal(scored, metric)
    got = compute_metrics(scored, mt)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=2e-6, err_msg=k)
