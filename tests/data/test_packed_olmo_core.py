"""Packed, document-masked instances against ai2-olmo-core 3.0.0's ``NumpyPackedFSLDataset`` on the
same files: instances (token ids, label masks), document lengths, epoch order over seeds and
epochs, source groups and the source permutation, and the dataset fingerprint."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.datahelp import DOLMA2, EOS, PAD, write_tokens
from helpers.reference import require
from olmax.data.loader import TrainData
from olmax.data.packed import Packing, best_fit_decreasing
from olmax.data.sources import permute_sources

torch = require("torch")
numpy_dataset = require("olmo_core.data.numpy_dataset")
data_loader = require("olmo_core.data.data_loader")
collator_mod = require("olmo_core.data.collator")
tokenizer_mod = require("olmo_core.data.tokenizer")
oc_utils = require("olmo_core.data.utils")

pytestmark = pytest.mark.reference

SEQ = 64


def doc_files(tmp_path, n_files, seed, docs_per_file=40, tail=True):
    """Token files of EOS-terminated documents: many equal lengths (ties in the sort), documents of
    exactly SEQ and longer than SEQ, and (``tail``) a last document without its EOS."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n_files):
        lengths = np.concatenate([rng.integers(1, 24, docs_per_file // 2),
                                  rng.choice([5, 9, 31, SEQ, SEQ + 1, 2 * SEQ + 7, 150], docs_per_file // 2)])
        rng.shuffle(lengths)
        parts = []
        for n in lengths:
            parts += [rng.integers(0, EOS, n - 1), [EOS]]
        if tail and i % 2 == 0:
            parts.append(rng.integers(0, EOS, 11))
        paths.append(write_tokens(tmp_path / f"docs-{seed}-{i:03d}.npy", np.concatenate(parts)))
    return paths


def oc_dataset(paths, work_dir, *, group=1, perm_seed=None, strategy="truncate"):
    cfg = numpy_dataset.NumpyPackedFSLDatasetConfig(
        tokenizer=tokenizer_mod.TokenizerConfig.dolma2(), paths=list(paths), sequence_length=SEQ,
        generate_doc_lengths=True, source_group_size=group, source_permutation_seed=perm_seed,
        long_doc_strategy=strategy, work_dir=str(work_dir), dtype="uint32")
    ds = cfg.build()
    ds.prepare()
    return ds


def oc_epoch(ds, *, seed, epoch, batch, work_dir):
    """One OLMo-core epoch: list of (instance ids, input_ids, label_mask, doc_lens) per batch."""
    loader = data_loader.NumpyFSLDataLoader(
        ds, collator=collator_mod.DataCollator(pad_token_id=PAD), global_batch_size=batch * SEQ,
        work_dir=work_dir, seed=seed, shuffle=True)
    loader.reshuffle(epoch=epoch, in_memory=True)
    return [(b["index"].numpy(), b["input_ids"].numpy(), b["label_mask"].numpy(),
             b["doc_lens"].numpy()) for b in loader]


def ours(paths, batch, seed, cache, *, group=1, perm_seed=None, strategy="truncate", epoch=1):
    if perm_seed is not None:
        paths, _ = permute_sources(paths, None, perm_seed)
    return TrainData(paths, seq_len=SEQ, global_batch_size=batch, seed=seed, epoch=epoch,
                     tokenizer=DOLMA2, cache_dir=str(cache),
                     packing=Packing(source_group_size=group, long_doc_strategy=strategy,
                                     doc_lens=True))


def same_doc_lens(ours_rows, theirs_rows):
    """Rows equal up to the zero padding (OLMo-core pads to the batch's most documents, we to the
    data's)."""
    width = max(ours_rows.shape[1], theirs_rows.shape[1])
    def pad(a):
        return np.pad(a, ((0, 0), (0, width - a.shape[1])))
    np.testing.assert_array_equal(pad(ours_rows), pad(theirs_rows))


@pytest.mark.parametrize("group,perm_seed,strategy", [(1, None, "truncate"), (3, 123, "truncate"),
                                                      (8, 7, "truncate"), (2, None, "fragment")])
def test_every_instance_matches(tmp_path, group, perm_seed, strategy):
    paths = doc_files(tmp_path, 7, seed=group)
    ds = oc_dataset(paths, tmp_path / "oc", group=group, perm_seed=perm_seed, strategy=strategy)
    td = ours(paths, 1, 0, tmp_path / "ours", group=group, perm_seed=perm_seed, strategy=strategy)
    assert td.num_instances == len(ds)
    assert [tuple(o) for o in zip(td.index.group_offsets[:-1], td.index.group_offsets[1:])] == \
        [tuple(o) for o in ds.source_instance_offsets]
    ids = np.arange(len(ds))
    tokens, label_mask, doc_lens = td.read_packed(ids)
    for k in ids:
        ref = ds[int(k)]
        np.testing.assert_array_equal(tokens[k], ref["input_ids"].numpy())
        np.testing.assert_array_equal(label_mask[k], ref["label_mask"].numpy())
        n = len(ref["doc_lens"])
        np.testing.assert_array_equal(doc_lens[k, :n], ref["doc_lens"].numpy())
        assert not doc_lens[k, n:].any()
    assert td.fingerprint["olmo_core_sha256"] == ds.fingerprint
    assert td.index.padding_tokens == int((~label_mask).sum()) > 0


@pytest.mark.parametrize("seed,epoch,batch", [(34521, 1, 4), (7, 2, 3), (0, 3, 8)])
def test_epoch_order_matches(tmp_path, seed, epoch, batch):
    paths = doc_files(tmp_path, 10, seed=seed % 11)
    ds = oc_dataset(paths, tmp_path / "oc", group=4, perm_seed=123)
    ref = oc_epoch(ds, seed=seed, epoch=epoch, batch=batch, work_dir=tmp_path / "oc")
    td = ours(paths, batch, seed, tmp_path / "ours", group=4, perm_seed=123)
    assert td.batches_per_epoch == len(ref) > 1
    for row, (idx, tokens, label_mask, doc_lens) in enumerate(ref):
        got = td.global_batch((epoch - 1) * td.batches_per_epoch + row)
        np.testing.assert_array_equal(got["instance_ids"], idx)
        np.testing.assert_array_equal(got["tokens"], tokens)
        np.testing.assert_array_equal(got["label_mask"], label_mask)
        same_doc_lens(got["doc_lens"], doc_lens)
        assert got["doc_lens"].dtype == np.int32 and got["doc_lens"].shape == (batch, td.doc_lens_width)
    # Any process count reads the same global batch; doc_lens has one width everywhere.
    b = (epoch - 1) * td.batches_per_epoch + 1
    whole = td.global_batch(b)
    if batch % 2 == 0:
        halves = [td.host_batch(b, p, 2) for p in range(2)]
        for key in ("tokens", "doc_lens", "label_mask", "instance_ids"):
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), whole[key])


def test_packer_matches_instance_packer():
    """The best-fit-decreasing assignment equals OLMo-core's segment-tree packer's bins on random
    lengths with many ties, including documents that fill a whole instance."""
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(1, SEQ + 1, 3000), np.full(50, SEQ), np.full(200, 7)])
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    indices = np.stack([starts, starts + lengths], axis=1).astype(np.uint64)
    packer = oc_utils.InstancePacker(SEQ)
    instances, sorted_indices, total = packer.pack_documents(indices)
    sorted_lengths = (sorted_indices[:, 1] - sorted_indices[:, 0]).astype(np.int64)
    bins = best_fit_decreasing(sorted_lengths, SEQ)
    ref = np.empty(len(lengths), np.int64)
    for b, docs in enumerate(instances):
        ref[docs] = b
    np.testing.assert_array_equal(bins, ref)
    assert total == lengths.sum()


def test_fingerprint_tracks_packing(tmp_path):
    paths = doc_files(tmp_path, 4, seed=5)
    a = ours(paths, 1, 0, tmp_path / "c", group=1)
    b = ours(paths, 1, 0, tmp_path / "c", group=2)
    from olmax.data.fingerprint import fingerprint_difference
    assert a.fingerprint["olmo_core_sha256"] != b.fingerprint["olmo_core_sha256"]
    assert "packing" in fingerprint_difference(a.fingerprint, b.fingerprint)[0]
