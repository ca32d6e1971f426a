"""OLMo-core checkpoints in and out, against ai2-olmo-core 3.0.0 on CPU.

OLMo-core trains the tiny model of :mod:`helpers.olmo_core` for K steps and saves a checkpoint as its
``Trainer`` lays one out (``model_and_optim/`` through its ``save_model_and_optim_state`` with the
optimizer state flattened, as the trainer saves it; ``train/rank0.pt``; ``.metadata.json``;
``config.json`` with its model section). Then:

- resume: a fresh OLMo-core model and optimizer load the folder (``load_model_and_optim_state``)
  and train M more steps from step K+1; olmax, from the same folder through
  ``olmax convert olmo-core-to-olmax``, trains the same M steps;
- warm start: both restart the schedule at step 1 with Adam's state carried;
- export: olmax's state after those M steps, written by ``olmax convert olmax-to-olmo-core`` and
  loaded strictly by OLMo-core, trains on as olmax's own state does;
- round trip: OLMo-core -> olmax -> OLMo-core gives every weight, moment and step bit for bit;
- soup: two olmax runs from one init on different data, ``olmax merge``d, and training continued
  from the soup; OLMo-core merges the same two checkpoints (in its layout) as its merge script does
  and continues on the same batches.

Each compared step: loss within 1e-5 relative, grad norm within 1e-4, the same skipped steps.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import olmo_core as ref
from helpers.reference import require
from olmax.checkpoint.checkpointer import Checkpointer, abstract_tree, open_step_dir
from olmax.checkpoint.weights import load_meta, save_train_state
from olmax.cli import main
from olmax.config import CheckpointConfig, InitConfig, RunConfig, TrainConfig, to_dict
from olmax.interop.olmo_core.convert import convert_olmax_to_olmo_core, convert_olmo_core_to_olmax
from olmax.interop.olmo_core.dcp import DcpReader, Files
from olmax.model.params import init_params
from olmax.train.optim import skip_step_adamw
from olmax.train.schedules import build_schedule
from olmax.train.start import start_state
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
            "data_loader": {"dataset_fingerprint_version": "v2.0", "dataset_fingerprint": FINGERPRINT,
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
    config = {"model": ref.oc_config().as_config_dict(),
              "dataset": {"tokenizer": {"vocab_size": ref.CFG.vocab_size}}}
    (folder / "config.json").write_text(json.dumps(config))


def _oc_load(folder):
    """A fresh OLMo-core model and optimizer, loaded strictly from ``folder``."""
    from olmo_core.distributed.checkpoint import load_model_and_optim_state

    model = ref.oc_model(init_params(ref.CFG, jax.random.key(99)))
    opt = ref.oc_optimizer(model)
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
    batches = ref.make_batches()
    torch.manual_seed(0)
    model = ref.oc_model(init_params(ref.CFG, jax.random.key(3)))
    opt = ref.oc_optimizer(model)
    ref.oc_steps(model, opt, batches[:K])
    folder = root / f"step{K}"
    folder.mkdir()
    _save_oc_checkpoint(folder, model, opt, K)
    converted = convert_olmo_core_to_olmax(folder, root / "olmax", optim=ref.OPT, optimizer=skip_step_adamw)
    return folder, converted, batches


@pytest.mark.slow
def test_resume_matches_olmo_core(run):
    folder, converted, batches = run
    meta = load_meta(converted)
    assert meta["step"] == K and meta["seed"] == SEED
    assert meta["olmo_core"]["data_loader"]["dataset_fingerprint"] == FINGERPRINT
    assert meta["olmo_core"]["data_loader"]["tokens_processed"] // (ref.B * ref.T) == K
    model, opt = _oc_load(folder / "model_and_optim")
    theirs = ref.oc_steps(model, opt, batches[K:K + M], first_step=K + 1)
    state, _ = _olmax_state(converted / str(K))
    assert int(state.opt_state.inner[0].count) == K
    _, ours = _olmax_steps(state, batches[K:K + M], first_step=K + 1)
    _same_steps(ours, theirs)


@pytest.mark.slow
def test_warm_start_matches_olmo_core(run):
    """Weights and Adam's state carried, the schedule and the data restarted."""
    folder, converted, batches = run
    model, opt = _oc_load(folder / "model_and_optim")
    theirs = ref.oc_steps(model, opt, batches[:M], first_step=1)
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
    theirs = ref.oc_steps(model, opt, nxt, first_step=K + M + 1)
    _, ours = _olmax_steps(state, nxt, first_step=K + M + 1)
    _same_steps(ours, theirs)


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.reference
def test_soup_continues_as_olmo_cores(tmp_path):
    """OLMo 3 32B's stage 2 -> 3 in small: two ingredient runs of 2 steps from one init on
    different batches, each checkpointed; ``olmax merge`` of the two; then 12 steps from the soup
    with its Adam state and a new schedule (``init.checkpoint=SOUP init.load_optimizer=true``,
    through the trainer's ``start_state``). OLMo-core: the two checkpoints in its layout
    (``olmax convert olmax-to-olmo-core``) merged as ``merge_core_checkpoints.py`` merges them,
    the merged checkpoint loaded as its trainer loads one, then its optimizer's steps on the same
    batches. Every step as in ``_same_steps``: loss within 1e-5 relative, grad norm within
    1e-4, the same skipped steps (the skip rule runs from the soup's 8th step)."""
    batches = ref.make_batches()
    after = batches[8:20]                        # the spike (step 20) is the soup's 12th step
    params = init_params(ref.CFG, jax.random.key(3))
    tx = skip_step_adamw(ref.OPT)
    train_meta = {"optim": to_dict(ref.OPT), "data_position": 2, "seed": SEED,
                  "config": {"train": {"global_batch_size": ref.B, "seq_len": ref.T}}}
    # Committed to the device, as the restored soup is: one compilation of the step serves both
    init = jax.device_put(init_train_state(params, tx), jax.devices()[0])
    ingredients = []
    for name, data in (("a", batches[:2]), ("b", batches[2:4])):
        state, _ = _olmax_steps(init, data, first_step=1)
        host = jax.tree.map(np.asarray, state)
        ingredients.append(save_train_state(tmp_path / name, 2, host.params, host.opt_state, ref.CFG,
                                            extra_meta=train_meta))
    soup = tmp_path / "soup"
    assert main(["merge", *map(str, ingredients), "--out", str(soup)]) == 0

    cfg = RunConfig(model=ref.CFG, optim=ref.OPT,
                    train=TrainConfig(seq_len=ref.T, global_batch_size=ref.B, max_steps=12),
                    init=InitConfig(checkpoint=str(soup), load_optimizer=True))
    fresh = lambda p: init_train_state(params if p is None else p, tx)  # noqa: E731
    start = start_state(cfg, Checkpointer(tmp_path / "run" / "checkpoints", CheckpointConfig()),
                        abstract_tree(fresh(None)), fresh)
    assert start.step == 0 and start.origin["load_optimizer"]
    assert int(start.state.opt_state.inner[0].count) == 2
    _, ours = _olmax_steps(start.state, after, first_step=1)

    exports = []
    for src in ingredients:
        out = tmp_path / f"oc-{src.name}"
        assert main(["convert", "olmax-to-olmo-core", str(src), str(out)]) == 0
        exports.append(out)
    ref.merge_core_checkpoints(exports, tmp_path / "oc-soup")
    model, opt = _oc_load(tmp_path / "oc-soup" / "model_and_optim")
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}
    theirs = ref.oc_steps(model, opt, after, first_step=1)
    print(f"\nsoup, {len(after)} steps: losses {[round(x, 4) for x in theirs[0]]}, max relative "
          f"difference {max(abs(a / b - 1) for a, b in zip(ours[0], theirs[0])):.2e}, skipped "
          f"{[i + 1 for i, x in enumerate(theirs[1]) if x]}")
    _same_steps(ours, theirs)
    # Negative control: OLMo-core from the first ingredient alone is another run
    alone = ref.oc_steps(*_oc_load(exports[0] / "model_and_optim"), after[:1], first_step=1)
    assert abs(alone[0][0] / theirs[0][0] - 1) > 1e-4


