"""An OLMo-core ``config.json`` is read field by field (:mod:`olmax.interop.olmo_core.model_config`).

Every field olmax maps is proven against ai2-olmo-core computing it: a tiny ``TransformerConfig``
built by OLMo-core's own API (its defaults included: forced full layers, the norm epsilon it
fills in, YaRN on the full-attention layers by ``with_rope_scaling``, named blocks), its
``config.json`` as OLMo-core writes it (``as_config_dict``), OLMo-core's model of it with random
weights, and olmax's model of the imported config with those weights: the same logits. Every
field olmax cannot compute is refused naming it and its value (one case each), and olmax's own
export is read by OLMo-core's ``TransformerConfig.from_dict`` as the model it came from.
"""

from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.olmo_core import oc_state_dict, olmax_tree
from helpers.reference import require
from helpers.tiny import small_cfg
from olmax.config import YarnConfig
from olmax.errors import OlmaxError
from olmax.interop.olmo_core.convert import olmo_core_config
from olmax.interop.olmo_core.model_config import model_config_from_olmo_core
from olmax.model.olmo3 import forward
from olmax.model.params import init_params

require("torch")
require("olmo_core.nn.transformer")

VOCAB = 120
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 40))    # longer than the windows


def _llama_like(**kw):
    from olmo_core.nn.attention import AttentionBackendName
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    args = dict(d_model=32, vocab_size=128, n_layers=4, n_heads=4, n_kv_heads=2, qk_norm=True,
                block_name=TransformerBlockType.reordered_norm, layer_norm_eps=1e-6,
                rope_theta=500_000, hidden_size_multiple_of=16,
                attn_backend=AttentionBackendName.torch)
    return TransformerConfig.llama_like(**{**args, **kw})


def _window(pattern, first=False, last=False):
    from olmo_core.nn.attention import SlidingWindowAttentionConfig

    return SlidingWindowAttentionConfig(pattern=pattern, force_full_attention_on_first_layer=first,
                                        force_full_attention_on_last_layer=last)


def _yarn():
    from olmo_core.nn.rope import YaRNRoPEScalingConfig

    return YaRNRoPEScalingConfig(factor=4, old_context_len=16)


def _config_json(oc_cfg) -> dict:
    """``config.json`` as OLMo-core's trainer writes it: the experiment's ``as_config_dict``."""
    return json.loads(json.dumps({"model": oc_cfg.as_config_dict(),
                                  "dataset": {"tokenizer": {"vocab_size": VOCAB}}}))


def _variants():
    from olmo_core.nn.transformer import TransformerBlockType

    def head_wise():
        c = _llama_like(head_dim=16)
        c.block.sequence_mixer.use_head_qk_norm = True
        return c

    def tied():
        c = _llama_like()
        c.tie_word_embeddings = True
        return c

    def named():
        c = _llama_like(sliding_window=_window([8, -1]))
        c.block = {"swa": c.block, "full": c.block.copy()}
        c.block_pattern = ["swa", "full"]
        return c

    return {
        # OLMo-core's default window flags: layer 0 and the last forced full, the pattern shifted
        "windows-forced-ends": (lambda: _llama_like(sliding_window=_window([8, 8, 8, -1], True, True)),
                                dict(window_pattern=(None, 8, 8, None))),
        # the pre-norm block, no QK norm, MHA, the norm epsilon OLMo-core fills in (1e-5)
        "prenorm-defaults": (lambda: _llama_like(block_name=TransformerBlockType.default, qk_norm=False,
                                                 layer_norm_eps=None, rope_theta=10_000, n_kv_heads=None),
                             dict(block_type="prenorm", qk_norm="none", norm_eps=1e-5, n_kv_heads=4)),
        "yarn-on-full-layers": (lambda: _llama_like(sliding_window=_window([8, -1])).with_rope_scaling(_yarn()),
                                dict(rope_scaling=YarnConfig(factor=4.0, original_max_position_embeddings=16))),
        "yarn-on-every-layer": (lambda: _llama_like(sliding_window=_window([8, -1])).with_rope_scaling(
                                    _yarn(), full_attn_layers_only=False),
                                dict(rope_scaling=YarnConfig(factor=4.0, original_max_position_embeddings=16,
                                                             full_attention_only=False))),
        "head-wise-qk-norm": (head_wise, dict(qk_norm="head", head_dim=16)),
        "tied-embeddings": (tied, dict(tie_embeddings=True)),
        "named-blocks": (named, dict(window_pattern=(8, None))),
    }


