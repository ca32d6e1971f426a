"""Training from a Hugging Face directory equals OLMo-core's own HF-initialised training, step for step.

The HF directory (transformers ``Olmo3ForCausalLM``, saved as transformers saves it) has an
architecture no olmax preset has: RoPE theta 1e4, RMSNorm eps 1e-5, windows alternating 6 and full,
a 120-token vocabulary padded to 128. olmax trains it with ``olmax train RECIPE`` where the recipe
has *no model section* and ``init.hf_dir`` names the directory: the architecture comes from its
``config.json`` (olmax.interop.architecture) and the padding rows are made as OLMo-core makes them
(olmax.interop.vocab_padding). OLMo-core builds the same transformer, loads the directory with its
own ``load_hf_model`` (transformers' mean-resizing of the embedding and head) and takes the same
steps on the batches olmax's loader served, with the optimizer, schedule and micro-batching of
tests/train/test_oc_parity.py. Losses agree within 1e-5 relative at every step.
"""

from __future__ import annotations

import json

import numpy as np
import yaml

from helpers import olmo_core as ref
from olmax.cli import main
from olmax.config import from_dict, ModelConfig
from helpers.reference import require

torch = require("torch")
require("olmo_core")

VOCAB, PADDED = 120, 128
THETA, EPS, WINDOW = 10_000.0, 1e-5, 6


def _recipe(tmp_path, hf_dir, tokens):
    recipe = {
        "seed": 7,
        "init": {"hf_dir": str(hf_dir)},
        "data": {"paths": [str(tokens)]},
        "train": {"seq_len": ref.T, "global_batch_size": ref.B, "micro_batch_size": ref.MICRO,
                  "max_steps": ref.STEPS, "compute_dtype": "float32", "z_loss_multiplier": 1e-5},
        "optim": {"name": "skip_step_adamw", "lr": ref.PEAK_LR, "betas": list(ref.OPT.betas),
                  "eps": ref.OPT.eps, "weight_decay": ref.OPT.weight_decay, "no_decay": ["embed"],
                  "max_grad_norm": ref.OPT.max_grad_norm,
                  "rolling_interval_length": ref.OPT.rolling_interval_length,
                  "sigma_factor": ref.OPT.sigma_factor},
        "scheduler": {"name": "cos_with_warmup", "warmup_steps": ref.WARMUP, "alpha_f": 0.1,
                      "t_max": ref.SCHED.t_max},
        "checkpoint": {"interval": 1000},
        "logging": {"tensorboard": False, "progress": False},
    }
    path = tmp_path / "from_hf.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _olmo_core_from_hf(hf_dir):
    from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
    from olmo_core.nn.hf.checkpoint import load_hf_model
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    oc_cfg = TransformerConfig.llama_like(
        d_model=32, vocab_size=PADDED, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=True,
        block_name=TransformerBlockType.reordered_norm, layer_norm_eps=EPS, rope_theta=int(THETA),
        hidden_size_multiple_of=16, attn_backend=AttentionBackendName.torch,
        sliding_window=SlidingWindowAttentionConfig(
            pattern=[WINDOW, -1], force_full_attention_on_first_layer=False,
            force_full_attention_on_last_layer=True))
    model = oc_cfg.build(init_device="cpu")
    state = model.state_dict()
    torch.manual_seed(1234)        # transformers' mean-resizing draws from torch's global RNG
    load_hf_model(str(hf_dir), state, num_embeddings=PADDED)
    model.load_state_dict(state)
    return model


def test_training_from_hf_dir_matches_olmo_core_hf_init(tmp_path):
    from helpers.hf_models import make_hf_model
    from olmax.data.loader import build_train_data
    from olmax.train.recipes import load_recipe

    hf_dir = tmp_path / "hf"
    make_hf_model(hf_dir, vocab=VOCAB, hidden=32, inter=96, layers=4, heads=4, kv_heads=2,
                  window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                  rope_theta=THETA, eps=EPS, max_pos=64, std=0.05, seed=3)
    rng = np.random.default_rng(11)
    tokens = tmp_path / "tokens.npy"
    np.minimum(rng.geometric(0.12, 8192) - 1, VOCAB - 1).astype("<u4").tofile(tokens)
    recipe = _recipe(tmp_path, hf_dir, tokens)

    cfg = load_recipe(str(recipe))
    assert (cfg.model.rope_theta, cfg.model.norm_eps, cfg.model.layer_windows()) == (
        THETA, EPS, (WINDOW, None, WINDOW, None))
    assert (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (VOCAB, PADDED)

    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run), "--quiet"]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert from_dict(ModelConfig, saved) == cfg.model
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, ref.STEPS + 1))

    data = build_train_data(cfg.data, seq_len=ref.T, global_batch_size=ref.B, seed=cfg.seed)
    it = data.iterate(0, 0, 1)
    batches = []
    for _ in range(ref.STEPS):
        _, host = next(it)
        batches.append((np.asarray(host["tokens"], np.int32), np.asarray(host["instance_mask"], bool)))
    oc_loss, oc_skipped, oc_norm, _ = ref.run_olmo_core(None, batches, model=_olmo_core_from_hf(hf_dir))

    ours = np.array([r["loss"] for r in rows])
    rel = np.abs(ours - np.array(oc_loss)) / np.abs(np.array(oc_loss))
    print(f"max relative loss difference over {ref.STEPS} steps: {rel.max():.2e}; "
          f"loss {ours[0]:.4f} -> {ours[-1]:.4f}")
    assert rel.max() <= 1e-5, list(zip(ours, oc_loss))
    np.testing.assert_allclose([r["grad_norm"] for r in rows], oc_norm, rtol=1e-4)
    assert [float(r["skipped"]) for r in rows] == oc_skipped
    assert ours[-1] < 0.8 * ours[0]                      # it really trained
