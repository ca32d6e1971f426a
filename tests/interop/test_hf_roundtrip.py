"""HF -> olmax -> HF round trips are bit-exact on every tensor, and transformers loads the export.

Tensors are compared with ``safetensors.torch`` (an independent reader) by their raw bits.
"""

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from olmax.interop import hf as hfio
from olmax.checkpoint.weights import load_meta, load_params
from helpers.reference import require

torch = require("torch")
transformers = require("transformers")
from safetensors.torch import load_file  # noqa: E402

from helpers.hf_models import FULL, SLIDING, make_hf_model  # noqa: E402


def _tensors(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _assert_bit_exact(a: Path, b: Path):
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert ta[name].shape == tb[name].shape, name
        assert torch.equal(_bits(ta[name]), _bits(tb[name])), name


CASES = {
    "fp32-gqa": dict(dtype="float32"),
    "bf16-sharded": dict(dtype="bfloat16", max_shard_size="40KB", layer_types=[FULL, SLIDING] * 2),
    "fp32-tied-headdim-mqa": dict(dtype="float32", tie=True, head_dim=32, kv_heads=1),
    "fp32-yarn": dict(dtype="float32", yarn={"factor": 4.0, "original_max_position_embeddings": 32},
                      max_pos=128),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_export_is_bit_exact_and_loads_in_transformers(tmp_path, case):
    kw = CASES[case]
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "hf2"
    model = make_hf_model(src, **kw)
    if "max_shard_size" in kw:
        assert (src / hfio.INDEX_FILE).is_file()

    hfio.convert_hf_to_olmax(src, ckpt)
    params, cfg = load_params(ckpt)
    assert cfg.padded_vocab_size == 384 and params["embed"].shape == (384, 64)
    assert params["embed"].dtype == np.float32
    # padding rows: transformers' mean-resizing, as OLMo-core's HF loader (exactness:
    # tests/interop/test_vocab_padding.py), kept out of the imported model's softmax
    emb = np.asarray(params["embed"])
    assert np.allclose(emb[300:], emb[:300].mean(axis=0), rtol=0, atol=1e-3 * emb[:300].std())
    assert load_meta(ckpt)["vocab_padding"] == {
        "rows": [300, 384], "in_softmax": False, "init": load_meta(ckpt)["vocab_padding"]["init"]}
    assert load_meta(ckpt)["source"]["hf_dtype"] == kw["dtype"]

    hfio.convert_olmax_to_hf(ckpt, out, max_shard_bytes=30_000)  # dtype: the source's
    _assert_bit_exact(src, out)
    assert (out / hfio.INDEX_FILE).is_file()  # the export was sharded

    original = json.loads((src / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "rope_parameters", "rms_norm_eps",
                "num_key_value_heads", "tie_word_embeddings", "vocab_size", "head_dim"):
        assert exported.get(key) == original.get(key), key

    load = transformers.AutoModelForCausalLM.from_pretrained
    reloaded = load(out, attn_implementation="eager").eval()
    reference = load(src, attn_implementation="eager").eval()
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    assert reloaded.config.layer_types == model.config.layer_types
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 300, (1, 40)))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, reference(tokens).logits)


def test_bf16_storage_round_trip_and_explicit_dtype(tmp_path):
    src = tmp_path / "hf"
    make_hf_model(src, dtype="bfloat16")
    hfio.convert_hf_to_olmax(src, tmp_path / "ckpt", dtype="bfloat16")
    params, _ = load_params(tmp_path / "ckpt")
    assert params["layers"]["q_proj"].dtype == np.dtype("bfloat16")
    hfio.convert_olmax_to_hf(tmp_path / "ckpt", tmp_path / "hf2")
    _assert_bit_exact(src, tmp_path / "hf2")
    # An explicit float32 export widens every value exactly.
    hfio.convert_olmax_to_hf(tmp_path / "ckpt", tmp_path / "hf32", dtype="float32")
    a, b = _tensors(src), _tensors(tmp_path / "hf32")
    assert all(b[k].dtype == torch.float32 and torch.equal(a[k].float(), b[k]) for k in a)


