"""Caches that cannot lie: the epoch order and the packing are keyed by everything that determines
them and end in a checksum of their bytes; a file that fails it is rebuilt (and logged), never
read."""

from __future__ import annotations

import logging
import os

import numpy as np

from helpers.datahelp import EOS, PAD, write_tokens
from olmax.data.instances import epoch_indices, shuffled_indices
from olmax.data.packed import PackedIndex

N, SEED, EPOCH = 5000, 17, 1


def _header_bytes(path):
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def _order(cache):
    return epoch_indices(N, SEED, EPOCH, cache_dir=cache, disk_cache_min=100)


def test_a_zero_filled_epoch_order_of_the_right_size_is_rebuilt(tmp_path, caplog):
    want = shuffled_indices(N, SEED, EPOCH)
    path = _order(tmp_path).path
    raw = path.read_bytes()
    header = _header_bytes(path)
    for damaged in (raw[:header] + bytes(len(raw) - header),     # the data torn, the header kept
                    bytes(len(raw))):                             # the whole file zero-filled
        path.write_bytes(damaged)
        with caplog.at_level(logging.WARNING, logger="olmax"):
            caplog.clear()
            got = _order(tmp_path)
        assert np.array_equal(got[0:N], want)
        assert any("is damaged" in r.getMessage() and "rebuilding" in r.getMessage()
                   for r in caplog.records)
        assert path.read_bytes() == raw


def test_one_flipped_id_in_the_epoch_order_is_caught(tmp_path, caplog):
    path = _order(tmp_path).path
    raw = bytearray(path.read_bytes())
    raw[_header_bytes(path) + 4 * 4900] ^= 1
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="olmax"):
        got = _order(tmp_path)
    assert np.array_equal(got[0:N], shuffled_indices(N, SEED, EPOCH))
    assert "its bytes do not match its checksum" in caplog.text


def _documents(lengths):
    rng = np.random.default_rng(len(lengths))
    return np.concatenate([np.append(rng.integers(0, EOS, n - 1), EOS) for n in lengths])


def _packing(paths, cache):
    index = PackedIndex(paths, 16, np.dtype("<u4"), eos_token_id=EOS, pad_token_id=PAD,
                        cache_dir=cache)
    return [[(s, e) for _, s, e in index.documents(k)] for k in range(index.num_instances)]


def test_two_projects_with_relative_paths_share_a_cache_dir(tmp_path, monkeypatch):
    """Same relative path, same size, different documents: each project gets its own packing."""
    shared = tmp_path / "cache"
    a, b = tmp_path / "a" / "data", tmp_path / "b" / "data"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    write_tokens(a / "part.npy", _documents([16, 16, 8, 8]))
    write_tokens(b / "part.npy", _documents([4, 4, 4, 4, 4, 4, 8, 8, 8]))
    monkeypatch.chdir(a.parent)
    in_a = _packing(["data/part.npy"], shared)
    monkeypatch.chdir(b.parent)
    in_b = _packing(["data/part.npy"], shared)
    assert in_a == [[(0, 16)], [(16, 32)], [(32, 40), (40, 48)]]
    assert in_b != in_a and in_b == _packing([str(b / "part.npy")], tmp_path / "fresh")


def test_a_token_file_rewritten_in_place_gets_a_new_packing(tmp_path):
    path = tmp_path / "part.npy"
    write_tokens(path, _documents([16, 16, 8, 8]))
    first = _packing([str(path)], tmp_path / "cache")
    write_tokens(path, _documents([8, 8, 8, 8, 8, 8]))               # same size
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = _packing([str(path)], tmp_path / "cache")
    assert first != again and again == _packing([str(path)], tmp_path / "fresh")


def test_a_damaged_packing_is_rebuilt(tmp_path, caplog):
    path = tmp_path / "part.npy"
    write_tokens(path, _documents([16, 16, 8, 8]))
    want = _packing([str(path)], tmp_path / "cache")
    (cached,) = (tmp_path / "cache" / "packed").glob("*.npy")
    raw = cached.read_bytes()
    cached.write_bytes(raw[:128] + bytes(len(raw) - 128))
    with caplog.at_level(logging.WARNING, logger="olmax"):
        assert _packing([str(path)], tmp_path / "cache") == want
    assert "packing of source group 0 of 1" in caplog.text and "rebuilding" in caplog.text
    assert cached.read_bytes() == raw
