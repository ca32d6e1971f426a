"""The OLMo-core reference the parity tests share (ai2-olmo-core 3.0.0 on CPU, torch SDPA, fp32):
a tiny OLMo 3 and its OLMo-core twin, the batches both see (a masked instance, a loss spike),
OLMo-core's optimizer and training steps driven as its ``TransformerTrainModule`` drives them, and
the olmax pytree <-> OLMo-core state-dict names by the parameter table's OLMo-core column
(:func:`olmax.model.params.olmo_core_tensors`: the map lives there, not here).

The name map needs neither torch nor OLMo-core; the reference functions import them where they run,
so a test module that calls them first ``require``s both (the reference tier: ``helpers.reference``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from olmax.config import ModelConfig, OptimConfig, SchedulerConfig
from olmax.model.params import olmo_core_tensors

STEPS = 24
B, T, MICRO = 4, 24, 2
PEAK_LR, WARMUP = 1e-2, 5
SPIKE_STEP = 20
CFG = ModelConfig(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=96,
                  vocab_size=120, padded_vocab_size=128, window_pattern=(8, 8, 8, None),
                  max_seq_len=T)
OPT = OptimConfig(lr=PEAK_LR, rolling_interval_length=16)   # skip rule active from step 8
SCHED = SchedulerConfig(name="cos_with_warmup", warmup_steps=WARMUP, alpha_f=0.1, t_max=STEPS + 6)


def make_batches():
    rng = np.random.default_rng(7)
    out = []
    for step in range(1, STEPS + 1):
        if step == SPIKE_STEP:   # tokens never seen before: a loss spike
            tokens = rng.integers(64, 120, size=(B, T))
        else:                    # a skewed distribution over 32 tokens the model learns quickly
            tokens = np.minimum(rng.geometric(0.15, size=(B, T)) - 1, 31)
        mask = np.ones(B, bool)
        if step % 5 == 3:
            mask[step % B] = False   # repetition filter: instance masked
        out.append((tokens.astype(np.int32), mask))
    return out


def oc_model(params, cfg=CFG):
    """OLMo-core's model of ``cfg`` (its MLP width: llama_like's 8d/3 rounded up to 16) holding
    ``params``."""
    import torch

    model = oc_config(cfg).build(init_device="cpu")
    model.load_state_dict({k: torch.tensor(v) for k, v in oc_state_dict(params, cfg).items()})
    return model


def oc_config(cfg=CFG):
    """OLMo-core's ``TransformerConfig`` of ``cfg``."""
    from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    oc_cfg = TransformerConfig.llama_like(
        d_model=cfg.d_model, vocab_size=cfg.padded_vocab_size, n_layers=cfg.n_layers,
        n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, qk_norm=True,
        block_name=TransformerBlockType.reordered_norm, layer_norm_eps=cfg.norm_eps,
        rope_theta=int(cfg.rope_theta), hidden_size_multiple_of=16,
        attn_backend=AttentionBackendName.torch,
        sliding_window=SlidingWindowAttentionConfig(
            pattern=[-1 if w is None else w for w in cfg.window_pattern],
            force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=True))
    if cfg.rope_scaling is not None:   # YaRN, on the full-attention layers (as olmax)
        from olmo_core.nn.rope import YaRNRoPEScalingConfig

        y = cfg.rope_scaling
        oc_cfg = oc_cfg.with_rope_scaling(YaRNRoPEScalingConfig(
            factor=y.factor, beta_fast=y.beta_fast, beta_slow=y.beta_slow,
            old_context_len=y.original_max_position_embeddings))
    return oc_cfg


def to_olmax_layout(model, sd=None):
    """OLMo-core state dict (or another dict of its parameter names, e.g. gradients) -> the olmax
    pytree (numpy)."""
    if sd is None:
        sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return olmax_tree(sd, CFG.replace(n_layers=len(model.blocks)))


