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
from olmax.config import MeshConfig, TrainConfig, YarnConfig
from olmax.model.params import init_params
from olmax.parallel.mesh import make_mesh
from olmax.train.optim import skip_step_adamw
from olmax.train.schedules import build_schedule
from olmax.train.state import init_train_state
from olmax.train.step import build_sharded_training, make_train_step
from helpers.reference import require

torch = require("torch")
require("olmo_core")

from helpers.olmo_core import (B, CFG, MICRO, OPT, PEAK_LR, SCHED, SPIKE_STEP, STEPS, T,  # noqa: E402
                               documents, make_batches, make_doc_lens, oc_model, run_olmo_core)

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
    batches = make_batches()
    return params, batches, run_olmo_core(params, batches)


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
    docs = make_doc_lens()
    return docs, run_olmo_core(params, batches, docs=docs)


@pytest.mark.parametrize("profile,remat", [("cpu", "none"), ("gpu", "save_proj"), ("tpu", "save_proj")])
def test_training_steps_with_documents_match_olmo_core(reference, reference_documents, profile, remat):
    """Packed rows (``doc_lens`` in every batch): olmax's step masks documents and restarts RoPE
    positions in each; OLMo-core runs one forward per document (see :func:`run_olmo_core`).
    Micro-batches of 2 rows, each profile's own attention and loss chunks."""
    params, batches, plain = reference
    docs, ref = reference_documents
    assert sum(len(documents(d)) for step in docs for d in step) > 2 * STEPS * B   # real packing
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
    batches, docs = make_batches()[:STAGE3_STEPS], make_doc_lens()[:STAGE3_STEPS]
    ref_l, ref_s, ref_n, _ = run_olmo_core(params, batches, model=oc_model(params, CFG_STAGE3),
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
