"""Vocabulary padding rows (olmax.interop.vocab_padding).

- The rows an HF import adds are transformers' ``resize_token_embeddings`` mean-resizing, the way
  OLMo-core's ``load_hf_model`` pads: given the standard-normal draws transformers took from torch,
  olmax's rows equal transformers' to float32 rounding (embedding and LM head).
- ``init.hf_dir`` and ``olmax convert hf-to-olmax`` make the same rows (an import is a pure function
  of the HF directory).
- Old checkpoints without the record are read by their source (the eval side, HF directory vs
  its import giving the same numbers: tests/eval/test_eval_hf_vs_import.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from olmax.config import ModelConfig
from olmax.interop import hf as hfio
from olmax.interop.vocab_padding import mean_resized_rows, softmax_vocab
from olmax.checkpoint.weights import load_meta, load_params

from helpers.hf_models import make_hf_model
from helpers.reference import require


def _resize_with_captured_draws(model, new_size, monkeypatch):
    """transformers' resize (as OLMo-core calls it), recording the N(0, I) draws it makes."""
    import torch

    mvn = torch.distributions.multivariate_normal
    draws = []
    real = mvn._standard_normal

    def spy(shape, dtype, device):
        z = real(shape, dtype=dtype, device=device)
        draws.append(z.clone().numpy())
        return z

    monkeypatch.setattr(mvn, "_standard_normal", spy)
    model.resize_token_embeddings(new_size)
    return draws


@pytest.mark.reference
def test_padding_rows_reproduce_transformers_mean_resizing(tmp_path, monkeypatch):
    require("torch")
    model = make_hf_model(tmp_path / "hf", vocab=300, hidden=64, std=0.15)
    weights = hfio.SafetensorsDir(tmp_path / "hf")
    draws = _resize_with_captured_draws(model, 384, monkeypatch)
    assert len(draws) == 2, "one multivariate-normal draw for the embedding, one for the LM head"
    theirs = {"model.embed_tokens.weight": model.get_input_embeddings().weight.detach().numpy(),
              "lm_head.weight": model.lm_head.weight.detach().numpy()}
    for (name, ref), z in zip(theirs.items(), draws):
        ours = mean_resized_rows(lambda a, b, name=name: weights.read_rows(name, a, b), 300, 64, 84, noise=z)
        # float32 rounding of the mean: torch's reduction order follows its thread count
        rounding = 32 * np.finfo(np.float32).eps * np.abs(ref[300:]).max()
        np.testing.assert_allclose(ours, ref[300:], rtol=0, atol=rounding)
        np.testing.assert_array_equal(ref[:300], weights.read(name))
        mean = weights.read(name).mean(axis=0)
        assert np.abs(ref[300:] - mean).max() > 100 * np.abs(ours - ref[300:]).max(), \
            "the covariance draw is reproduced, not only the mean"

    # init.hf_dir (load_hf) and the converter make the same rows; their draws are olmax's own, so
    # against transformers they agree to the size of the draw (~sqrt(1e-9) of the rows' spread)
    loaded, cfg, _ = hfio.load_hf(tmp_path / "hf")
    hfio.convert_hf_to_olmax(tmp_path / "hf", tmp_path / "ckpt")
    imported, _ = load_params(tmp_path / "ckpt")
    np.testing.assert_array_equal(np.asarray(imported["embed"]), loaded["embed"])
    np.testing.assert_array_equal(np.asarray(imported["lm_head"]), loaded["lm_head"])
    spread = theirs["model.embed_tokens.weight"][:300].std()
    assert np.abs(loaded["embed"][300:] - theirs["model.embed_tokens.weight"][300:]).max() < 2e-4 * spread
    assert np.abs(loaded["lm_head"][:, 300:].T - theirs["lm_head.weight"][300:]).max() < 2e-4 * spread
    meta = load_meta(tmp_path / "ckpt")
    assert meta["vocab_padding"]["rows"] == [300, 384] and meta["vocab_padding"]["in_softmax"] is False
    assert softmax_vocab(meta, cfg) == 300


def test_mean_alone_when_the_covariance_is_not_positive_definite():
    x = np.tile(np.arange(8, dtype=np.float32), (5, 1))       # identical rows: Sigma = 0
    rows = mean_resized_rows(lambda a, b: x[a:b], 5, 8, 3)
    np.testing.assert_array_equal(rows, np.tile(x[0], (3, 1)))


def test_softmax_vocab_of_checkpoints_written_before_the_record():
    cfg = ModelConfig(d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, mlp_hidden=8,
                      vocab_size=100, padded_vocab_size=128, window_pattern=(None,))
    assert softmax_vocab({"source": {"format": "hf"}}, cfg) == 100
    assert softmax_vocab({"init": {"kind": "fresh"}}, cfg) == 128
    assert softmax_vocab({"vocab_padding": {"in_softmax": True}, "source": {"format": "hf"}}, cfg) == 128
