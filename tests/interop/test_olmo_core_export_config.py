"""``config.json`` of an export is the one OLMo-core writes: its model section is ai2-olmo-core
3.0.0's ``TransformerConfig.as_config_dict()`` key for key (YaRN on the full-attention layers as
its ``with_rope_scaling`` writes it), its ``TransformerConfig.from_dict`` builds from it the model
whose parameters the export holds, and olmax reads OLMo-core's own configs back to the same
model (YaRN on the full-attention layers only, or, in the block itself, on every layer)."""

from __future__ import annotations

import json

import pytest

from helpers import olmo_core as ref
from helpers.reference import require
from olmax.config import YarnConfig
from olmax.interop.olmo_core.model_config import model_config_from_olmo_core
from olmax.interop.olmo_core.convert import transformer_config_dict
from olmax.model.params import olmo_core_tensors

require("olmo_core")

YARN = YarnConfig(factor=8.0, original_max_position_embeddings=64)
MODELS = {"windows": ref.CFG, "yarn": ref.CFG.replace(rope_scaling=YARN),
          "full attention": ref.CFG.replace(window_pattern=(None,))}


def _without_backend(d):
    """OLMo-core's dict without the attention backend (the reference runs torch's; the export
    leaves OLMo-core its default)."""
    if isinstance(d, dict):
        return {k: _without_backend(v) for k, v in d.items() if k != "backend"}
    return d


@pytest.mark.parametrize("name", MODELS)
def test_model_section_is_olmo_cores_and_builds_the_model(name):
    from olmo_core.nn.transformer import TransformerConfig

    cfg = MODELS[name]
    ours = transformer_config_dict(cfg)
    theirs = json.loads(json.dumps(ref.oc_config(cfg).as_config_dict()))   # as config.json holds it
    assert json.loads(json.dumps(ours)) == _without_backend(theirs)
    model = TransformerConfig.from_dict(ours).build(init_device="meta")
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == \
        {t.name: tuple(t.shape) for t in olmo_core_tensors(cfg)}


@pytest.mark.parametrize("full_layers_only", [True, False])
def test_olmo_cores_yarn_reads_back(full_layers_only):
    """OLMo-core's ``with_rope_scaling``: on the full-attention layers (``block_overrides``) or, in
    the block, on all of them; olmax reads each as the YaRN it is."""
    from olmo_core.nn.rope import YaRNRoPEScalingConfig

    oc = ref.oc_config(ref.CFG).with_rope_scaling(
        YaRNRoPEScalingConfig(factor=8, beta_fast=32, beta_slow=1, old_context_len=64),
        full_attn_layers_only=full_layers_only)
    config = {"model": json.loads(json.dumps(oc.as_config_dict())),
              "dataset": {"tokenizer": {"vocab_size": ref.CFG.vocab_size}}}
    got = model_config_from_olmo_core(config, "config.json")
    assert got.rope_scaling == YarnConfig(factor=8.0, original_max_position_embeddings=64,
                                          full_attention_only=full_layers_only)
