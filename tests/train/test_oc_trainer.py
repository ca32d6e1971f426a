"""olmax against OLMo-core's own ``Trainer`` (ai2-olmo-core 3.0.0 on CPU) at AI2's settings.

:mod:`helpers.oc_trainer` runs ``Trainer.fit()`` as AI2's official OLMo 3 scripts configure it: a
``CheckpointerCallback`` (a ``step0`` save before training, then every 2 steps), a
``ConfigSaverCallback`` (``config.json`` in every checkpoint), SkipStepAdamW, ``CosWithWarmup``,
z-loss, clipping, a ``NumpyFSLDataLoader``. A tiny OLMo 3 (1024-row vocabulary) trains on two token
files with a 1000-token word-level tokenizer that both sides read (so OLMo-core's dataset
fingerprint is the one olmax computes). The skip rule is active after 2 recorded steps (a window
of 4, 1 sigma), so skipped steps are part of what is compared.

OLMo-core trains K steps of a K + M step run (hard stop at K). Then, each step compared: CE loss
within 1e-5 relative, grad norm within 1e-4, the same skipped steps, the same batch (sha256 of
its token ids):

- resume: a fresh OLMo-core Trainer loads ``stepK`` with ``load_trainer_state=True`` and trains M
  more steps; olmax from the same folder with ``init.load_trainer_state=true
  init.load_optimizer=true`` runs the same M steps;
- warm start: the same with ``load_trainer_state=False`` and a new data seed (step, data and
  schedule restart, Adam's state carried);
- Adam's count at AI2's settings: the ``step0`` save leaves every parameter's ``step`` at 1, so
  OLMo-core's first K steps are olmax's from ``step0``'s weights with a fresh optimizer only with
  ``optim.initial_adam_count=1`` (the stage-1 recipes' setting);
- export: olmax continues, its checkpoint goes through ``olmax convert olmax-to-olmo-core``, and
  OLMo-core's Trainer resumes the export for the steps olmax trained next;
- world size 2: OLMo-core trains with FSDP over 2 gloo processes (every tensor saved in 2 chunks)
  and resumes in 2 processes; olmax, in one process, continues the 2-chunk checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import oc_trainer
from helpers.reference import require
from olmax.cli import main
from olmax.config import OptimConfig, to_dict
from olmax.interop.olmo_core.checkpoint import OLMoCoreCheckpoint
from olmax.model.presets import get_preset

require("torch")
require("olmo_core")

K, M = 4, 4
SEED = 11
VOCAB, EOS, PAD = 1000, 0, 999
MODEL = get_preset("olmo3-tiny").replace(vocab_size=VOCAB, padded_vocab_size=1024,
                                         window_pattern=(16, 16, 16, None), mlp_hidden=176,
                                         max_seq_len=64)
OPTIM = OptimConfig(lr=3e-3, rolling_interval_length=4, sigma_factor=1.0)

pytestmark = pytest.mark.slow


@dataclass
class World:
    root: Path
    paths: list[str]
    recipe: Path
    first: dict          # OLMo-core's first K steps (and its checkpoints step0, step2, stepK)

    def spec(self, name: str, **changes) -> dict:
        spec = dict(model=to_dict(MODEL), seq_len=32, global_batch_size=8, micro_batch_size=4,
                    optim=to_dict(OPTIM), warmup=2, alpha_f=0.1,
                    tokenizer=dict(vocab=VOCAB, eos=EOS, pad=PAD), paths=self.paths, seed=SEED,
                    save_folder=str(self.root / name), work_dir=str(self.root / "work"),
                    max_steps=K + M, save_interval=2, out=str(self.root / f"{name}.json"))
        spec.update(changes)
        return spec


def _tokenizer(folder: Path) -> None:
    """A word-level tokenizer of ``VOCAB`` ids: EOS 0, pad 999, as OLMo-core's dataset is told."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<|endoftext|>"] = vocab.pop("t0")
    vocab["<|pad|>"] = vocab.pop(f"t{PAD}")
    folder.mkdir()
    Tokenizer(WordLevel(vocab, unk_token="t1")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("oc_trainer")
    paths = oc_trainer.token_files(root, eos=EOS, top=998)
    _tokenizer(root / "tok")
    recipe = root / "tiny.yaml"
    recipe.write_text(f"""
model:
  preset: olmo3-tiny
  vocab_size: {VOCAB}
  padded_vocab_size: 1024
  window_pattern: [16, 16, 16, null]
  mlp_hidden: 176
  max_seq_len: 64
seed: {SEED}
data:
  paths: {paths}
  tokenizer: {root / 'tok'}
train:
  seq_len: 32
  global_batch_size: 8
  micro_batch_size: 4
  max_steps: {K + M}
optim:
  lr: 3.0e-3
  rolling_interval_length: 4
  sigma_factor: 1.0
scheduler:
  name: cos_with_warmup
  warmup_steps: 2
checkpoint:
  interval: 100
logging:
  progress: false
""")
    w = World(root, paths, recipe, {})
    w.first = oc_trainer.run(w.spec("oc", hard_stop=K))
    return w


def _olmax(world: World, name: str, *overrides: str) -> list[dict]:
    return oc_trainer.olmax_train(world.recipe, world.root / name, *overrides)


_same = oc_trainer.same_steps


def test_olmo_cores_checkpoints_count_adam_from_one(world):
    """``step0`` holds Adam's ``step`` 1 (the save's zero step); ``stepK`` one more per applied
    step. Read by olmax's own reader (no torch)."""
    folder = world.root / "oc"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step")) == \
        ["step0", "step2", f"step{K}"]
    assert OLMoCoreCheckpoint(folder / "step0").adam_count(MODEL) == 1
    applied = sum(1 for s in world.first["skipped"] if not s)
    assert OLMoCoreCheckpoint(folder / f"step{K}").adam_count(MODEL) == 1 + applied
    assert OLMoCoreCheckpoint(folder / f"step{K}").step_increment_bugfix() is True


def test_resume_continues_olmo_cores_trainer(world):
    start = world.root / "oc" / f"step{K}"
    theirs = oc_trainer.run(world.spec("oc_resumed", load_path=str(start), load_trainer_state=True,
                                       load_optim_state=True))
    ours = _olmax(world, "resumed", f"init.checkpoint={start}", "init.load_trainer_state=true",
                  "init.load_optimizer=true")
    _same(ours, theirs, list(range(K + 1, K + M + 1)))
    assert 1.0 in theirs["skipped"]   # the skip rule acts in the steps compared


def test_warm_start_from_olmo_cores_trainer(world):
    start = world.root / "oc" / f"step{K}"
    theirs = oc_trainer.run(world.spec("oc_warm", load_path=str(start), load_trainer_state=False,
                                       load_optim_state=True, seed=SEED + 1, max_steps=M))
    ours = _olmax(world, "warm", f"init.checkpoint={start}", "init.load_optimizer=true",
                  f"seed={SEED + 1}", f"train.max_steps={M}")
    _same(ours, theirs, list(range(1, M + 1)))


def test_a_fresh_start_counts_adam_as_ai2s_runs(world):
    """AI2's runs started with a ``step0`` save, so Adam's first bias correction counts 2: olmax
    from the same weights with a fresh optimizer is OLMo-core's run with
    ``optim.initial_adam_count=1``, and not with 0."""
    start = world.root / "oc" / "step0"
    common = [f"init.checkpoint={start}", f"train.hard_stop={K}"]
    ours = _olmax(world, "fresh1", *common, "optim.initial_adam_count=1")
    _same(ours, world.first, list(range(1, K + 1)))
    plain = _olmax(world, "fresh0", *common)
    assert max(abs(a["loss"] / b - 1) for a, b in zip(plain, world.first["losses"])) > 1e-4


def test_olmo_cores_trainer_resumes_an_olmax_export(world):
    """olmax continues OLMo-core's run and checkpoints at K + 2; OLMo-core's Trainer resumes the
    export and trains the steps olmax trained next. Both with the skip rule's window of 128 (not
    active yet): OLMo-core restarts its windows on every load, olmax's checkpoints keep them."""
    start = world.root / "oc" / f"step{K}"
    wide = dict(to_dict(OPTIM), rolling_interval_length=128)
    ours = _olmax(world, "to_export", f"init.checkpoint={start}", "init.load_trainer_state=true",
                  "init.load_optimizer=true", "checkpoint.interval=2",
                  "optim.rolling_interval_length=128")
    export = world.root / f"export{K + 2}"
    step_dir = world.root / "to_export" / "checkpoints" / str(K + 2)
    assert main(["convert", "olmax-to-olmo-core", str(step_dir), str(export)]) == 0
    theirs = oc_trainer.run(world.spec("oc_from_export", load_path=str(export), optim=wide,
                                       load_trainer_state=True, load_optim_state=True))
    _same(ours[2:], theirs, list(range(K + 3, K + M + 1)))


@pytest.mark.own_unit
def test_world_size_2_checkpoints_continue_in_olmax(world):
    first = oc_trainer.run(world.spec("oc2", hard_stop=K), world_size=2)
    start = world.root / "oc2" / f"step{K}"
    chunks = OLMoCoreCheckpoint(start).dcp.meta.tensors["model.embeddings.weight"].chunks
    assert len(chunks) == 2
    theirs = oc_trainer.run(world.spec("oc2_resumed", load_path=str(start),
                                       load_trainer_state=True, load_optim_state=True),
                            world_size=2)
    _same(_olmax(world, "resumed2", f"init.checkpoint={start}", "init.load_trainer_state=true",
                 "init.load_optimizer=true"), theirs, list(range(K + 1, K + M + 1)))
    assert first["steps"] == list(range(1, K + 1))