def _logits_equal(oc_model, cfg, params) -> None:
    import torch

    with torch.no_grad():
        ref = oc_model(torch.tensor(TOKENS)).float().numpy()
    got = np.asarray(forward(jax.tree.map(jnp.asarray, params), jnp.asarray(TOKENS), cfg))
    # fp32 both, 4 layers of 32: the sums' orders differ, so the last bits do (measured ≤ 2.2e-6
    # on logits of about 1.2); a wrong window, norm, block or RoPE moves them by 1e-2 or more
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("name", list(_variants()))
def test_mapped_fields_compute_what_olmo_core_computes(name):
    import torch

    build, expected = _variants()[name]
    oc_cfg = build()
    cfg = model_config_from_olmo_core(_config_json(oc_cfg), "config.json")
    for field, value in expected.items():
        assert getattr(cfg, field) == value, (field, getattr(cfg, field))
    torch.manual_seed(0)
    model = oc_cfg.build(init_device="cpu")
    with torch.no_grad():                 # every weight away from its init (norms not all ones)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    params = olmax_tree({k: v.numpy() for k, v in model.state_dict().items()}, cfg)
    _logits_equal(model.eval(), cfg, params)


@pytest.mark.parametrize("cfg", [
    small_cfg(vocab_size=VOCAB, padded_vocab_size=128, window_pattern=(8, None), block_type="prenorm",
              qk_norm="head", rope_scaling=YarnConfig(factor=4.0, original_max_position_embeddings=16)),
    small_cfg(vocab_size=VOCAB, padded_vocab_size=128, window_pattern=(None, 8, 8, 8), qk_norm="none",
              tie_embeddings=True, rope_theta=10_000.0, norm_eps=1e-5,
              rope_scaling=YarnConfig(factor=2.0, original_max_position_embeddings=16,
                                      full_attention_only=False)),
], ids=["prenorm-headqk-yarn-full", "tied-yarn-all"])
def test_the_export_is_read_by_olmo_core_as_the_model_it_came_from(cfg):
    """olmax's ``config.json`` (no imported one to copy) built by OLMo-core's ``from_dict``:
    with olmax's weights, OLMo-core's model computes olmax's logits; and it reads back as cfg."""
    import torch
    from olmo_core.nn.transformer import TransformerConfig

    config = olmo_core_config(cfg, None)
    assert model_config_from_olmo_core(config, "config.json") == cfg
    oc_cfg = TransformerConfig.from_dict(copy.deepcopy(config["model"]))
    from olmo_core.nn.attention import AttentionBackendName

    for block in [oc_cfg.block, *(oc_cfg.block_overrides or {}).values()]:
        block.sequence_mixer.backend = AttentionBackendName.torch    # the CPU's kernel
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(3)))
    params = jax.tree.map(lambda p: p + 0.05 * np.random.default_rng(p.size).standard_normal(
        p.shape).astype(np.float32), params)
    model = oc_cfg.build(init_device="cpu")
    state = oc_state_dict(params, cfg)
    if cfg.tie_embeddings:      # OLMo-core's tied head is the embedding under its own name too
        state["lm_head.w_out.weight"] = state["embeddings.weight"]
    model.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    _logits_equal(model.eval(), cfg, params)


# ----------------------------------------------------------------------------------------------
# Refused: (field below "model", value, what the line says)

