"""``olmax train`` on packed instances (``data.instances=packed``, ``data.doc_lens=true``): the
trainer hands the step each batch's label mask (padding is not scored) and document lengths
(intra-document masking), so its first loss is the loss of that batch computed directly."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import yaml

from helpers.datahelp import EOS, write_tokens
from olmax.cli import main
from olmax.data.loader import build_train_data
from olmax.model.documents import segment_ids_from_doc_lens
from olmax.model.params import init_params
from olmax.train.loss import loss_and_sums, loss_denominator, make_labels
from olmax.train.recipes import load_recipe

MODEL = {"d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8,
         "mlp_hidden": 64, "vocab_size": 100278, "padded_vocab_size": 100352,
         "window_pattern": [8, 8, 8, None], "max_seq_len": 64}


@pytest.fixture(scope="module")
def packed_recipe(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    paths = []
    for i in range(2):
        docs = [np.append(rng.integers(10, 5000, rng.integers(3, 40)), EOS) for _ in range(40)]
        paths.append(write_tokens(d / f"part{i}.npy", np.concatenate(docs)))
    recipe = {"model": MODEL, "seed": 3,
              "data": {"paths": paths, "instances": "packed", "source_group_size": 2,
                       "doc_lens": True, "cache_dir": str(d / "cache")},
              "train": {"seq_len": 32, "global_batch_size": 4, "max_steps": 2, "attn_impl": "chunked"},
              "scheduler": {"name": "constant"}, "checkpoint": {"interval": 100},
              "logging": {"tensorboard": False, "progress": False}}
    path = d / "packed.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow
def test_first_loss_is_the_packed_batch_loss(packed_recipe, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", str(packed_recipe), "--run-dir", str(run_dir), "--quiet"]) == 0
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])

    cfg = load_recipe(str(packed_recipe))
    data = build_train_data(cfg.data, seq_len=32, global_batch_size=4, seed=cfg.seed)
    batch = data.global_batch(0)
    assert (~batch["label_mask"]).any() and (batch["doc_lens"] > 0).sum(axis=1).max() > 1
    params = init_params(cfg.model, jax.random.key(cfg.seed))
    tokens = batch["tokens"].astype(np.int32)

    def loss(label_mask=None, doc_lens=None):
        labels = make_labels(tokens, batch["instance_mask"], label_mask)
        denom = loss_denominator(labels, batch["instance_mask"])
        kw = {} if doc_lens is None else {"segment_ids": segment_ids_from_doc_lens(doc_lens, 32)}
        value, _ = loss_and_sums(params, tokens, labels, denom, cfg.model,
                                 z_loss_multiplier=0.0, **kw)
        return float(value)

    expected = loss(batch["label_mask"], batch["doc_lens"])
    np.testing.assert_allclose(first["loss"], expected, rtol=1e-6)
    # both parts matter: without the label mask or without the documents the loss is another
    for other in (loss(None, batch["doc_lens"]), loss(batch["label_mask"], None)):
        assert abs(other - expected) > 1e-4 * expected
