"""Contamination guard: an injected leak is caught (verbatim and near-duplicate), clean data passes,
and the streaming scan does not depend on its chunk size."""

import numpy as np
import pytest

from olmax.errors import OlmaxError
from olmax.eval.contamination import check_heldout_disjoint, ngram_hashes, overlap

EOS = 100257


def _write(path, docs):
    np.concatenate([np.append(d, EOS) for d in docs]).astype("<u4").tofile(path)
    return str(path)


def _docs(rng, n, lo=20, hi=80):
    return [rng.integers(0, 50_000, rng.integers(lo, hi)) for _ in range(n)]


def test_ngram_hash_is_the_polynomial_of_the_window():
    toks = np.array([5, 9, 100256, 3, 7, 7, 2], np.int64)
    n = 4
    got = ngram_hashes(toks, n)
    P, M = 0x100000001B3, 1 << 64
    for i in range(len(toks) - n + 1):
        h = 0
        for t in toks[i:i + n]:
            h = (h * P + int(t) + 1) % M
        assert int(got[i]) == h
    assert len(ngram_hashes(toks[:3], n)) == 0


@pytest.fixture()
def leak(tmp_path):
    rng = np.random.default_rng(0)
    heldout = _docs(rng, 8)
    train = _docs(rng, 200)
    near = heldout[5].copy()
    near[:3] = [1, 2, 3]                                   # same document, first tokens edited
    train.insert(17, heldout[2])                          # verbatim leak
    train.insert(150, np.concatenate([[9, 9], near]))     # near duplicate inside a longer doc
    train_file = _write(tmp_path / "train.bin", train)
    held_file = _write(tmp_path / "heldout.bin", heldout)
    clean_file = _write(tmp_path / "clean.bin", _docs(rng, 6))
    return train_file, held_file, clean_file, heldout


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_injected_leak_is_found(leak, chunk):
    train_file, held_file, clean_file, heldout = leak
    from olmax.eval.contamination import documents_from_token_files as docs_of

    rep = overlap([train_file], {"held": docs_of([held_file], eos_token_id=EOS),
                                 "clean": docs_of([clean_file], eos_token_id=EOS)},
                  eos_token_id=EOS, chunk_tokens=chunk)
    held, clean = rep.sets
    assert (held.documents, held.exact_documents, held.near_duplicates) == (8, 1, 1)
    assert held.flagged == [2, 5] and held.documents_with_ngram_overlap == 2
    assert held.max_ngram_fraction == 1.0
    assert not clean.contaminated and clean.ngrams_in_train == 0
    assert rep.train_documents_scanned == 202 and not rep.partial


def test_guard_refuses_with_override(leak):
    train_file, held_file, clean_file, _ = leak
    with pytest.raises(OlmaxError, match=r"held-out set 'held' overlaps the training data: 1 of 8 .*"
                                         r"eval\.allow_overlap=true"):
        check_heldout_disjoint([train_file], {"held": [held_file], "clean": [clean_file]}, eos_token_id=EOS)
    rep = check_heldout_disjoint([train_file], {"held": [held_file]}, eos_token_id=EOS, allow=True)
    assert rep.contaminated[0].name == "held"
    ok = check_heldout_disjoint([train_file], {"clean": [clean_file]}, eos_token_id=EOS)
    assert not ok.contaminated


def test_partial_scan_is_reported(leak):
    train_file, held_file, _, _ = leak
    rep = check_heldout_disjoint([train_file], {"held": [held_file]}, eos_token_id=EOS, allow=True,
                                 max_train_tokens=500)
    assert rep.partial and rep.train_tokens_scanned == 500
