"""``olmax eval`` end to end: an olmax checkpoint, an HF directory (its held-out CE equals the one
computed with transformers), and bad input (one line, non-zero exit, nothing written)."""

import json

import jax
import numpy as np
import pytest

from olmax.cli import main
from olmax.model.params import init_params

from helpers.tiny import tiny_cfg
from helpers.reference import require

EOS = 100257


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 3000, rng.integers(10, 50)) for _ in range(7)]
    held = tmp / "held.bin"
    np.concatenate([np.append(d, EOS) for d in docs]).astype("<u4").tofile(held)
    return tmp, str(held), docs


@pytest.fixture(scope="module")
def ckpt(files):
    from olmax.checkpoint.weights import save_params

    tmp, _, _ = files
    cfg = tiny_cfg(vocab_size=100278, padded_vocab_size=100352, d_model=16, head_dim=4, mlp_hidden=32)
    return str(save_params(tmp / "ckpt", init_params(cfg, jax.random.key(3)), cfg)), cfg


@pytest.mark.reference
def test_eval_olmax_checkpoint(files, ckpt, capsys):
    from helpers.evref import olmes_wheel

    olmes_wheel()
    tmp, held, docs = files
    out = tmp / "r1.json"
    rc = main(["eval", ckpt[0], "--tasks", "copycolors_10way_fast", "--heldout", f"h={held}",
               "--limit", "4", "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["source"] == "olmax" and r["softmax_vocab"] == 100352
    assert r["heldout"]["h"]["documents"] == 7 and r["heldout"]["h"]["tokens"] == sum(len(d) + 1 for d in docs)
    assert r["downstream"]["copycolors_10way_fast"]["documents"] == 4
    assert "eval/downstream/copycolors_10way_fast (accuracy)" in r["metrics"]
    assert "copycolors_10way_fast [acc, 4 docs]" in capsys.readouterr().out
    assert main(["eval", ckpt[0], "--heldout", f"h={held}", "--json", str(out)]) == 2   # no overwrite


@pytest.mark.reference
@pytest.mark.slow
def test_eval_hf_dir_matches_transformers(files, tmp_path):
    torch = require("torch")
    from helpers.evref import tiny_hf_model

    _, held, docs = files
    model, path = tiny_hf_model(tmp_path / "hf", vocab_size=100278)
    out = tmp_path / "r.json"
    assert main(["eval", str(path), "--heldout", f"h={held}", "--json", str(out), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    assert r["source"] == "hf" and r["softmax_vocab"] == 100278
    # transformers, OLMo-core convention: sum of next-token CE over each document / its token count
    loss, count = 0.0, 0
    for d in docs:
        ids = torch.tensor(np.append(d, EOS)[None].astype(np.int64))
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].double()
        loss += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1]
    np.testing.assert_allclose(r["heldout"]["h"]["CE loss"], loss / count, rtol=1e-5)


def test_bad_input(files, ckpt, capsys):
    tmp, held, _ = files
    out = tmp / "bad.json"
    cases = [
        (["eval", ckpt[0], "--tasks", "arc_easy_tset_bpb_5shot"], "unknown downstream task"),
        (["eval", str(tmp / "nope"), "--heldout", held], "checkpoint not found"),
        (["eval", ckpt[0], "--heldout", str(tmp / "missing.bin")], "token file not found"),
    ]
    from olmax.checkpoint.weights import save_params

    other = tiny_cfg(vocab_size=100278, padded_vocab_size=100352, d_model=24, head_dim=6, mlp_hidden=32)
    wrong = save_params(tmp / "wrong", init_params(ckpt[1], jax.random.key(0)), other)
    cases.append((["eval", str(wrong), "--heldout", held], "has shape"))
    for argv, msg in cases:
        capsys.readouterr()
        assert main(argv + ["--json", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
        assert not out.exists()
