"""OLMo-core checkpoints in and out, against ai2-olmo-core 3.0.0 on CPU.

OLMo-core trains the tiny model of :mod:`test_oc_parity` for K steps and saves a checkpoint as its
``Trainer`` lays one out (``model_and_optim/`` through its ``save_model_and_optim_state`` with the
optimizer state flattened, as the trainer saves it; ``train/rank0.pt``; ``.metadata.json``;
``config.json`` with its model section). Then:

- resume: a fresh OLMo-core model and optimizer load the folder (``load_model_and_optim_state``)
  and train M more steps from step K+1; olmax, from the same folder through
  ``olmax convert olmo-core-to-olmax``, trains the same M steps;
- warm start: both restart the schedule at step 1 with Adam's state carried;
- export: olmax's state after those M steps, written by ``olmax convert olmax-to-olmo-core`` and
  loaded strictly by OLMo-core, trains on as olmax's own state does;
- round trip: OLMo-core -> olmax -> OLMo-core gives every weight, moment and step bit for bit.

Each compared step: loss within 1e-5 relative, grad norm within 1e-4, the same skipped steps.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_oc_parity as ref
from helpers.reference import require
from olmax.checkpoint.checkpointer import abstract_tree, open_step_dir
from olmax.checkpoint.weights import load_meta, save_train_state
from olmax.config import TrainConfig
from olmax.interop.olmo_core.convert import convert_olmax_to_olmo_core, convert_olmo_core_to_olmax
from olmax.interop.olmo_core.dcp import DcpReader, Files
from olmax.model.params import init_params
from olmax.train.optim import skip_step_adamw
from olmax.train.schedules import build_schedule
from olmax.train.state import init_train_state
from olmax.train.step import make_train_step

torch = require("torch")
require("olmo_core")

K, M = 6, 4
FINGERPRINT = "f" * 64
SEED = 4321


def _trainer_state(step):
    """OLMo-core's ``Trainer.state_dict()`` at ``step`` of a run of B x T batches."""
    from olmo_core.train.utils import EnvRngStates

    tokens = step * ref.B * ref.T
    return {"global_step": step, "global_train_tokens_seen": tokens, "global_train_petaflops": 0.0,
            "max_steps": ref.STEPS,
            "data_loader": {"dataset_fingerprint_version": 2, "dataset_fingerprint": FINGERPRINT,
                            "batches_processed": step, "tokens_processed": tokens, "seed": SEED,
                            "epoch": 1, "dataset_type": "fsl", "sequence_length": ref.T,
                            "max_target_sequence_length": ref.T},
            "epoch": 1, "world_size": 1, "rng": EnvRngStates.current_state().as_dict(),
            "callbacks": {}}


def _save_oc_checkpoint(folder, model, opt, step):
    from olmo_core.distributed.checkpoint import save_model_and_optim_state
    from olmo_core.version import VERSION

    save_model_and_optim_state(folder / "model_and_optim", model, opt, flatten_optimizer_state=True)
    (folder / "train").mkdir()
    torch.save(_trainer_state(step), folder / "train" / "rank0.pt")
    (folder / ".metadata.json").write_text(json.dumps({"version": VERSION}))
    config = {"model": ref._oc_config().as_config_dict(),
              "dataset": {"tokenizer": {"vocab_size": ref.CFG.vocab_size}}}
    (folder / "config.json").write_text(json.dumps(config))


def _oc_load(folder):
    """A fresh OLMo-core model and optimizer, loaded strictly from ``folder``."""
    from olmo_core.distributed.checkpoint import load_model_and_optim_state

    model = ref._oc_model(init_params(ref.CFG, jax.random.key(99)))
    opt = ref._oc_optimizer(model)
    load_model_and_optim_state(folder, model, opt, flatten_optimizer_state=True)
    return model, opt


def _olmax_state(step_dir):
    """The TrainState of an olmax checkpoint step dir."""
    tx = skip_step_adamw(ref.OPT)
    template = init_train_state(init_params(ref.CFG, jax.random.key(0)), tx)
    ro, step = open_step_dir(step_dir)
    state, meta = ro.restore(step, abstract_tree(template))
    ro.close()
    return state, meta


