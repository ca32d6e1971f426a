"""The embedded corpus: real text, a deterministic by-document held-out split, cached token files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from olmax.data.embedded import embedded_documents, embedded_named_documents, embedded_token_files
from olmax.data.tokenizer import get_tokenizer


def test_split_is_by_document_and_deterministic():
    train = embedded_named_documents("train")
    heldout = embedded_named_documents("heldout")
    names_t, names_h = {n for n, _ in train}, {n for n, _ in heldout}
    assert not names_t & names_h
    assert any(n.startswith("pydoc/") for n in names_t | names_h)
    assert 0.02 < len(heldout) / (len(train) + len(heldout)) < 0.10
    assert embedded_documents("heldout") == [t for _, t in heldout]
    assert sum(map(len, embedded_documents("train"))) > 10_000_000  # tens of MB of real text


def test_token_files_are_doc_plus_eos_and_cached(tmp_path):
    tok = get_tokenizer("dolma2")
    paths = embedded_token_files("heldout", cache_dir=tmp_path)
    stream = np.concatenate([np.fromfile(p, dtype="<u4") for p in paths])
    expected = np.concatenate([np.array(ids + [tok.eos_token_id], dtype=np.uint32)
                               for ids in tok.encode_batch(embedded_documents("heldout"))])
    np.testing.assert_array_equal(stream, expected)
    manifest = json.loads((Path(paths[0]).parent / "manifest.json").read_text())
    assert manifest["tokenizer"]["name"] == "dolma2"
    mtimes = [Path(p).stat().st_mtime_ns for p in paths]
    assert embedded_token_files("heldout", cache_dir=tmp_path) == paths  # reused, not rebuilt
    assert [Path(p).stat().st_mtime_ns for p in paths] == mtimes
    assert not [p for p in (tmp_path / "embedded").iterdir() if p.name.startswith(".")]


def test_heldout_split_is_not_a_copy_of_training():
    """The stdlib is full of copies; no held-out document may be one (verbatim or near)."""
    train = embedded_documents("train")
    heldout = embedded_documents("heldout")
    assert not set(heldout) & set(train)
    # Independent check with token 13-grams (the contamination guard's unit, not the split's words).
    from olmax.eval.contamination import DEFAULT_THRESHOLD, ngram_hashes

    tok = get_tokenizer("dolma2")
    seen = set()
    for ids in tok.encode_batch(train):
        seen.update(ngram_hashes(np.asarray(ids, dtype=np.uint32)).tolist())
    for name_text, ids in zip(embedded_named_documents("heldout"), tok.encode_batch(heldout)):
        grams = set(ngram_hashes(np.asarray(ids, dtype=np.uint32)).tolist())
        if grams:
            frac = len(grams & seen) / len(grams)
            assert frac < DEFAULT_THRESHOLD / 2, (name_text[0], frac)


def test_a_damaged_cached_split_is_rebuilt_not_read(tmp_path, caplog):
    paths = embedded_token_files("heldout", cache_dir=tmp_path)
    want = [Path(p).read_bytes() for p in paths]
    Path(paths[0]).write_bytes(bytes(len(want[0])))          # the right size, zero-filled
    with caplog.at_level(logging.WARNING, logger="olmax"):
        assert embedded_token_files("heldout", cache_dir=tmp_path) == paths
    assert [Path(p).read_bytes() for p in paths] == want
    assert "does not match its checksum" in caplog.text and "rebuilding it" in caplog.text
    assert not [p for p in (tmp_path / "embedded").iterdir() if p.name.startswith(".")]


def test_the_heldout_names_cache_holds_the_computed_split_and_a_damaged_one_is_rebuilt(
        tmp_path, caplog, monkeypatch):
    """The held-out names are kept in the cache: what a process reads there is what the rule
    computes; a cache file torn or zero-filled is logged and rebuilt; a cache that cannot be
    written changes nothing but the time. (On a corpus of 400 random documents, one held-out
    candidate a copy of a training document: the rule, not the standard library, is the point.)"""
    import random

    from olmax.data import embedded

    rng = random.Random(3)
    words = [f"w{i}" for i in range(5000)]
    docs = [(f"doc/{i}", " ".join(rng.choices(words, k=60))) for i in range(400)]
    cands = [i for i, (n, _) in enumerate(docs) if embedded._is_heldout_candidate(n)]
    train = next(i for i in range(len(docs)) if i not in cands)
    docs[cands[0]] = (docs[cands[0]][0], docs[train][1])          # a copy: goes to training
    docs = tuple(docs)
    monkeypatch.setattr(embedded, "_all_documents", lambda: docs)
    want = embedded._compute_heldout_names(docs)
    assert want == {docs[i][0] for i in cands[1:]} and len(want) >= 10

    def fresh():
        monkeypatch.setattr(embedded, "_HELDOUT", {})

    fresh()
    assert embedded._heldout_names(tmp_path) == want
    cached, = (tmp_path / "embedded").glob("heldout-*.json")
    fresh()
    with monkeypatch.context() as m:
        m.setattr(embedded, "_compute_heldout_names", lambda d: frozenset())   # not called
        assert embedded._heldout_names(tmp_path) == want

    cached.write_bytes(bytes(cached.stat().st_size))               # zero-filled
    fresh()
    with caplog.at_level(logging.WARNING, logger="olmax"):
        assert embedded._heldout_names(tmp_path) == want
    assert "held-out split" in caplog.text and "rebuilding it" in caplog.text
    fresh()
    blocked = tmp_path / "file"
    blocked.write_text("")                                         # a file where a folder must be
    assert embedded._heldout_names(blocked) == want