A = "block.sequence_mixer."
REFUSED = [
    ("block.feed_forward.activation", "gelu_tanh", r"feed_forward.activation is 'gelu_tanh': olmax's MLP is SwiGLU"),
    ("block.feed_forward.activation", "gelu", r"activation is 'gelu'"),
    ("block.feed_forward.name", "normalized", r"feed_forward.name is 'normalized'"),
    ("block.feed_forward.bias", None, r"feed_forward.bias is None \(OLMo-core's default: biases\)"),
    ("block.layer_norm.name", "default", r"layer_norm.name is 'default': olmax's norms are RMSNorm \(OLMo-core's default is LayerNorm\)"),
    ("block.layer_norm.name", "l2_norm", r"layer_norm.name is 'l2_norm'"),
    ("block.layer_norm.bias", True, r"layer_norm.bias is True"),
    ("block.layer_norm.bias", None, r"layer_norm.bias is None \(OLMo-core's default: biases\)"),
    ("block.layer_norm.elementwise_affine", False, r"elementwise_affine is False"),
    ("block.layer_norm.full_precision", False, r"full_precision is false"),
    ("block.layer_norm", None, r"model.block.layer_norm is null"),
    ("block.name", "peri_norm", r"block.name is 'peri_norm'"),
    ("block.name", "moe_reordered_norm", r"block.name is 'moe_reordered_norm'"),
    ("block.feed_forward_moe", {"num_experts": 8, "hidden_size": 64}, r"feed_forward_moe is .*: olmax has no mixture of experts"),
    ("block.dropout", 0.1, r"block.dropout is 0.1: olmax has no dropout"),
    ("block.attention_residual_alpha", 0.5, r"attention_residual_alpha is 0.5"),
    (A + "bias", None, r"sequence_mixer.bias is None \(OLMo-core's default: biases\)"),
    (A + "bias", True, r"sequence_mixer.bias is True"),
    (A + "name", "fused_v2", r"sequence_mixer.name is 'fused_v2'"),
    (A + "name", "normalized", r"sequence_mixer.name is 'normalized'"),
    (A + "type", "gated_delta_net", r"sequence_mixer.type is 'gated_delta_net'"),
    (A + "gate", {"granularity": "headwise"}, r"sequence_mixer.gate is .*no output gate"),
    (A + "clip_qkv", 8.0, r"clip_qkv is 8.0"),
    (A + "dropout", 0.1, r"sequence_mixer.dropout is 0.1"),
    (A + "scalable_softmax", True, r"scalable_softmax is True"),
    (A + "attention_sinks", True, r"attention_sinks is True"),
    (A + "qk_norm_per_head_gains", True, r"qk_norm_per_head_gains is True"),
    (A + "mxfp8_save_qkv_for_backward", True, r"mxfp8_save_qkv_for_backward is True"),
    (A + "qk_norm.name", "default", r"qk_norm.name is 'default'"),
    (A + "qk_norm.eps", 1e-5, r"qk_norm.eps is 1e-05, model.block.layer_norm.eps 1e-06: olmax has one norm epsilon"),
    (A + "rope", None, r"sequence_mixer.rope is null: olmax applies RoPE"),
    (A + "rope.name", "complex", r"rope.name is 'complex'"),
    (A + "rope.name", "fused", r"rope.name is 'fused'"),
    (A + "rope.no_global_rope", True, r"no_global_rope is true"),
    (A + "rope.partial_rotary_factor", 0.5, r"partial_rotary_factor is 0.5"),
    (A + "rope.full_precision", False, r"rope.full_precision is false"),
    (A + "rope.scaling", {"new_theta": 8000000, "_CLASS_": "olmo_core.nn.rope.ABFRoPEScalingConfig"},
     r"rope.scaling is olmo_core.nn.rope.ABFRoPEScalingConfig: olmax's RoPE scaling is YaRN"),
    (A + "rope.scaling", {"factor": 2.0, "_CLASS_": "olmo_core.nn.rope.PIRoPEScalingConfig"},
     r"PIRoPEScalingConfig"),
    (A + "rope.scaling", {"factor": 32.0, "low_freq_proportion": 0.0, "high_freq_proportion": 0.25,
                          "old_context_len": 8192}, r"a scaling with high_freq_proportion"),
    (A + "sliding_window", {"pattern": [8, 0]}, r"sliding_window.pattern\[1\] is 0: a window is positive"),
    ("lm_head.layer_norm", None, r"lm_head.layer_norm is null"),
    ("lm_head.bias", None, r"lm_head.bias is None"),
    ("lm_head.name", "normalized", r"lm_head.name is 'normalized'"),
    ("lm_head.layer_norm.eps", 1e-5, r"lm_head.layer_norm.eps is 1e-05"),
    ("name", "moe", r"model.name is 'moe'"),
    ("name", "normalized", r"model.name is 'normalized'"),
    ("embedding_norm", {"name": "rms"}, r"embedding_norm is .*no norm after the embedding"),
    ("embed_scale", 2.0, r"embed_scale is 2.0"),
    ("freeze_params", ["embeddings.*"], r"freeze_params"),
    ("tie_word_embeddings", "yes", r"tie_word_embeddings must be true or false"),
    ("block.rotary", 3, r"block.rotary is 3: OLMo-core 3.0's TransformerBlockConfig has no field"),
    ("block._CLASS_", "olmo_core.nn.transformer.config.MoEBlockConfig", r"is olmo_core.*MoEBlockConfig, not OLMo-core's TransformerBlockConfig"),
    ("block_overrides", {"2": "same"}, r"block_overrides.2 is 'same', not an object"),
    ("block_overrides", {"7": {}}, r"block_overrides has layer '7', not one of 0..3"),
]


