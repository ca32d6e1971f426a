"""Instances, epoch order, host slices and fingerprint against ai2-olmo-core 3.0.0 on the same files."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.datahelp import DOLMA2, EOS, PAD, VOCAB, write_tokens
from olmax.data.loader import TrainData
from helpers.reference import require

torch = require("torch")
numpy_dataset = require("olmo_core.data.numpy_dataset")
data_loader = require("olmo_core.data.data_loader")
collator_mod = require("olmo_core.data.collator")

pytestmark = pytest.mark.reference

# Sizes chosen so files have remainders, one file is shorter than an instance and one is empty.
SIZES = [1000, 37, 0, 2500, 64 * 5, 777, 4096 + 3]
SEQ = 64


def oc_dataset(paths, seq_len, work_dir, filter_config=None, max_target=None):
    ds = numpy_dataset.NumpyFSLDataset(
        *paths, sequence_length=seq_len, pad_token_id=PAD, eos_token_id=EOS, vocab_size=VOCAB,
        dtype=np.uint32, instance_filter_config=filter_config, max_target_sequence_length=max_target)
    ds.work_dir = work_dir
    ds.prepare()
    return ds


def oc_epoch(ds, *, seed, epoch, batch, work_dir, dp_world_size=1, dp_rank=0):
    """All batches of one OLMo-core epoch: list of (instance indices, input_ids, instance_mask)."""
    loader = data_loader.NumpyFSLDataLoader(
        ds, collator=collator_mod.DataCollator(pad_token_id=PAD), global_batch_size=batch * ds.sequence_length,
        work_dir=work_dir, seed=seed, shuffle=True, dp_world_size=dp_world_size, dp_rank=dp_rank)
    loader.reshuffle(epoch=epoch, in_memory=True)
    out = []
    for b in loader:
        mask = b.get("instance_mask")
        out.append((b["index"].numpy(), b["input_ids"].numpy(),
                    None if mask is None else mask.numpy()))
    return out


def ours(paths, seq_len, batch, seed, epoch=1, **kw):
    return TrainData(paths, seq_len=seq_len, global_batch_size=batch, seed=seed, epoch=epoch,
                     tokenizer=DOLMA2, **kw)


def test_instance_boundaries_match(make_files, tmp_path):
    paths = make_files(SIZES, seed=1)
    ds = oc_dataset(paths, SEQ, tmp_path)
    td = ours(paths, SEQ, 1, seed=0)
    assert td.num_instances == len(ds)
    assert [tuple(map(int, o)) for o in zip(td.index.offsets[:-1], td.index.offsets[1:])] == \
        [tuple(o) for o in ds.offsets]
    ids = np.arange(len(ds))
    np.testing.assert_array_equal(td.read_instances(ids),
                                  np.stack([ds[int(i)]["input_ids"].numpy() for i in ids]))


@pytest.mark.parametrize("seed,epoch,batch", [(0, 1, 4), (34521, 1, 8), (7, 2, 3), (7, 5, 16), (123, 3, 1)])
def test_epoch_order_matches(make_files, tmp_path, seed, epoch, batch):
    paths = make_files(SIZES, seed=seed % 5)
    ds = oc_dataset(paths, SEQ, tmp_path)
    ref = oc_epoch(ds, seed=seed, epoch=epoch, batch=batch, work_dir=tmp_path)
    # Our stream starts at epoch 1; epoch e's row r is global batch (e - 1) * batches_per_epoch + r.
    td = ours(paths, SEQ, batch, seed=seed, epoch=1)
    assert td.batches_per_epoch == len(ref)
    for row, (idx, tokens, _) in enumerate(ref):
        got = td.global_batch((epoch - 1) * td.batches_per_epoch + row)
        np.testing.assert_array_equal(got["instance_ids"], idx)
        np.testing.assert_array_equal(got["tokens"], tokens)
    # Starting the stream at that epoch gives the same rows.
    td_e = ours(paths, SEQ, batch, seed=seed, epoch=epoch)
    np.testing.assert_array_equal(td_e.global_batch(0)["instance_ids"], ref[0][0])


def test_dp_ranks_cover_the_global_batch(make_files, tmp_path):
    """OLMo-core rank r reads rows r::W; together they are our global batch (same instances)."""
    paths = make_files(SIZES, seed=3)
    ds = oc_dataset(paths, SEQ, tmp_path)
    world = 4
    per_rank = [oc_epoch(ds, seed=11, epoch=1, batch=8, work_dir=tmp_path, dp_world_size=world, dp_rank=r)
                for r in range(world)]
    td = ours(paths, SEQ, 8, seed=11)
    for b in range(td.batches_per_epoch):
        ids = td.global_batch(b)["instance_ids"]
        for r in range(world):
            np.testing.assert_array_equal(per_rank[r][b][0], ids[r::world])


def test_fingerprint_is_olmo_cores(make_files, tmp_path):
    paths = make_files([500, 300], seed=2)
    ds = oc_dataset(paths, SEQ, tmp_path)
    assert ours(paths, SEQ, 2, seed=0).fingerprint["olmo_core_sha256"] == ds.fingerprint


@pytest.mark.parametrize("max_target", [SEQ, 4 * SEQ])
def test_max_target_sequence_length(make_files, tmp_path, max_target):
    """OLMo 3 sets max_target_sequence_length (= seq_len); larger values change chunking and hash."""
    paths = make_files(SIZES, seed=4)
    ds = oc_dataset(paths, SEQ, tmp_path, max_target=max_target)
    ref = oc_epoch(ds, seed=3, epoch=1, batch=4, work_dir=tmp_path)
    td = ours(paths, SEQ, 4, seed=3, max_target_seq_len=max_target)
    assert td.num_instances == len(ds) and td.fingerprint["olmo_core_sha256"] == ds.fingerprint
    for b, (idx, tokens, _) in enumerate(ref):
        got = td.global_batch(b)
        np.testing.assert_array_equal(got["instance_ids"], idx)
        np.testing.assert_array_equal(got["tokens"], tokens)
    assert ours(paths, SEQ, 4, seed=3).fingerprint["olmo_core_sha256"] != ds.fingerprint


def test_repetition_filter_decisions_in_loader(tmp_path):
    """Instance masks from OLMo-core's loader with InstanceFilterConfig equal ours, on crafted files."""
    rng = np.random.default_rng(5)
    seq = 128
    rows = []
    for i in range(24):
        row = rng.integers(0, 1000, seq)
        period, count = 1 + i % 7, 20 + 2 * i
        span = period * count
        if span < seq:
            start = int(rng.integers(0, seq - span))
            row[start:start + span] = np.tile(rng.integers(0, 1000, period), count)
        rows.append(row)
    path = write_tokens(tmp_path / "rep.npy", np.concatenate(rows))
    cfg = numpy_dataset.InstanceFilterConfig(repetition_max_period=13, repetition_min_period=1,
                                             repetition_max_count=32)
    ds = oc_dataset([path], seq, tmp_path, filter_config=cfg)
    ref = oc_epoch(ds, seed=3, epoch=1, batch=4, work_dir=tmp_path)
    from olmax.data.filters import RepetitionFilter
    td = ours([path], seq, 4, seed=3, repetition_filter=RepetitionFilter())
    masks = []
    for b, (idx, _, mask) in enumerate(ref):
        got = td.global_batch(b)
        np.testing.assert_array_equal(got["instance_ids"], idx)
        np.testing.assert_array_equal(got["instance_mask"], mask)
        masks.append(mask)
    masks = np.concatenate(masks)
    assert masks.any() and not masks.all()  # the crafted data exercises both decisions
