"""``olmax eval`` of an HF directory and of its imported checkpoint give the same numbers: the
vocabulary padding rows the HF model never had stay out of every softmax, because the import
records that they were never in one (olmax.interop.vocab_padding)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from olmax.cli import main
from olmax.interop import hf as hfio
from olmax.model.params import init_params
from helpers.tiny import small_cfg


@pytest.mark.reference
def test_eval_of_an_hf_directory_equals_eval_of_its_import(tmp_path):
    """Every reported number (held-out CE and PPL, downstream metrics) is the same for the HF
    directory and the checkpoint ``olmax convert hf-to-olmax`` made of it (<= 1e-6 relative)."""
    from helpers.evref import olmes_wheel

    olmes_wheel()
    cfg = small_cfg(vocab_size=100278, padded_vocab_size=100352, window_pattern=(8, 8, 8, None),
                    max_seq_len=512)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(5)))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)  # spread-out logits
    (tmp_path / "hf").mkdir()
    hfio.write_hf_dir(tmp_path / "hf", params, cfg, dtype="float32")
    assert main(["convert", "hf-to-olmax", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 100257, rng.integers(20, 60)), 100257) for _ in range(6)]
    held = tmp_path / "held.npy"
    np.concatenate(docs).astype("<u4").tofile(held)
    results = {}
    for name in ("hf", "ckpt"):
        out = tmp_path / f"{name}.json"
        assert main(["eval", str(tmp_path / name), "--heldout", f"h={held}", "--tasks",
                     "copycolors_10way_fast,arc_easy_test_bpb_5shot", "--limit", "6",
                     "--json", str(out), "--no-progress"]) == 0
        results[name] = json.loads(out.read_text())
    a, b = results["hf"], results["ckpt"]
    assert a["softmax_vocab"] == b["softmax_vocab"] == 100278
    assert a["metrics"].keys() == b["metrics"].keys() and len(a["metrics"]) >= 6
    for key, value in a["metrics"].items():
        assert abs(b["metrics"][key] - value) <= 1e-6 * max(abs(value), 1e-12), (key, value, b["metrics"][key])
    for task, r in a["downstream"].items():
        for key, value in r["metrics"].items():
            other = b["downstream"][task]["metrics"][key]
            assert abs(other - value) <= 1e-6 * max(abs(value), 1e-12), (task, key, value, other)