def test_float8_weight_wrapper_reads_as_its_plain_tensor(tmp_path):
    """A chunk torch.save'd as torchao's ``WeightWithDynamicFloat8CastTensor`` (OLMo-core's
    float8 training with float8 all-gather) is read as the fp32 tensor it wraps."""
    require("torchao")
    import io

    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from olmax.interop.olmo_core.torch_zip import Archive

    plain = torch.randn(6, 4)
    buf = io.BytesIO()
    torch.save(WeightWithDynamicFloat8CastTensor(plain, LinearMMConfig(), torch.float8_e4m3fn), buf)
    data = buf.getvalue()
    archive = Archive(lambda o, n: data[o:o + n], len(data), "float8 chunk")
    got = archive.array(archive.load())
    assert got.dtype == np.float32 and np.array_equal(got, plain.numpy())


FSDP_SCRIPT = """
import os, socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp


def run(rank, world, folder, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import jax
    from helpers import olmo_core as ref
    from olmax.model.params import init_params
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from olmo_core.distributed.checkpoint import save_model_and_optim_state

    torch.manual_seed(0)
    model = ref.oc_model(init_params(ref.CFG, jax.random.key(3)))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ref.oc_optimizer(model)
    ref.oc_steps(model, opt, ref.make_batches()[:3])
    save_model_and_optim_state(folder, model, opt, flatten_optimizer_state=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(run, args=(2, sys.argv[1], port), nprocs=2)
"""


