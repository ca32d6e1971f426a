"""A tiny OLMo 3 shape for evaluation tests (GQA, a window shorter than the text)."""

from olmax.config import ModelConfig


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=64,
                vocab_size=100, padded_vocab_size=128, window_pattern=(8, None), max_seq_len=256)
    base.update(kw)
    return ModelConfig(**base)
