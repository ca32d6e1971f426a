"""The CPU benchmark shapes, one table for every script that compares olmax with a peer.

All are OLMo 3 blocks (reordered post-norm, full-width QK-norm, SwiGLU, RoPE 5e5), windows
[W, W, W, full], n_kv_heads = n_heads, head_dim = d_model / n_heads, untied head, fp32 parameters.
MLP widths are what OLMo-core's ``llama_like`` gives (8d/3 rounded up to a multiple of 256).

- ``d768``: OLMo 3 190M widths, 4 layers, dolma2 vocabulary, batch 1 x seq 512, window 128.
- ``A``: d256, 4 layers, 8 heads, MLP 768, dolma2 vocabulary 100352, window 256, batch 8 x 512:
  the LM head and loss dominate (55.4M parameters, 51.4M of them embedding + head).
- ``B``: d512, 8 layers, 8 heads, MLP 1536, vocabulary 8192, window 128, batch 8 x 512: the
  layers dominate (35.7M parameters).
"""

from __future__ import annotations

SHAPES: dict[str, dict] = {
    "d768": dict(d_model=768, n_layers=4, n_heads=12, mlp_hidden=3072, vocab=100352, window=128,
                 batch=1, seq=512, label="d768, 4 layers, 12 heads, MLP 3072, vocab 100352, window 128"),
    "A": dict(d_model=256, n_layers=4, n_heads=8, mlp_hidden=768, vocab=100352, window=256,
              batch=8, seq=512, label="d256, 4 layers, 8 heads, MLP 768, vocab 100352, window 256"),
    "B": dict(d_model=512, n_layers=8, n_heads=8, mlp_hidden=1536, vocab=8192, window=128,
              batch=8, seq=512, label="d512, 8 layers, 8 heads, MLP 1536, vocab 8192, window 128"),
}


def model_overrides(name: str) -> dict:
    """``resolve_model`` overrides (preset ``olmo3-190m`` with the shape's widths)."""
    s = SHAPES[name]
    w = s["window"]
    return {"preset": "olmo3-190m", "d_model": s["d_model"], "n_layers": s["n_layers"],
            "n_heads": s["n_heads"], "n_kv_heads": s["n_heads"], "head_dim": s["d_model"] // s["n_heads"],
            "mlp_hidden": s["mlp_hidden"], "vocab_size": min(100278, s["vocab"]),
            "padded_vocab_size": s["vocab"], "window_pattern": [w, w, w, None]}


def run_config(name: str, dtype: str = "float32", attn: str = "chunked", remat: str = "none",
               batch: int | None = None, seq: int | None = None):
    """The olmax ``RunConfig`` of a shape (default optimizer: SkipStep AdamW as in the recipes)."""
    from olmax.config import RunConfig, TrainConfig
    from olmax.model.presets import resolve_model

    s = SHAPES[name]
    model = resolve_model(model_overrides(name))
    return RunConfig(model=model, train=TrainConfig(
        seq_len=seq or s["seq"], global_batch_size=batch or s["batch"], compute_dtype=dtype,
        attn_impl=attn, remat=remat))