@pytest.mark.slow
def test_fsdp_world_size_2_checkpoint(tmp_path):
    """A checkpoint saved by OLMo-core at world size 2 with FSDP (gloo, CPU): every tensor in two
    chunks, two ranks' files. olmax assembles each tensor as OLMo-core's own loader does at world
    size 1, and its conversion round trip is bit for bit."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "model_and_optim"
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script), str(folder)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reader = DcpReader(Files(folder))
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(reader.meta.files)
    emb = reader.meta.tensors["model.embeddings.weight"]
    assert [c.offsets for c in emb.chunks] == [(0, 0), (ref.CFG.padded_vocab_size // 2, 0)]
    model, opt = _oc_load(folder)
    for name, p in model.named_parameters():
        assert reader.tensor(f"model.{name}").tobytes() == p.detach().numpy().tobytes(), name
        for k in ("exp_avg", "exp_avg_sq", "step"):
            got = reader.tensor(f"optim.state.{name}.{k}")
            assert got.tobytes() == opt.state[p][k].numpy().tobytes(), (name, k)
    step_dir = tmp_path / "step3"
    (step_dir / "train").mkdir(parents=True)
    folder.rename(step_dir / "model_and_optim")
    torch.save(_trainer_state(3), step_dir / "train" / "rank0.pt")
    (step_dir / "config.json").write_text(json.dumps({
        "model": ref.oc_config().as_config_dict(),
        "dataset": {"tokenizer": {"vocab_size": ref.CFG.vocab_size}}}))
    converted = convert_olmo_core_to_olmax(step_dir, tmp_path / "olmax", optim=ref.OPT, optimizer=skip_step_adamw)
    back = convert_olmax_to_olmo_core(converted, tmp_path / "back")
    m2, o2 = _oc_load(back / "model_and_optim")
    for (name, p), q in zip(model.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), name
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], o2.state[q][k]), (name, k)


@pytest.mark.slow
def test_export_continues_in_olmo_cores_data_loader(token_files, tmp_path):
    """An olmax run's export: OLMo-core's data loader over the same files accepts its state
    (fingerprint checked) and serves next the batch olmax's next step trains on."""
    from olmo_core.data import collator, data_loader, numpy_dataset

    from helpers.datahelp import EOS, PAD, VOCAB
    from olmax.cli import main
    from olmax.config import DataConfig
    from olmax.data.loader import build_train_data

    paths, recipe = token_files
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run), "--quiet", "train.max_steps=2",
                 "checkpoint.interval=2"]) == 0
    out = tmp_path / "step2"
    assert main(["convert", "olmax-to-olmo-core", str(run), str(out)]) == 0
    state = torch.load(out / "train" / "rank0.pt", weights_only=False)
    assert (state["global_step"], state["global_train_tokens_seen"]) == (2, 2 * 8 * 32)
    ds = numpy_dataset.NumpyFSLDataset(*paths, sequence_length=32, pad_token_id=PAD,
                                       eos_token_id=EOS, vocab_size=VOCAB, dtype=np.uint32)
    loader = data_loader.NumpyFSLDataLoader(ds, collator=collator.DataCollator(pad_token_id=PAD),
                                            global_batch_size=8 * 32, work_dir=str(tmp_path / "w"),
                                            seed=0, shuffle=True)
    loader.load_state_dict(state["data_loader"])
    assert (loader.seed, loader.batches_processed) == (11, 2)
    loader.reshuffle(epoch=1, in_memory=True)
    theirs = next(iter(loader))["input_ids"].numpy()
    ours = build_train_data(DataConfig(paths=tuple(paths)), seq_len=32, global_batch_size=8,
                            seed=11).global_batch(2)["tokens"]
    np.testing.assert_array_equal(theirs, ours)
    state["data_loader"]["dataset_fingerprint"] = "0" * 64
    with pytest.raises(RuntimeError, match="fingerprint"):
        loader.load_state_dict(state["data_loader"])


