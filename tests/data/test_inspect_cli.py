"""``olmax data inspect --json`` equals what ai2-olmo-core's loader produces on the same mix."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from helpers.datahelp import EOS, PAD, VOCAB, write_tokens
from olmax.cli import main
from helpers.reference import require


SEQ, BATCH, SEED = 32, 4, 34521


@pytest.fixture
def mix(tmp_path):
    """A mix with repetitive instances mixed in, stored under allenai/dolma3-tokenizer."""
    rng = np.random.default_rng(0)
    lines = []
    for i, n in enumerate([700, 450, 1200]):
        tokens = rng.integers(0, VOCAB, n)
        for j in range(0, n - SEQ, 5 * SEQ):  # every 5th instance: one token repeated
            tokens[j:j + SEQ] = 7
        d = tmp_path / "store" / f"src{i % 2}" / "allenai" / "dolma3-tokenizer"
        d.mkdir(parents=True, exist_ok=True)
        write_tokens(d / f"part-{i}.npy", tokens)
        lines.append(f"src{i % 2},src{i % 2}/{{TOKENIZER}}/part-{i}.npy")
    path = tmp_path / "mix.txt"
    path.write_text("\n".join(lines) + "\n")
    return path, tmp_path / "store"


def olmo_core_records(paths, epoch, filtered):
    require("torch")
    numpy_dataset = require("olmo_core.data.numpy_dataset")
    data_loader = require("olmo_core.data.data_loader")
    collator_mod = require("olmo_core.data.collator")
    flt = numpy_dataset.InstanceFilterConfig() if filtered else None
    ds = numpy_dataset.NumpyFSLDataset(*paths, sequence_length=SEQ, pad_token_id=PAD, eos_token_id=EOS,
                                       vocab_size=VOCAB, dtype=np.uint32, instance_filter_config=flt)
    loader = data_loader.NumpyFSLDataLoader(ds, collator=collator_mod.DataCollator(pad_token_id=PAD),
                                            global_batch_size=BATCH * SEQ, work_dir=paths[0] + ".work",
                                            seed=SEED, shuffle=True)
    loader.reshuffle(epoch=epoch, in_memory=True)
    out = []
    for b, batch in enumerate(loader):
        ids = batch["input_ids"].numpy().astype("<u4")
        mask = batch.get("instance_mask")
        out.append({"batch": b, "instances": batch["index"].tolist(),
                    "sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
                    "filtered": [False] * BATCH if mask is None else (~mask.numpy()).tolist()})
    return out


@pytest.mark.reference
@pytest.mark.parametrize("filtered", [False, True])
def test_inspect_json_matches_olmo_core(mix, capsys, filtered):
    mix_path, root = mix
    # Resolve the mix the way OLMo-core's DataMix.build does: base_dir + path with {TOKENIZER}.
    oc_paths = [str(root) + "/" + line.split(",")[1].replace("{TOKENIZER}", "allenai/dolma3-tokenizer")
                for line in mix_path.read_text().splitlines()]
    ref = olmo_core_records(oc_paths, epoch=2, filtered=filtered)
    argv = ["data", "inspect", "--mix", str(mix_path), "--root", str(root), "--seq-len", str(SEQ),
            "--global-batch-size", str(BATCH), "--seed", str(SEED), "--epoch", "2",
            "--batches", f"0:{len(ref)}", "--json"] + (["--repetition-filter"] if filtered else [])
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == ref
    if filtered:
        assert any(any(r["filtered"]) for r in got)
    # without --batches: one epoch's size, the batches OLMo-core's loader gives in an epoch
    # (700 // 32 + 450 // 32 + 1200 // 32 = 21 + 14 + 37 = 72 instances, 72 // 4 = 18 batches)
    assert main(argv[:argv.index("--batches")] + ["--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps_per_epoch"] == len(ref) == 18 and summary["instances"] == 72


def test_inspect_paths_and_rollover(tmp_path, capsys):
    rng = np.random.default_rng(1)
    paths = [write_tokens(tmp_path / f"f{i}.npy", rng.integers(0, VOCAB, 300)) for i in range(2)]
    base = ["data", "inspect", "--paths", *paths, "--seq-len", "32", "--global-batch-size", "3",
            "--seed", "9", "--json"]
    assert main(base + ["--batches", "0:12"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(base + ["--batches", "6:12", "--epoch", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == whole[6:]
    # 18 instances, 6 batches per epoch: batch 6 is the first batch of epoch 2.
    assert main(base + ["--batches", "0:1", "--epoch", "2"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["instances"] == whole[6]["instances"]
    # without --batches: how long one epoch is (300 // 32 = 9 instances a file; 18 // 3 = 6 steps)
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out) == {
        "instances": 18, "files": 2, "seq_len": 32, "global_batch_size": 3, "steps_per_epoch": 6,
        "tokens_per_epoch": 6 * 3 * 32}
    assert main(base[:-1] + ["--global-batch-size", "4"]) == 0   # 18 // 4 = 4 steps, 2 dropped
    assert capsys.readouterr().out.strip() == ("18 instances of 32 tokens, 2 files; one epoch = 4 "
                                               "steps at global batch 4 = 512 tokens")


def test_inspect_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\1\2\3")
    rc = main(["data", "inspect", "--paths", str(bad), "--seq-len", "4", "--global-batch-size", "1",
               "--seed", "0", "--batches", "0:1", "--json"])
    err = capsys.readouterr().err
    assert rc != 0 and "bad.npy" in err and "not a multiple of 4" in err
    rc = main(["data", "inspect", "--paths", str(bad), "--seq-len", "4", "--global-batch-size", "1",
               "--seed", "0", "--batches", "3", "--json"])
    assert rc != 0 and "START:END" in capsys.readouterr().err


@pytest.mark.reference
def test_inspect_packed_matches_olmo_core(tmp_path, capsys):
    """``--packed`` with source groups and the source permutation: OLMo-core's packed dataset and
    loader give the same instances, tokens, document lengths and padding."""
    require("torch")
    numpy_dataset = require("olmo_core.data.numpy_dataset")
    data_loader = require("olmo_core.data.data_loader")
    collator_mod = require("olmo_core.data.collator")
    tokenizer_mod = require("olmo_core.data.tokenizer")
    rng = np.random.default_rng(2)
    paths = []
    for i in range(5):
        lengths = rng.integers(1, 3 * SEQ, 30)
        tokens = np.concatenate([np.append(rng.integers(0, EOS, n - 1), EOS) for n in lengths])
        paths.append(write_tokens(tmp_path / f"docs-{i}.npy", tokens))
    ds = numpy_dataset.NumpyPackedFSLDatasetConfig(
        tokenizer=tokenizer_mod.TokenizerConfig.dolma2(), paths=paths, sequence_length=SEQ,
        generate_doc_lengths=True, source_group_size=2, source_permutation_seed=123,
        work_dir=str(tmp_path / "oc"), dtype="uint32").build()
    ds.prepare()
    loader = data_loader.NumpyFSLDataLoader(ds, collator=collator_mod.DataCollator(pad_token_id=PAD),
                                            global_batch_size=BATCH * SEQ, work_dir=tmp_path / "oc",
                                            seed=SEED, shuffle=True)
    loader.reshuffle(epoch=1, in_memory=True)
    ref = []
    for b, batch in enumerate(loader):
        ids = batch["input_ids"].numpy().astype("<u4")
        ref.append({"batch": b, "instances": batch["index"].tolist(),
                    "sha256": hashlib.sha256(ids.tobytes()).hexdigest(), "filtered": [False] * BATCH,
                    "doc_lens": [row[row > 0].tolist() for row in batch["doc_lens"].numpy()],
                    "padding": (~batch["label_mask"].numpy()).sum(axis=1).tolist()})
    argv = ["data", "inspect", "--paths", *paths, "--seq-len", str(SEQ), "--global-batch-size",
            str(BATCH), "--seed", str(SEED), "--packed", "--source-group-size", "2",
            "--source-permutation-seed", "123", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv + ["--batches", f"0:{len(ref)}", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == ref and len(ref) > 2
    assert any(len(lens) > 2 for r in got for lens in r["doc_lens"])
    assert main(argv + ["--batches", "0:1"]) == 0
    table = capsys.readouterr().out
    k, lens = got[0]["instances"][0], got[0]["doc_lens"][0]
    assert f"instance {k:>10}: " in table and f"doc_lens [{', '.join(map(str, lens[:12]))}" in table