def _set(config: dict, dotted: str, value):
    node = config["model"]
    keys = dotted.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value


@pytest.fixture(scope="module")
def olmo3_like():
    """``config.json`` of an OLMo 3-like tiny model, as OLMo-core writes it."""
    return _config_json(_llama_like(sliding_window=_window([8, -1])))


@pytest.mark.parametrize("field,value,message", REFUSED, ids=[f"{f}={v!r}"[:60] for f, v, _ in REFUSED])
def test_fields_olmax_cannot_compute_are_refused_by_name(olmo3_like, field, value, message):
    config = copy.deepcopy(olmo3_like)
    model_config_from_olmo_core(config, "config.json")           # the base imports
    _set(config, field, value)
    with pytest.raises(OlmaxError, match=message) as e:
        model_config_from_olmo_core(config, "config.json")
    assert str(e.value).startswith("config.json: ") and "\n" not in str(e.value)


def test_layers_must_be_one_block_but_for_windows_and_yarn(olmo3_like):
    config = copy.deepcopy(olmo3_like)
    other = copy.deepcopy(config["model"]["block"])
    other["sequence_mixer"]["n_heads"] = 2
    config["model"]["block_overrides"] = {"2": other}
    with pytest.raises(OlmaxError, match=r"model.block_overrides.2 gives n_heads 2, model.block 4: "
                                         r"olmax's layers are one block repeated"):
        model_config_from_olmo_core(config, "config.json")
    sliding = copy.deepcopy(config["model"]["block"])
    sliding["sequence_mixer"]["rope"]["scaling"] = {
        "factor": 4, "old_context_len": 16, "_CLASS_": "olmo_core.nn.rope.YaRNRoPEScalingConfig"}
    config["model"]["block_overrides"] = {"0": sliding}       # layer 0 has a window of 8
    with pytest.raises(OlmaxError, match=r"RoPE scaling on layers \[0\], full attention on layers "
                                         r"\[1, 3\]"):
        model_config_from_olmo_core(config, "config.json")


def test_kernels_of_rmsnorm_and_inert_fields_import_as_the_same_model(olmo3_like):
    """``fused_rms``/``cute_rms`` are RMSNorm computed by other kernels; dtypes, attention and
    loss kernels, initialisation and recompute change nothing olmax computes; a field OLMo-core
    3.0 lacks passes only when it is off (null or false)."""
    want = model_config_from_olmo_core(olmo3_like, "config.json")
    for field, value in [("block.layer_norm.name", "fused_rms"), ("lm_head.layer_norm.name", "cute_rms"),
                         (A + "backend", "flash_3"), (A + "dtype", "bfloat16"), ("dtype", "bfloat16"),
                         ("lm_head.loss_implementation", "fused_linear"), ("init_method", "llama"),
                         ("init_seed", 7), (A + "use_recompute_qkv_prep", True),
                         ("block.some_future_flag", False), ("block.other_future_field", None)]:
        config = copy.deepcopy(olmo3_like)
        _set(config, field, value)
        assert model_config_from_olmo_core(config, "config.json") == want, field
