"""EV in-loop metrics on hand-built requests, values worked out by hand."""

import math

import numpy as np
import pytest

from olmax.eval.metrics import LOG_2_OF_E, Scored, compute_metrics, labelled


def rec(doc, cont, label, lp, text):
    return Scored(doc, cont, label, lp, len(text), len(text.encode()), len(text) - 1,
                  len(text[1:].encode()))


DOCS = [
    # doc 0, gold = 1: raw sums pick choice 2, per-character sums pick choice 1
    rec(0, 0, 1, -3.0, " ab"), rec(0, 1, 1, -4.0, " abcd"), rec(0, 2, 1, -2.5, " a"),
    # doc 1, gold = 0: both pick choice 1; " é" is 2 characters, 3 bytes
    rec(1, 0, 0, -1.0, " é"), rec(1, 1, 0, -0.5, " yy"),
]


def test_acc_and_len_norm_by_hand():
    acc = compute_metrics(DOCS, "acc")
    assert acc["acc_v1"] == acc["acc_v2"] == 0.0
    ln = compute_metrics(DOCS, "len_norm")
    assert ln["len_norm_v2"] == 0.5 and ln["len_norm_v1"] == 0.5   # v1 reuses v2's predictions (EV)
    # BPB at the gold choice: doc0 " abcd" 5 bytes (4 without the space), doc1 " é" 3 bytes (2)
    for m in (acc, ln):
        assert m["bpb_v2"] == pytest.approx((4.0 / 5 + 1.0 / 3) / 2 * LOG_2_OF_E, rel=1e-12)
        assert m["bpb_v1"] == pytest.approx((4.0 / 4 + 1.0 / 2) / 2 * LOG_2_OF_E, rel=1e-12)
        assert m["ce_loss_v2"] == pytest.approx((4.0 / 5 + 1.0 / 2) / 2, rel=1e-12)   # per character
        assert m["ce_loss_v1"] == pytest.approx((4.0 / 4 + 1.0 / 1) / 2, rel=1e-12)
    # soft: softmax over the (raw or normalised) log-likelihoods, at the gold choice
    p0 = math.exp(-4.0) / (math.exp(-3.0) + math.exp(-4.0) + math.exp(-2.5))
    p1 = math.exp(-1.0) / (math.exp(-1.0) + math.exp(-0.5))
    assert acc["soft_v2"] == pytest.approx((p0 + p1) / 2, rel=1e-12)
    assert acc["soft_log_v2"] == pytest.approx((math.log(p0) + math.log(p1)) / 2, rel=1e-12)
    q0 = math.exp(-0.8) / (math.exp(-1.0) + math.exp(-0.8) + math.exp(-1.25))
    q1 = math.exp(-0.5) / (math.exp(-0.5) + math.exp(-0.5 / 3))
    assert ln["soft_v2"] == pytest.approx((q0 + q1) / 2, rel=1e-12)


def test_bpb_single_gold():
    gold = [rec(0, 0, 0, -6.0, " hello"), rec(1, 0, 0, -2.0, "\ncode")]
    m = compute_metrics(gold, "bpb")
    assert set(m) == {"bpb_v1", "bpb_v2"}
    assert m["bpb_v2"] == pytest.approx((6 / 6 + 2 / 5) / 2 * LOG_2_OF_E, rel=1e-12)
    assert m["bpb_v1"] == pytest.approx((6 / 5 + 2 / 4) / 2 * LOG_2_OF_E, rel=1e-12)


def test_incomplete_document_skipped_and_first_record_wins():
    recs = DOCS + [rec(2, 3, 0, -1.0, " q")]            # doc 2 has only choice 3 of 1 -> skipped
    recs += [rec(1, 1, 0, -0.1, " yy")]                 # duplicate of doc 1 choice 1: ignored
    assert compute_metrics(recs, "acc") == compute_metrics(DOCS, "acc")


def test_ties_pick_the_first_choice():
    tie = [rec(0, 0, 0, -1.0, " a"), rec(0, 1, 0, -1.0, " b")]
    assert compute_metrics(tie, "acc")["acc_v2"] == 1.0


def test_f1_and_labels():
    recs = [rec(d, c, d % 2, -1.0 if c == 0 else -2.0, " x") for d in range(4) for c in range(2)]
    m = compute_metrics(recs, "f1")       # always predicts 0; positives (label 0) are docs 0 and 2
    assert m["f1_v1"] == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert labelled("arc", {"bpb_v2": 1.0, "acc_v1": 0.5}) == {"arc (BPB v2)": 1.0, "arc (accuracy)": 0.5}
    assert np.isnan(compute_metrics([], "bpb")["bpb_v2"])