def make_doc_lens():
    """Per step, OLMo-core ``doc_lens`` [B, 4] (zero-padded) cutting each row into 1 to 4
    documents, many longer than the window of 8 (intra-document masking runs)."""
    rng = np.random.default_rng(11)
    out = []
    for _ in range(STEPS):
        lens = np.zeros((B, 4), np.int32)
        for r in range(B):
            cuts = np.sort(rng.choice(np.arange(1, T), size=rng.integers(0, 4), replace=False))
            lens[r, :len(cuts) + 1] = np.diff(np.concatenate([[0], cuts, [T]]))
        out.append(lens)
    return out


def documents(doc_lens):
    """(start, length) of every document in a row's ``doc_lens``."""
    ends = np.cumsum(doc_lens[doc_lens > 0])
    return list(zip(ends - doc_lens[doc_lens > 0], doc_lens[doc_lens > 0]))


def run_olmo_core(params, batches, model=None, docs=None):
    """OLMo-core's training steps on ``batches``, from ``params`` (or an already loaded ``model``).

    ``docs``: each step's ``doc_lens``. OLMo-core masks documents only in its flash-attention
    backends (its CPU backend, torch SDPA, refuses them) and those compute exactly one forward per
    document (varlen attention, positions restarting in each document); so here every document of
    a micro-batch runs as its own forward, with its slice of the row's labels (``get_labels`` of the
    whole row: a document's last label is the next document's first token)."""
    import torch

    torch.manual_seed(0)
    model = model if model is not None else oc_model(params)
    losses, skipped, norms = oc_steps(model, oc_optimizer(model), batches, docs=docs)
    return losses, skipped, norms, to_olmax_layout(model)


def oc_optimizer(model):
    """OLMo-core's SkipStepAdamW over ``model``, the embedding in a no-decay group."""
    from olmo_core.optim.adamw import SkipStepAdamW

    emb = [p for n, p in model.named_parameters() if n == "embeddings.weight"]
    rest = [p for n, p in model.named_parameters() if n != "embeddings.weight"]
    return SkipStepAdamW([{"params": emb, "weight_decay": 0.0}, {"params": rest}], lr=PEAK_LR,
                         betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay,
                         rolling_interval_length=OPT.rolling_interval_length,
                         sigma_factor=int(OPT.sigma_factor), foreach=True)


def oc_steps(model, opt, batches, first_step=1, docs=None, t_max=SCHED.t_max):
    """OLMo-core's training steps ``first_step, first_step + 1, ...`` on ``batches`` (the LR of
    ``CosWithWarmup`` at each step number): ``(losses, skipped, grad norms)``."""
    import torch

    from olmo_core.data.utils import get_labels
    from olmo_core.optim.scheduler import CosWithWarmup

    model.train()
    sched = CosWithWarmup(warmup=WARMUP, alpha_f=0.1)
    losses, skipped, norms = [], [], []
    for step, (tokens, mask) in enumerate(batches, start=first_step):
        ids = torch.tensor(tokens, dtype=torch.long)
        im = torch.tensor(mask)
        labels = get_labels({"input_ids": ids, "instance_mask": im})
        n = (labels != -100).sum() + (~im).sum() * labels.shape[1]
        ce_total = torch.tensor(0.0)
        for s in range(0, B, MICRO):
            if docs is None:
                pieces = [(ids[s:s + MICRO], labels[s:s + MICRO])]
            else:
                pieces = [(ids[r:r + 1, a:a + m], labels[r:r + 1, a:a + m])
                          for r in range(s, s + MICRO) for a, m in documents(docs[step - 1][r])]
            for x, y in pieces:
                out = model(x, labels=y, loss_reduction="sum", z_loss_multiplier=1e-5,
                            loss_div_factor=n, return_logits=False)
                ce_total += out.ce_loss.detach()
                out.loss.backward()
        params_t = list(model.parameters())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params_t], norm_type=2.0)
        torch.nn.utils.clip_grads_with_norm_(params_t, OPT.max_grad_norm, norm)
        opt.latest_grad_norm = norm
        opt.latest_loss = ce_total
        for g in opt.param_groups:
            g["lr"] = sched.get_lr(PEAK_LR, step, t_max)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(ce_total))
        skipped.append(float(opt.step_skipped))
        norms.append(float(norm))
    return losses, skipped, norms


