"""YaRN at long sequences (OLMo 3 stage 3: factor 8, beta_fast 32, beta_slow 1, original context
8192, on the full-attention layers only) against HF transformers ``Olmo3ForCausalLM``, fp32.

- At 16384 tokens (twice the original context) with OLMo 3's own YaRN parameters, on the ``cpu``
  profile: HF's eager attention holds [heads, T, T] fp32 scores, about 7 GiB at 16k for this
  two-head model, so 32k and 65k do not fit this machine that way.
- At 65536 tokens (the whole stage-3 context) with OLMo 3's YaRN, on full-attention layers (the
  ones YaRN scales) against HF's SDPA attention, which holds no [T, T] scores.
- At the whole extended context of a scaled-down YaRN (original 1024, factor 8: 8192 tokens, as
  65536 is to 8192), on every profile. The ramp between the interpolated and the extrapolated
  frequencies covers dimensions 1..7 of 16 there (4..9 of 16 at original 8192): both regimes and
  the blend are exercised.

Each: KL_max <= 1e-9 and 100 % top-1 agreement. YaRN's attention factor (0.1 ln 8 + 1, applied to
sin and cos as OLMo-core and HF do) is covered: without it the logits are far off.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.interop.hf import load_hf
from olmax.interop.hf_config import model_config_from_hf
from olmax.interop.parity import position_metrics, run_parity
from olmax.model import forward
from olmax.model.rope import inv_frequencies
from helpers.reference import require

torch = require("torch")
transformers = require("transformers")

from helpers.hf_models import FULL, SLIDING, make_hf_model  # noqa: E402

THETA = 500_000.0


def _yarn(original: int) -> dict:
    return {"factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": original}


def _model(path, original: int, window: int):
    return make_hf_model(path, vocab=256, hidden=64, inter=128, layers=2, heads=2, kv_heads=1,
                         head_dim=32, window=window, layer_types=[SLIDING, FULL], rope_theta=THETA,
                         yarn=_yarn(original), max_pos=8 * original)


def _check(r, seq_len, window, profile):
    print(f"\nYaRN {profile} at {seq_len}: kl_max {r['kl_max']:.3e} top1 {r['top1_agreement']:.4f} "
          f"max|dlogit| {r['max_abs_logit_diff']:.3e} (HF {r['seconds_hf']} s, olmax {r['seconds_olmax']} s)")
    assert r["profile"] == profile and r["seq_len"] == seq_len
    assert r["num_positions_beyond_window"] == seq_len - window
    assert r["kl_max"] <= 1e-9
    assert r["top1_agreement"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["cpu", "tpu", "gpu"])
def test_yarn_parity_over_the_extended_context(tmp_path, profile):
    _model(tmp_path / "hf", original=1024, window=512)
    r = run_parity(tmp_path / "hf", seq_len=8192, dtype="float32", seed=0, profile=profile)
    _check(r, 8192, 512, profile)


@pytest.mark.slow
def test_yarn_parity_at_16k_with_olmo3_parameters(tmp_path):
    _model(tmp_path / "hf", original=8192, window=4096)
    r = run_parity(tmp_path / "hf", seq_len=16384, dtype="float32", seed=0, profile="cpu")
    _check(r, 16384, 4096, "cpu")


@pytest.mark.slow
def test_yarn_parity_at_65k_on_full_attention_layers(tmp_path):
    """The whole stage-3 context, 65,536 tokens, with OLMo 3's YaRN (original 8192, factor 8) on
    one full-attention layer -- the kind YaRN scales -- of one head, against HF's SDPA attention
    (causal, no [T, T] mask or scores held: eager would need 16 GiB), olmax on its ``cpu``
    profile (block-sparse chunked attention). Every query position of the context attends with
    YaRN's rotations; a second layer or head would only repeat them (the 16k and 8k tests above
    have two layers, sliding and full, and grouped heads). In this process: a second process
    beside the test worker's own memory did not fit CI's machine."""
    make_hf_model(tmp_path / "hf", vocab=256, hidden=32, inter=64, layers=1, heads=1, kv_heads=1,
                  head_dim=16, layer_types=[FULL], rope_theta=THETA, yarn=_yarn(8192),
                  max_pos=65536)
    r = run_parity(tmp_path / "hf", seq_len=65536, dtype="float32", seed=0, profile="cpu",
                   hf_attn="sdpa")
    print(f"\nYaRN cpu at 65536 (full attention): kl_max {r['kl_max']:.3e} top1 "
          f"{r['top1_agreement']:.4f} max|dlogit| {r['max_abs_logit_diff']:.3e} "
          f"(HF {r['seconds_hf']} s, olmax {r['seconds_olmax']} s)")
    assert r["seq_len"] == 65536
    assert r["hf_attn_implementation"] == "sdpa"
    assert r["kl_max"] <= 1e-9
    assert r["top1_agreement"] == 1.0


def test_yarn_ramp_is_exercised():
    """Both frequency regimes and the blend occur for head_dim 32 (as for the 7B's 128)."""
    base = inv_frequencies(32, THETA)
    for original in (1024, 8192):
        cfg = model_config_from_hf({**_hf_config(original), "head_dim": 32}, where="test")
        ratio = inv_frequencies(32, THETA, cfg.rope_scaling) / base
        assert ratio[0] == 1.0 and ratio[-1] == np.float32(1 / 8)
        assert ((ratio < 1) & (ratio > 1 / 8)).sum() >= 3


def _hf_config(original: int) -> dict:
    """A v4.57-style config.json, as OLMo 3's long-context release writes YaRN: ``rope_scaling``
    next to a top-level ``rope_theta``."""
    return {"model_type": "olmo3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
            "sliding_window": 4096, "max_position_embeddings": 8 * original, "rms_norm_eps": 1e-6,
            "layer_types": [SLIDING] * 3 + [FULL], "rope_theta": THETA,
            "rope_scaling": {"rope_type": "yarn", **_yarn(original)}, "tie_word_embeddings": False}


def test_yarn_only_on_full_attention_layers_as_olmo_core_and_hf():
    """OLMo-core's stage-3 script (``with_rope_scaling``, full_attn_layers_only by default) scales
    exactly the 7B's full-attention layers; transformers reads a ``rope_scaling`` config as YaRN on
    full-attention layers and default RoPE on sliding ones; olmax reads it the same way."""
    require("olmo_core")
    from olmo_core.nn.rope import YaRNRoPEScalingConfig
    from olmo_core.nn.transformer import TransformerConfig

    oc = TransformerConfig.olmo3_7B(vocab_size=100_352).with_rope_scaling(
        YaRNRoPEScalingConfig(factor=8, beta_fast=32, beta_slow=1, old_context_len=8192))
    swa = oc.block.sequence_mixer.sliding_window
    full = [i for i in range(oc.n_layers) if not swa.should_use_swa(i, oc.n_layers)]
    assert sorted(oc.block_overrides) == full == list(range(3, 32, 4))
    assert oc.block.sequence_mixer.rope.scaling is None
    assert all(b.sequence_mixer.rope.scaling.factor == 8 for b in oc.block_overrides.values())

    hf = transformers.Olmo3Config(**{k: v for k, v in _hf_config(8192).items() if k != "model_type"})
    assert hf.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert hf.rope_parameters["sliding_attention"]["rope_type"] == "default"

    cfg = model_config_from_hf(_hf_config(8192), where="test")
    assert cfg.rope_scaling.full_attention_only and cfg.rope_scaling.factor == 8.0
    assert cfg.window_pattern == (4096, 4096, 4096, None)


def test_attention_factor_is_part_of_parity(tmp_path):
    """Negative control at 128 tokens with OLMo 3's YaRN: olmax equals HF, and the same model
    without YaRN's attention factor (1.0 instead of 0.1 ln 8 + 1) does not."""
    _model(tmp_path / "hf", original=8192, window=32)
    params, cfg, _ = load_hf(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 128))
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens)).logits[0].numpy()
    p = jax.tree.map(jnp.asarray, params)
    no_factor = cfg.replace(rope_scaling=dataclasses.replace(cfg.rope_scaling, attention_factor=1.0))
    with jax.default_matmul_precision("highest"):
        good, bad = (np.asarray(forward(p, jnp.asarray(tokens), c))[0, :, :cfg.vocab_size]
                     for c in (cfg, no_factor))
    assert position_metrics(ref, good)[0].max() <= 1e-9
    assert position_metrics(ref, bad)[0][1:].min() > 1e-6   # position 0 attends to itself alone