@pytest.mark.slow
def test_export_loads_in_olmo_cores_trainer_checkpointer(run, tmp_path):
    """The export through OLMo-core's own trainer checkpointer (``Checkpointer.load`` with
    ``load_trainer_state=True``) into a ``TransformerTrainModule`` with SkipStepAdamW, as the
    ``Trainer`` loads a checkpoint: strict, model, optimizer and trainer state."""
    import torch.distributed as dist
    from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig
    from olmo_core.train.checkpoint import Checkpointer
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    folder, converted, _ = run
    exported = convert_olmax_to_olmo_core(converted, tmp_path / f"step{K}")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        optim = SkipStepAdamWConfig(
            lr=ref.PEAK_LR, betas=ref.OPT.betas, eps=ref.OPT.eps, weight_decay=ref.OPT.weight_decay,
            group_overrides=[OptimGroupOverride(params=["embeddings.weight"],
                                                opts=dict(weight_decay=0.0))])
        module = TransformerTrainModuleConfig(
            rank_microbatch_size=ref.MICRO * ref.T, max_sequence_length=ref.T, optim=optim,
        ).build(ref.oc_config().build(init_device="cpu"), device=torch.device("cpu"))
        state = Checkpointer(work_dir=str(tmp_path / "work")).load(exported, module,
                                                                   load_trainer_state=True)
        assert state["global_step"] == K
        assert state["data_loader"]["tokens_processed"] == K * ref.B * ref.T
        model, opt = _oc_load(folder / "model_and_optim")
        theirs = dict(module.model.named_parameters())
        for name, p in model.named_parameters():
            q = theirs[name]
            assert torch.equal(p, q), name
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][k], module.optim.state[q][k]), (name, k)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_step0_checkpoint_counts_adam_one_ahead(tmp_path):
    """OLMo-core's checkpointer saves before the first step (AI2's published ``stage1/step0`` is
    one); building the optimizer state for that save runs torch's ``_init_optim_state``, which
    leaves the moments at zero and every parameter's ``step`` at 1. olmax reads that count and then
    trains exactly as OLMo-core does with its checkpointer on; a fresh olmax optimizer (count 0)
    follows OLMo-core with its checkpointer off instead."""
    batches = ref.make_batches()[:M]
    params = init_params(ref.CFG, jax.random.key(3))
    torch.manual_seed(0)
    model = ref.oc_model(params)
    opt = ref.oc_optimizer(model)
    folder = tmp_path / "step0"
    folder.mkdir()
    _save_oc_checkpoint(folder, model, opt, 0)
    assert all(float(s["step"]) == 1.0 for s in opt.state.values())
    with_ckpt = ref.oc_steps(model, opt, batches)
    torch.manual_seed(0)
    model = ref.oc_model(params)
    without = ref.oc_steps(model, ref.oc_optimizer(model), batches)
    converted = convert_olmo_core_to_olmax(folder, tmp_path / "olmax", optim=ref.OPT, optimizer=skip_step_adamw)
    state, _ = _olmax_state(converted / "0")
    assert int(state.opt_state.inner[0].count) == 1
    _, ours = _olmax_steps(state, batches, first_step=1)
    _same_steps(ours, with_ckpt)
    _, fresh = _olmax_steps(init_train_state(params, skip_step_adamw(ref.OPT)), batches, 1)
    _same_steps(fresh, without)
    assert abs(with_ckpt[0][1] / without[0][1] - 1) > 1e-4     # the count shows from step 2 on