def oc_state_dict(params: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """``{OLMo-core name: array}`` of an olmax pytree (weights, or moments in the same layout)."""
    p = jax.tree.map(np.asarray, params)
    out = {}
    for t in olmo_core_tensors(cfg):
        node = p
        for part in t.path:
            node = node[part]
        a = node[t.layer] if t.layer is not None else node
        out[t.name] = np.ascontiguousarray(a.T if t.transposed else a)
    return out


def olmax_tree(sd: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """The olmax pytree of an OLMo-core state dict (or a dict of its names, e.g. gradients)."""
    leaves: dict[tuple[str, ...], list] = {}
    for t in olmo_core_tensors(cfg):
        a = np.asarray(sd[t.name])
        leaves.setdefault(t.path, []).append(a.T if t.transposed else a)
    tree: dict = {}
    for path, arrays in leaves.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = np.stack(arrays) if path[0] == "layers" else arrays[0]
    return tree


def merge_core_checkpoints(model_paths, output_path, skip_optimizer_state=False) -> None:
    """OLMo-core's ``src/scripts/merge_core_checkpoints.py`` (its ``merge_checkpoints``), step for
    step with the ai2-olmo-core functions it calls (the script lives in OLMo-core's repository,
    not in the package): each checkpoint's ``model_and_optim/`` metadata
    (``get_checkpoint_metadata``), their keys checked equal; values that are not tensors loaded
    (``load_state_dict``) from the first checkpoint that has them; every tensor an fp32
    accumulator of zeros to which each checkpoint's tensor times ``1 / N`` is added in input
    order, 128 keys per ``load_state_dict``; then the first checkpoint's folder copied to
    ``output_path`` without its ``model_and_optim/``, and the result saved there as
    ``{"model": ..., "optim": ...}`` by ``save_state_dict``."""
    import os
    import shutil

    import torch
    from olmo_core.data.utils import chunked
    from olmo_core.distributed.checkpoint import (get_checkpoint_metadata, load_state_dict,
                                                  save_state_dict)
    from torch.distributed.checkpoint import TensorStorageMetadata

    paths = [os.path.join(str(p), "model_and_optim") for p in model_paths]
    metas = [get_checkpoint_metadata(p) for p in paths]

    def keys_of(meta):
        return {k for k in meta.state_dict_metadata
                if not (skip_optimizer_state and k.startswith("optim."))}

    assert all(keys_of(m) == keys_of(metas[0]) for m in metas), "different keys"
    merged: dict = {}
    for path, meta in zip(paths, metas):
        values, tensors = [], []
        for key, m in meta.state_dict_metadata.items():
            if skip_optimizer_state and key.startswith("optim."):
                continue
            (tensors if isinstance(m, TensorStorageMetadata) else values).append((key, m))
        batch = {key: None for key, _ in values if key not in merged}
        if batch:
            load_state_dict(path, batch)
            merged.update(batch)
        for chunk in chunked(tensors, 128):
            for key, m in chunk:
                merged.setdefault(key, torch.zeros(m.size))
            batch = {key: torch.empty_like(merged[key]) for key, _ in chunk}
            load_state_dict(path, batch)
            for key, _ in chunk:
                merged[key].add_(batch[key], alpha=1 / len(paths))
    state = {"model": {}, "optim": {}}
    for key, value in merged.items():
        head, _, rest = key.partition(".")
        state[head][rest] = value
    if os.path.exists(output_path):
        shutil.rmtree(output_path)
    shutil.copytree(str(model_paths[0]), str(output_path),
                    ignore=lambda d, files: files if os.path.basename(d) == "model_and_optim" else [])
    save_state_dict(os.path.join(str(output_path), "model_and_optim"), state)
