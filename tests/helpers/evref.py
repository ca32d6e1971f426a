"""Reference helpers: AI2's own EV code (``olmo_eval`` from the ai2-olmo-eval 0.9.0 wheel, imported
from the zip, never installed) and a tiny random HF ``Olmo3ForCausalLM``.

EV imports ``torchmetrics`` and ``datasets`` at module level; when they are absent, minimal stand-ins
are registered: ``torchmetrics.Metric`` keeps list states (all ``ICLMetric`` uses, no syncing), and
``datasets`` is never touched by the ``OEEvalTask`` path.
"""

from __future__ import annotations

import importlib
import sys
import types

from helpers.reference import require, unavailable


def olmes_wheel():
    from olmax.errors import OlmaxError
    from olmax.eval.olmes_data import wheel_path

    try:
        return wheel_path()
    except OlmaxError as e:  # offline without a cached wheel
        unavailable(f"ai2-olmo-eval wheel unavailable: {e}")


def ev_modules():
    """(olmo_eval.tasks, olmo_eval.metrics) imported from the verified wheel."""
    require("torch")
    wheel = str(olmes_wheel())
    if "torchmetrics" not in sys.modules:
        try:
            importlib.import_module("torchmetrics")
        except ImportError:
            tm = types.ModuleType("torchmetrics")

            class Metric:
                def __init__(self, **kwargs):
                    pass

                def add_state(self, name, default, dist_reduce_fx=None):
                    setattr(self, name, list(default))

                def to(self, device):
                    return self

            tm.Metric = Metric
            sys.modules["torchmetrics"] = tm
    if "datasets" not in sys.modules:
        try:
            importlib.import_module("datasets")
        except ImportError:
            sys.modules["datasets"] = types.ModuleType("datasets")
    if wheel not in sys.path:
        sys.path.append(wheel)
    return importlib.import_module("olmo_eval.tasks"), importlib.import_module("olmo_eval.metrics")


class EVTokenizer:
    """EV's tokenizer interface over any olmax-style tokenizer."""

    def __init__(self, tok, pad_token_id=0, bos_token_id=None):
        self.tok, self.pad_token_id, self.bos_token_id = tok, pad_token_id, bos_token_id

    def encode(self, text, add_special_tokens=True):
        return list(self.tok.encode(text))


def tiny_hf_model(tmp_path, vocab_size=100, seed=0):
    """A random tiny HF Olmo3 (GQA, window 6 < sequence) saved to tmp_path; returns (model, dir)."""
    torch = require("torch")
    transformers = require("transformers")
    cfg = transformers.Olmo3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=6,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], pad_token_id=0, eos_token_id=1,
        rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = transformers.Olmo3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model, tmp_path


def ev_metric(ev_tasks, ev_metrics, task_kwargs, requests, tokenizer, model, model_ctx_len):
    """Run EV's OEEvalTask.prep_examples + collate_fn + ICLMetric on ``requests`` with an HF model."""
    import torch

    task = ev_tasks.OEEvalTask.__new__(ev_tasks.OEEvalTask)
    task.tokenizer, task.model_ctx_len, task.fixed_ctx_len = tokenizer, model_ctx_len, False
    task.fast_mc = task_kwargs.get("fast_mc", False)
    task.metric_type = task_kwargs["metric_type"]
    task.log_instances, task.dataset_path, task.dataset_name = 0, "x", None
    task.dataset = [requests]
    task.prep_examples()
    task._max_sequence_length = None
    metric = ev_metrics.ICLMetric(metric_type=task.metric_type)
    metric.reset()
    samples = task.samples
    for i in range(0, len(samples), 4):
        batch = task.collate_fn(samples[i:i + 4])
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits.float()
        metric.update(batch, logits)
    return metric, {k: float(v) for k, v in metric.compute().items()}
