"""Random tiny Hugging Face ``Olmo3ForCausalLM`` directories for the interop tests (torch needed).

Weights use a larger init std than OLMo's 0.02 and random norm weights, so logits are spread out
(a near-uniform softmax would hide errors) and a mix-up of any two norms shows.
"""

from __future__ import annotations

from pathlib import Path

FULL, SLIDING = "full_attention", "sliding_attention"


def make_hf_model(out_dir: Path, *, vocab: int = 300, hidden: int = 64, inter: int = 128,
                  layers: int = 4, heads: int = 4, kv_heads: int = 2, window: int = 8,
                  layer_types: list[str] | None = None, head_dim: int | None = None,
                  rope_theta: float = 10_000.0, yarn: dict | None = None, tie: bool = False,
                  dtype: str = "float32", seed: int = 0, max_shard_size: str | None = None,
                  max_pos: int = 256, std: float = 0.15, eps: float = 1e-6):
    """Build, randomise and ``save_pretrained`` a model; return it (eval mode, in ``dtype``)."""
    import torch
    from transformers import Olmo3Config, Olmo3ForCausalLM

    torch.manual_seed(seed)
    full = {"rope_type": "default", "rope_theta": rope_theta}
    if yarn:
        full = {"rope_type": "yarn", "rope_theta": rope_theta, **yarn}
    extra = {"head_dim": head_dim} if head_dim else {}
    cfg = Olmo3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, sliding_window=window,
        layer_types=layer_types, max_position_embeddings=max_pos, rms_norm_eps=eps,
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default", "rope_theta": rope_theta}},
        tie_word_embeddings=tie, initializer_range=std, pad_token_id=None, eos_token_id=None,
        bos_token_id=None, **extra)
    model = Olmo3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model = model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model
