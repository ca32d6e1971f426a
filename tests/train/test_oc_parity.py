"""Training-step parity with OLMo-core (ai2-olmo-core 3.0.0, CPU, attn_backend=torch, fp32).

Both start from the same weights (a tiny OLMo 3: GQA, QK-norm, reordered post-norm, sliding windows
of 8 on a 24-token sequence, padded vocabulary) and see the same batches, including one instance
masked by the repetition filter and a loss spike the skip rule rejects. OLMo-core is driven as its
``TransformerTrainModule`` does: ``get_labels``, the denominator with masked instances added back,
micro-batches (2 sequences) with ``loss_reduction="sum"`` and ``loss_div_factor``, backward, total
norm + ``clip_grads_with_norm_``, ``latest_loss``/``latest_grad_norm``, ``CosWithWarmup.set_lr``
semantics (step counted from 1), ``SkipStepAdamW.step()`` with the embedding in a no-decay group.

The same OLMo-core trajectory is the reference for every platform profile's code path, run here on
CPU (:mod:`olmax.platforms`): ``cpu`` with the remat of its recipes (none), ``gpu`` with the 7B
recipes' (``save_proj``), ``tpu`` with its 7B recipes' (``save_proj``) -- each with its own
attention for ``attn_impl=auto`` (chunked; chunked as cuDNN's fallback; splash in Pallas interpret
mode) and its own loss-chunk rule. The other remat policies compute the same gradients on every
profile (``test_profile_gradients.py``), so one cell per profile is the whole proof.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from helpers.sharded import run_steps
from olmax.config import MeshConfig, ModelConfig, OptimConfig, SchedulerConfig, TrainConfig, YarnConfig
from olmax.model.params import init_params
from olmax.parallel.mesh import make_mesh
from olmax.train.optim import skip_step_adamw
from olmax.train.schedules import build_schedule
from olmax.train.state import init_train_state
from olmax.train.step import build_sharded_training, make_train_step
from helpers.olmo_core_layout import olmax_tree, oc_state_dict
from helpers.reference import require

torch = require("torch")
require("olmo_core")

STEPS = 24
B, T, MICRO = 4, 24, 2
PEAK_LR, WARMUP = 1e-2, 5
SPIKE_STEP = 20
CFG = ModelConfig(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=96,
                  vocab_size=120, padded_vocab_size=128, window_pattern=(8, 8, 8, None),
                  max_seq_len=T)
OPT = OptimConfig(lr=PEAK_LR, rolling_interval_length=16)   # skip rule active from step 8
SCHED = SchedulerConfig(name="cos_with_warmup", warmup_steps=WARMUP, alpha_f=0.1, t_max=STEPS + 6)


def _batches():
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


def _oc_model(params, cfg=CFG):
    """OLMo-core's model of ``cfg`` (its MLP width: llama_like's 8d/3 rounded up to 16) holding
    ``params``."""
    model = _oc_config(cfg).build(init_device="cpu")
    model.load_state_dict({k: torch.tensor(v) for k, v in oc_state_dict(params, cfg).items()})
    return model


def _oc_config(cfg=CFG):
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


def _to_olmax_layout(model, sd=None):
    """OLMo-core state dict (or another dict of its parameter names, e.g. gradients) -> the olmax
    pytree (numpy)."""
    if sd is None:
        sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return olmax_tree(sd, CFG.replace(n_layers=len(model.blocks)))


def _doc_lens():
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


def _documents(doc_lens):
    """(start, length) of every document in a row's ``doc_lens``."""
    ends = np.cumsum(doc_lens[doc_lens > 0])
    return list(zip(ends - doc_lens[doc_lens > 0], doc_lens[doc_lens > 0]))


def _run_olmo_core(params, batches, model=None, docs=None):
    """OLMo-core's training steps on ``batches``, from ``params`` (or an already loaded ``model``).

    ``docs``: each step's ``doc_lens``. OLMo-core masks documents only in its flash-attention
    backends (its CPU backend, torch SDPA, refuses them) and those compute exactly one forward per
    document (varlen attention, positions restarting in each document); so here every document of
    a micro-batch runs as its own forward, with its slice of the row's labels (``get_labels`` of the
    whole row: a document's last label is the next document's first token)."""
    torch.manual_seed(0)
    model = model if model is not None else _oc_model(params)
    losses, skipped, norms = _oc_steps(model, _oc_optimizer(model), batches, docs=docs)
    return losses, skipped, norms, _to_olmax_layout(model)