def test_import_and_export_stream_tensor_by_tensor(tmp_path):
    """Peak host allocations: import ~ the params once, export ~ one tensor whatever the shard
    size (numpy allocations are visible to tracemalloc)."""
    src = tmp_path / "hf"
    make_hf_model(src, hidden=256, inter=1024, layers=4, heads=4, kv_heads=4, vocab=1000,
                  dtype="bfloat16")
    tracemalloc.start()
    try:
        params, cfg, _ = hfio.load_hf(src, dtype="float32")
        _, peak_import = tracemalloc.get_traced_memory()
        params_bytes = sum(a.nbytes for a in _leaves(params))
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        (tmp_path / "out").mkdir()
        shard = 2**30  # one file: the whole model
        hfio.write_hf_dir(tmp_path / "out", params, cfg, dtype="bfloat16", max_shard_bytes=shard)
        _, peak_export = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    largest = max(int(np.prod(s)) for s in hfio.hf_tensor_shapes(cfg).values()) * 4
    assert peak_import < params_bytes + 2 * largest
    assert peak_export - base < 3 * largest
    _assert_bit_exact(src, tmp_path / "out")


def _leaves(tree):
    for v in tree.values():
        yield from (_leaves(v) if isinstance(v, dict) else [v])


def test_conversion_streams_both_ways_chunk_by_chunk(tmp_path):
    """``convert_hf_to_olmax`` never holds the model: numpy's peak during the import stays near one
    layer tensor (here a quarter of the model), the checkpoint is stored one layer per chunk, it
    equals what ``load_hf`` reads (the vocabulary padding rows included: both make them as
    OLMo-core's HF loader does), and the export streams too."""
    src = tmp_path / "hf"
    make_hf_model(src, hidden=128, inter=512, layers=6, heads=4, kv_heads=2, vocab=1000,
                  dtype="bfloat16", layer_types=[SLIDING, SLIDING, FULL] * 2)
    ref, cfg, _ = hfio.load_hf(src, dtype="float32")
    model_bytes = sum(a.nbytes for a in _leaves(ref))
    largest = max(int(np.prod(s)) for s in hfio.hf_tensor_shapes(cfg).values()) * 4
    hfio.convert_hf_to_olmax(src, tmp_path / "warm-up")   # module imports are not the model
    hfio.convert_olmax_to_hf(tmp_path / "warm-up", tmp_path / "warm-up-hf")
    tracemalloc.start()
    try:
        hfio.convert_hf_to_olmax(src, tmp_path / "ckpt", dtype="float32")
        _, peak_import = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        hfio.convert_olmax_to_hf(tmp_path / "ckpt", tmp_path / "back")
        _, peak_export = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_import < 4 * largest < model_bytes / 2, (peak_import, largest, model_bytes)
    assert peak_export < 4 * largest, (peak_export, largest)
    got, _ = load_params(tmp_path / "ckpt")
    for key in ("embed", "lm_head", "final_norm"):
        assert np.array_equal(np.asarray(got[key]), ref[key]), key
    for key, value in ref["layers"].items():
        assert np.array_equal(np.asarray(got["layers"][key]), value), key
    assert np.asarray(got["embed"])[1000:].all() and np.asarray(got["lm_head"])[:, 1000:].all()
    meta = json.loads((tmp_path / "ckpt" / "params" / "_METADATA").read_text())
    assert {v["value_metadata"]["value_type"] for v in meta["tree_metadata"].values()} == {"np.ndarray"}
    from olmax.checkpoint.weights import stored_arrays

    stored, _ = stored_arrays(tmp_path / "ckpt")
    chunk = stored["layers"]["gate_proj"]._store.chunk_layout.write_chunk.shape
    assert tuple(chunk) == (1, 128, 512)
    _assert_bit_exact(src, tmp_path / "back")


def test_a_tied_config_with_its_own_lm_head_means_what_transformers_computes(tmp_path):
    """``tie_word_embeddings: true`` and a ``lm_head.weight`` in the files: transformers ties
    them only when they are equal (and then olmax imports the tied model); a different LM head
    it keeps, untied, so olmax, which would tie, refuses the directory naming the setting."""
    from olmax.errors import OlmaxError
    from olmax.interop.safetensors import SINGLE_FILE

    for same in (True, False):
        folder = tmp_path / f"tied-{same}"
        folder.mkdir()
        model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False))
        with torch.no_grad():
            if same:
                model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        model.save_pretrained(folder, safe_serialization=True)
        config = json.loads((folder / "config.json").read_text())
        config["tie_word_embeddings"] = True
        (folder / "config.json").write_text(json.dumps(config))
        assert "lm_head.weight" in load_file(str(folder / SINGLE_FILE))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight) == same
        if same:
            params, got, _ = hfio.load_hf(folder)
            assert got.tie_embeddings and "lm_head" not in params
        else:
            with pytest.raises(OlmaxError, match=r"tie_word_embeddings is true, but the files' "
                                                 r"lm_head.weight differs from "
                                                 r"model.embed_tokens.weight \(from row 0\)"):
                hfio.load_hf(folder)
