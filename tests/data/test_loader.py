"""TrainData: stateless resume, host slices, grain iteration, fingerprints, mix files, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.datahelp import DOLMA2, EOS, PAD, VOCAB, write_tokens
from olmax.config import DataConfig
from olmax.errors import ConfigError, OlmaxError
from olmax.data.heldout import padded_instances
from olmax.data.loader import TrainData, build_train_data
from helpers.reference import require

SIZES = [3000, 129, 5000, 64 * 9 + 5]


def make(paths, batch=8, seed=5, **kw):
    return TrainData(paths, seq_len=64, global_batch_size=batch, seed=seed, tokenizer=DOLMA2, **kw)


@pytest.mark.parametrize("k", [0, 3, 17])
def test_resume_with_different_process_counts(make_files, k):
    """Batches k.. are the same whether read whole, by 2 or 4 hosts, or resumed through iterate()."""
    paths = make_files(SIZES, seed=1)
    full = make(paths)
    n = 6
    ref = [full.global_batch(b) for b in range(k, k + n)]
    for procs in (1, 2, 4, 8):
        fresh = make(paths)  # a new process: no state besides b
        for p in range(procs):
            it = fresh.iterate(k, p, procs)
            for i in range(n):
                b, batch = next(it)
                assert b == k + i
                rows = slice(p * 8 // procs, (p + 1) * 8 // procs)
                np.testing.assert_array_equal(batch["tokens"], ref[i]["tokens"][rows])
                np.testing.assert_array_equal(batch["instance_ids"], ref[i]["instance_ids"][rows])


def test_epochs_roll_over(make_files):
    paths = make_files(SIZES, seed=2)
    td = make(paths)
    bpe = td.batches_per_epoch
    assert bpe == td.num_instances // 8
    epoch1 = np.concatenate([td.global_batch(b)["instance_ids"] for b in range(bpe)])
    epoch2 = np.concatenate([td.global_batch(b)["instance_ids"] for b in range(bpe, 2 * bpe)])
    assert len(set(epoch1.tolist())) == len(epoch1)  # no repeats within an epoch
    assert not np.array_equal(epoch1, epoch2) and td.epoch_of(bpe) == 2
    np.testing.assert_array_equal(make(paths, epoch=2).global_batch(0)["instance_ids"], epoch2[:8])


def test_batch_contents_and_types(make_files):
    paths = make_files(SIZES, seed=3)
    td = make(paths)
    batch = td.global_batch(0)
    assert batch["tokens"].dtype == np.int32 and batch["tokens"].shape == (8, 64)
    assert batch["instance_ids"].dtype == np.int64 and batch["instance_mask"].all()
    raw = np.concatenate([np.fromfile(p, dtype="<u4") for p in paths[:1]])
    i = int(batch["instance_ids"][0])
    if i < 3000 // 64:
        np.testing.assert_array_equal(batch["tokens"][0], raw[i * 64:(i + 1) * 64])


@pytest.mark.slow
def test_grain_worker_processes_give_the_same_stream(make_files):
    paths = make_files(SIZES, seed=4)
    ref = make(paths)
    it = make(paths, num_workers=2).iterate(5)
    for i in range(5):
        b, batch = next(it)
        np.testing.assert_array_equal(batch["tokens"], ref.global_batch(5 + i)["tokens"])


def test_fingerprint_mismatch_names_the_file(make_files, tmp_path):
    paths = make_files(SIZES, seed=5)
    saved = make(paths).fingerprint
    make(paths).check_fingerprint(saved)
    with pytest.raises(OlmaxError, match="1 file\\(s\\) removed"):
        make(paths[:3]).check_fingerprint(saved)
    write_tokens(paths[2], np.zeros(4000, dtype=np.uint32))
    with pytest.raises(OlmaxError, match=r"data file 2 .*part-002\.npy.*data\.ignore_fingerprint_mismatch=true"):
        make(paths).check_fingerprint(saved)
    make(paths, ignore_fingerprint_mismatch=True).check_fingerprint(saved)


def test_fingerprint_mismatch_says_what_differs_and_what_it_means(make_files):
    """Files in another order change the data order; other token ids over the same files do not
    (the tokenizer is compared by its ids: a name is not data)."""
    paths = make_files(SIZES[:3], seed=8)
    saved = make(paths).fingerprint
    with pytest.raises(OlmaxError, match=r"^dataset fingerprint mismatch: the same data files in "
                                         r"another order \(data file 0 was \S*part-000\.npy, now "
                                         r"\S*part-001\.npy\); the data order would change "):
        make([paths[1], paths[0], paths[2]]).check_fingerprint(saved)
    other_ids = {**DOLMA2, "eos_token_id": 5, "name": "fields"}
    with pytest.raises(OlmaxError, match=r"^dataset fingerprint mismatch: the tokenizer's "
                                         r"eos_token_id was 100257, now 5; the same files in the "
                                         r"same order, read as other token ids \(override with "
                                         r"data\.ignore_fingerprint_mismatch=true\)$"):
        TrainData(paths, seq_len=64, global_batch_size=8, seed=5,
                  tokenizer=other_ids).check_fingerprint(saved)
    renamed = {**DOLMA2, "name": "allenai/dolma2-tokenizer"}
    TrainData(paths, seq_len=64, global_batch_size=8, seed=5,
              tokenizer=renamed).check_fingerprint(saved)


def test_olmo_core_fingerprint_mismatch_is_explained_from_what_the_checkpoint_keeps(make_files):
    """An OLMo-core checkpoint keeps only the sha256; its config.json's tokenizer, its
    data_paths.txt and its trainer state tell what differs."""
    from olmax.data.fingerprint import olmo_core_difference

    paths = make_files(SIZES[:3], seed=9)
    ours = make(paths).fingerprint
    theirs_ids = {**DOLMA2, "eos_token_id": 5}
    sha = TrainData(paths, seq_len=64, global_batch_size=8, seed=5,
                    tokenizer=theirs_ids).fingerprint["olmo_core_sha256"]
    assert olmo_core_difference(sha, ours, tokenizer=theirs_ids, paths=paths) == (
        "only the tokenizer's ids differ: the checkpoint's eos_token_id was 5, now 100257", False)
    other = make([paths[0], paths[2]]).fingerprint["olmo_core_sha256"]
    why, order = olmo_core_difference(other, ours, tokenizer=DOLMA2, paths=[paths[0], paths[2]])
    assert order and why.startswith("data file 1 was part-002.npy, now part-001.npy")
    assert why.endswith("(the checkpoint's data_paths.txt)")
    assert olmo_core_difference(other, ours, tokenizer=DOLMA2, paths=paths) == (
        "the same file names in the same order as the checkpoint's data_paths.txt, so their "
        "sizes differ", True)
    assert olmo_core_difference(other, ours, tokenizer=None, paths=None, max_target_seq_len=8192) \
        == ("max_target_seq_len was 8192, now None", True)


def test_bad_token_files(make_files, tmp_path):
    paths = make_files([1000], seed=6)
    bad = tmp_path / "odd.npy"
    bad.write_bytes(b"\0" * 4001)
    with pytest.raises(OlmaxError, match=r"odd\.npy.*not a multiple of 4"):
        make([paths[0], str(bad)])
    with pytest.raises(OlmaxError, match=r"token file not found: .*missing\.npy"):
        make([str(tmp_path / "missing.npy")])
    big = write_tokens(tmp_path / "big.npy", np.full(640, VOCAB + 5, dtype=np.uint32))
    with pytest.raises(OlmaxError, match=r"^the tokenizer \(100278 ids\) does not hold token id "
                                         r"100283, at position 0 of \S*big\.npy \(tokens"):
        make([big], batch=2).global_batch(0)
    with pytest.raises(OlmaxError, match="fewer than one global batch"):
        make(paths, batch=1000)


def test_mix_file_root_remap_and_errors(make_files, tmp_path):
    paths = make_files([700, 900], seed=7)
    data = tmp_path / "store" / "preprocessed" / "src" / "allenai" / "dolma3-tokenizer"
    data.mkdir(parents=True)
    for i, p in enumerate(paths):
        (data / f"{i:03d}.npy").write_bytes(open(p, "rb").read())
    mix = tmp_path / "mix.txt"
    mix.write_text("# comment\n\nsrc,preprocessed/src/{TOKENIZER}/000.npy\nsrc,preprocessed/src/{TOKENIZER}/001.npy\n")
    cfg = DataConfig(mix=str(mix), root=str(tmp_path / "store"))
    td = build_train_data(cfg, seq_len=64, global_batch_size=4, seed=1)
    direct = make(paths, batch=4, seed=1)
    assert td.labels == ["src", "src"] and td.num_instances == direct.num_instances
    np.testing.assert_array_equal(td.global_batch(1)["tokens"], direct.global_batch(1)["tokens"])
    remapped = build_train_data(DataConfig(mix=str(mix), root="s3://ai2-llm",
                                           remap=(f"s3://ai2-llm/={tmp_path / 'store'}/",)),
                                seq_len=64, global_batch_size=4, seed=1)
    assert remapped.index.paths == td.index.paths
    with pytest.raises(OlmaxError, match=r"mix\.txt:4: file not found: .*001\.npy"):
        (data / "001.npy").unlink()
        build_train_data(cfg, seq_len=64, global_batch_size=4, seed=1)
    mix.write_text("src,preprocessed/000.npy\n")
    with pytest.raises(OlmaxError, match=r"mix\.txt:1: path has no \{TOKENIZER\}"):
        build_train_data(cfg, seq_len=64, global_batch_size=4, seed=1)
    with pytest.raises(ConfigError, match="exactly one of"):
        build_train_data(DataConfig(), seq_len=64, global_batch_size=4, seed=1)


def test_padded_heldout_instances(tmp_path):
    docs = [[1, 2, 3], list(range(10, 30)), [7]]
    stream = [t for d in docs for t in d + [EOS]] + [5, 5]  # trailing tokens without EOS: no document
    path = write_tokens(tmp_path / "h.npy", stream)
    tokens, mask = padded_instances([path], 8, eos_token_id=EOS, pad_token_id=PAD)
    assert tokens.shape == (3, 8) and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens[0], [1, 2, 3, EOS, PAD, PAD, PAD, PAD])
    np.testing.assert_array_equal(tokens[1], list(range(10, 18)))  # truncated to seq_len
    np.testing.assert_array_equal(mask.sum(1), [4, 8, 2])
    t2, _ = padded_instances([path, path], 8, eos_token_id=EOS, pad_token_id=PAD, max_docs=4)
    assert t2.shape[0] == 4


@pytest.mark.reference
def test_padded_heldout_matches_olmo_core(tmp_path):
    numpy_dataset = require("olmo_core.data.numpy_dataset")
    rng = np.random.default_rng(0)
    stream = []
    for _ in range(30):
        stream += rng.integers(0, 1000, int(rng.integers(1, 60))).tolist() + [EOS]
    paths = [write_tokens(tmp_path / "a.npy", stream), write_tokens(tmp_path / "b.npy", stream[::-1] + [EOS])]
    ds = numpy_dataset.NumpyPaddedFSLDataset(*paths, sequence_length=32, pad_token_id=PAD, eos_token_id=EOS,
                                             vocab_size=VOCAB, dtype=np.uint32)
    ds.work_dir = tmp_path / "work"
    ds.prepare()
    tokens, mask = padded_instances(paths, 32, eos_token_id=EOS, pad_token_id=PAD)
    assert len(ds) == tokens.shape[0]
    for i in range(len(ds)):
        item = ds[i]
        np.testing.assert_array_equal(item["input_ids"].numpy(), tokens[i])
        np.testing.assert_array_equal(item["label_mask"].numpy(), mask[i])


def test_index_cache_on_disk(tmp_path):
    """Large epoch orders are cached as .npy and read by slices; same values as in memory."""
    from olmax.data.instances import IndexFile, epoch_indices, shuffled_indices

    ref = shuffled_indices(5000, 34521, 2)
    disk = epoch_indices(5000, 34521, 2, cache_dir=tmp_path, disk_cache_min=100)
    assert isinstance(disk, IndexFile) and len(disk) == 5000
    for lo, hi in ((0, 512), (4900, 5000), (1234, 1235), (10, 10)):
        np.testing.assert_array_equal(disk[lo:hi], ref[lo:hi])
    again = epoch_indices(5000, 34521, 2, cache_dir=tmp_path, disk_cache_min=100)  # reuses the file
    np.testing.assert_array_equal(again[0:5000], ref)
    path = disk.path
    path.write_bytes(path.read_bytes()[:-4])             # truncated: fails its checksum, rebuilt
    again = epoch_indices(5000, 34521, 2, cache_dir=tmp_path, disk_cache_min=100)
    np.testing.assert_array_equal(again[0:5000], ref)