def _oc_optimizer(model):
    """OLMo-core's SkipStepAdamW over ``model``, the embedding in a no-decay group."""
    from olmo_core.optim.adamw import SkipStepAdamW

    emb = [p for n, p in model.named_parameters() if n == "embeddings.weight"]
    rest = [p for n, p in model.named_parameters() if n != "embeddings.weight"]
    return SkipStepAdamW([{"params": emb, "weight_decay": 0.0}, {"params": rest}], lr=PEAK_LR,
                         betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay,
                         rolling_interval_length=OPT.rolling_interval_length,
                         sigma_factor=int(OPT.sigma_factor), foreach=True)


def _oc_steps(model, opt, batches, first_step=1, docs=None, t_max=SCHED.t_max):
    """OLMo-core's training steps ``first_step, first_step + 1, ...`` on ``batches`` (the LR of
    ``CosWithWarmup`` at each step number): ``(losses, skipped, grad norms)``."""
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
                          for r in range(s, s + MICRO) for a, m in _documents(docs[step - 1][r])]
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


def _run_olmax(params, batches, profile="cpu", remat="none", chunk_size=8, docs=None):
    train_cfg = TrainConfig(seq_len=T, global_batch_size=B, micro_batch_size=MICRO,
                            max_steps=STEPS, profile=profile, remat=remat, attn_impl="auto")
    tx = skip_step_adamw(OPT)
    step_fn = jax.jit(make_train_step(CFG, train_cfg, tx, n_micro=B // MICRO, chunk_size=chunk_size))
    schedule = build_schedule(SCHED, PEAK_LR, STEPS)
    state = init_train_state(params, tx)
    losses, skipped, norms = [], [], []
    for step, (tokens, mask) in enumerate(batches, start=1):
        batch = {"tokens": jnp.asarray(tokens), "instance_mask": jnp.asarray(mask)}
        if docs is not None:
            batch["doc_lens"] = jnp.asarray(docs[step - 1])
        state, m = step_fn(state, batch, jnp.float32(schedule(step)))
        losses.append(float(m["loss"]))
        skipped.append(float(m["skipped"]))
        norms.append(float(m["grad_norm"]))
    return losses, skipped, norms, jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def reference():
    params = init_params(CFG, jax.random.key(3))
    batches = _batches()
    return params, batches, _run_olmo_core(params, batches)


# (profile, remat): one cell per profile, at its 7B recipes' remat. Remat changes no math:
# test_profile_gradients.py proves every (profile, remat) gradient equal to the cpu/none one.
CELLS = [("cpu", "none"), ("gpu", "save_proj"), ("tpu", "save_proj")]


@pytest.mark.parametrize("profile,remat", CELLS)
def test_training_steps_match_olmo_core(reference, profile, remat):
    """Each profile's step as the platform runs it: its own loss chunks (no chunk_size given)."""
    params, batches, (ref_l, ref_s, ref_n, ref_p) = reference
    _check_against_olmo_core(params, (ref_l, ref_s, ref_n, ref_p),
                             _run_olmax(params, batches, profile, remat, chunk_size=None))


def test_chunked_loss_steps_match_olmo_core(reference):
    """The cpu profile with loss chunks of 8 positions (3 per sequence), not the whole row."""
    params, batches, ref = reference
    _check_against_olmo_core(params, ref, _run_olmax(params, batches, "cpu", "none", chunk_size=8))


def _check_against_olmo_core(params, ref, ours):
    ref_l, ref_s, ref_n, ref_p = ref
    our_l, our_s, our_n, our_p = ours

    rel = np.abs(np.array(our_l) - np.array(ref_l)) / np.abs(np.array(ref_l))
    print("max relative loss difference over", STEPS, "steps:", rel.max())
    assert rel.max() < 1e-5, list(zip(our_l, ref_l))
    np.testing.assert_allclose(our_n, ref_n, rtol=1e-4)
    assert our_s == ref_s
    assert ref_s[SPIKE_STEP - 1] == 1.0 and sum(ref_s) == 1.0   # the spike, and only it, skipped
    assert our_l[-1] < 0.7 * our_l[0]                          # the model really trained
    # Parameters after 24 steps. Each step agrees to fp32 rounding, but Adam divides by sqrt(v):
    # a gradient component that is ~0 by chance turns rounding-level differences into a visible
    # part of one lr-sized step. Tolerance: every element within 5e-4 (5% of one peak-lr step),
    # and per tensor the difference is < 1e-3 of the distance the tensor travelled.
    p0 = jax.tree.map(np.asarray, params)
    for (path, a), b, a0 in zip(jax.tree_util.tree_flatten_with_path(our_p)[0], jax.tree.leaves(ref_p),
                                jax.tree.leaves(p0)):
        name = jax.tree_util.keystr(path)
        max_abs = np.abs(a - b).max()
        rel_travel = np.linalg.norm(a - b) / np.linalg.norm(b - a0)
        print(f"{name}: max |diff| {max_abs:.2e}, |diff|/|travel| {rel_travel:.2e}")
        assert max_abs < 5e-4, (name, max_abs)
        assert rel_travel < 1e-3, (name, rel_travel)


@pytest.fixture(scope="module")
def reference_documents(reference):
    params, batches, _ = reference
    docs = _doc_lens()
    return docs, _run_olmo_core(params, batches, docs=docs)


@pytest.mark.parametrize("profile,remat", [("cpu", "none"), ("gpu", "save_proj"), ("tpu", "save_proj")])
def test_training_steps_with_documents_match_olmo_core(reference, reference_documents, profile, remat):
    """Packed rows (``doc_lens`` in every batch): olmax's step masks documents and restarts RoPE
    positions in each; OLMo-core runs one forward per document (see :func:`_run_olmo_core`).
    Micro-batches of 2 rows, each profile's own attention and loss chunks."""
    params, batches, plain = reference
    docs, ref = reference_documents
    assert sum(len(_documents(d)) for step in docs for d in step) > 2 * STEPS * B   # real packing
    assert abs(ref[0][0] - plain[0][0]) > 1e-3     # documents change OLMo-core's first loss
    _check_against_olmo_core(params, ref, _run_olmax(params, batches, profile, remat, chunk_size=None,
                                                     docs=docs))


# Stage 3 in small: packed documents, YaRN (original context 8, factor 4: the 24-token rows reach
# past the original context), and context parallelism (each row's 24 positions split over 4
# devices, 6 each: windows of 8 and documents cross the devices' blocks), x fsdp 2 on 8 devices.
STAGE3_STEPS = 12
CFG_STAGE3 = CFG.replace(rope_scaling=YarnConfig(factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                                 original_max_position_embeddings=8))
def _run_stage3_olmax(params, batches, docs) -> dict:
    """The stage-3 steps on context 4 x fsdp 2 (the mesh tier's 8 CPU devices), per profile."""
    assert jax.device_count() == 8
    tx = skip_step_adamw(OPT)
    schedule = build_schedule(SCHED, PEAK_LR, STAGE3_STEPS)
    mesh = make_mesh(MeshConfig(fsdp=2, context=4), jax.devices())
    hosts = [{"tokens": tok, "instance_mask": mask, "doc_lens": d} for (tok, mask), d in zip(batches, docs)]
    out = {}
    for profile in ("cpu", "tpu"):
        train = TrainConfig(seq_len=T, global_batch_size=B, micro_batch_size=1, max_steps=STAGE3_STEPS,
                            profile=profile, attn_impl="auto")
        st = build_sharded_training(CFG_STAGE3, train, tx, mesh, jax.random.key(0))
        _, m = run_steps(st, hosts, schedule, st.fresh_state(params))
        out[profile] = {"losses": m["loss"], "skipped": m["skipped"], "norms": m["grad_norm"],
                        "attn": st.runtime.attn_impl}
    return out


@pytest.mark.mesh
@pytest.mark.slow
def test_stage3_steps_with_context_parallelism_match_olmo_core():
    """12 steps of packed, document-masked, YaRN-scaled training with context parallelism 4 x
    fsdp 2 (8 CPU devices) against OLMo-core's own steps on one device (one forward per document:
    its CPU attention cannot mask documents, nor does it parallelise over context). The cpu profile
    (chunked attention) and the tpu profile (splash, Pallas interpreted) both."""
    params = init_params(CFG_STAGE3, jax.random.key(3))
    batches, docs = _batches()[:STAGE3_STEPS], _doc_lens()[:STAGE3_STEPS]
    ref_l, ref_s, ref_n, _ = _run_olmo_core(params, batches, model=_oc_model(params, CFG_STAGE3),
                                            docs=docs)
    got = _run_stage3_olmax(params, batches, docs)
    assert got["cpu"]["attn"] == "chunked" and got["tpu"]["attn"] == "splash"
    for profile, ours in got.items():
        rel = np.abs(np.array(ours["losses"]) - np.array(ref_l)) / np.abs(np.array(ref_l))
        print(profile, "max relative loss difference over", STAGE3_STEPS, "steps:", rel.max())
        assert rel.max() < 1e-5, list(zip(ours["losses"], ref_l))
        np.testing.assert_allclose(ours["norms"], ref_n, rtol=1e-4)
        assert ours["skipped"] == ref_s
    assert ref_l[-1] < 0.8 * ref_l[0]     # the model trained