@functools.lru_cache(maxsize=1)
def _step_fn():
    train_cfg = TrainConfig(seq_len=ref.T, global_batch_size=ref.B, micro_batch_size=ref.MICRO,
                            max_steps=ref.STEPS, profile="cpu", remat="none", attn_impl="auto")
    return jax.jit(make_train_step(ref.CFG, train_cfg, skip_step_adamw(ref.OPT),
                                   n_micro=ref.B // ref.MICRO, chunk_size=None))


def _olmax_steps(state, batches, first_step):
    step_fn = _step_fn()
    schedule = build_schedule(ref.SCHED, ref.PEAK_LR, ref.STEPS)
    losses, skipped, norms = [], [], []
    for step, (tokens, mask) in enumerate(batches, start=first_step):
        batch = {"tokens": jnp.asarray(tokens), "instance_mask": jnp.asarray(mask)}
        state, m = step_fn(state, batch, jnp.float32(schedule(step)))
        losses.append(float(m["loss"]))
        skipped.append(float(m["skipped"]))
        norms.append(float(m["grad_norm"]))
    return state, (losses, skipped, norms)


def _same_steps(ours, theirs):
    (our_l, our_s, our_n), (ref_l, ref_s, ref_n) = ours, theirs
    rel = np.abs(np.array(our_l) - np.array(ref_l)) / np.abs(np.array(ref_l))
    assert rel.max() <= 1e-5, list(zip(our_l, ref_l))
    np.testing.assert_allclose(our_n, ref_n, rtol=1e-4)
    assert our_s == ref_s


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """OLMo-core's K steps and checkpoint, and that checkpoint converted to olmax."""
    root = tmp_path_factory.mktemp("oc")
    batches = ref._batches()
    torch.manual_seed(0)
    model = ref._oc_model(init_params(ref.CFG, jax.random.key(3)))
    opt = ref._oc_optimizer(model)
    ref._oc_steps(model, opt, batches[:K])
    folder = root / f"step{K}"
    folder.mkdir()
    _save_oc_checkpoint(folder, model, opt, K)
    converted = convert_olmo_core_to_olmax(folder, root / "olmax", optim=ref.OPT)
    return folder, converted, batches


@pytest.mark.slow
def test_resume_matches_olmo_core(run):
    folder, converted, batches = run
    meta = load_meta(converted)
    assert meta["step"] == K and meta["seed"] == SEED
    assert meta["olmo_core"]["data_loader"]["dataset_fingerprint"] == FINGERPRINT
    assert meta["olmo_core"]["data_loader"]["tokens_processed"] // (ref.B * ref.T) == K
    model, opt = _oc_load(folder / "model_and_optim")
    theirs = ref._oc_steps(model, opt, batches[K:K + M], first_step=K + 1)
    state, _ = _olmax_state(converted / str(K))
    assert int(state.opt_state.inner[0].count) == K
    _, ours = _olmax_steps(state, batches[K:K + M], first_step=K + 1)
    _same_steps(ours, theirs)


@pytest.mark.slow
def test_warm_start_matches_olmo_core(run):
    """Weights and Adam's state carried, the schedule and the data restarted."""
    folder, converted, batches = run
    model, opt = _oc_load(folder / "model_and_optim")
    theirs = ref._oc_steps(model, opt, batches[:M], first_step=1)
    state, _ = _olmax_state(converted / str(K))
    _, ours = _olmax_steps(state._replace(step=jnp.zeros_like(state.step)), batches[:M], 1)
    _same_steps(ours, theirs)


@pytest.mark.slow
def test_export_resumed_by_olmo_core_matches_olmax(run, tmp_path):
    folder, converted, batches = run
    state, meta = _olmax_state(converted / str(K))
    state, _ = _olmax_steps(state, batches[K:K + M], first_step=K + 1)
    host = jax.tree.map(np.asarray, state)
    ours_dir = save_train_state(tmp_path / "olmax", K + M, host.params, host.opt_state, ref.CFG,
                                extra_meta={**meta, "data_position": K + M})
    exported = convert_olmax_to_olmo_core(ours_dir, tmp_path / f"step{K + M}")
    trainer = torch.load(exported / "train" / "rank0.pt", weights_only=False)
    assert trainer["global_step"] == K + M
    assert trainer["data_loader"]["tokens_processed"] == (K + M) * ref.B * ref.T
    assert trainer["data_loader"]["dataset_fingerprint"] == FINGERPRINT
    assert trainer["data_loader"]["seed"] == SEED
    model, opt = _oc_load(exported / "model_and_optim")
    nxt = batches[K + M:K + 2 * M]
    theirs = ref._oc_steps(model, opt, nxt, first_step=K + M + 1)
    _, ours = _olmax_steps(state, nxt, first_step=K + M + 1)
    _same_steps(ours, theirs)


def test_round_trip_is_bit_identical(run, tmp_path):
    """OLMo-core -> olmax -> OLMo-core: every weight, moment and step, bit for bit, as our reader
    and as OLMo-core's loader see them."""
    folder, converted, _ = run
    back = convert_olmax_to_olmo_core(converted, tmp_path / "back")
    a = DcpReader(Files(folder / "model_and_optim"))
    b = DcpReader(Files(back / "model_and_optim"))
    assert set(a.meta.tensors) == set(b.meta.tensors)
    for key in a.meta.tensors:
        x, y = a.tensor(key), b.tensor(key)
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert x.tobytes() == y.tobytes(), key
    for key in a.meta.values:
        if not key.endswith(".lr"):
            assert a.value(key) == b.value(key), key
    m1, o1 = _oc_load(folder / "model_and_optim")
    m2, o2 = _oc_load(back / "model_and_optim")
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), name
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o1.state[p][k], o2.state[q][k]), (name, k)
