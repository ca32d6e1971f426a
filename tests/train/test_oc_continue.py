"""Continuing an OLMo-core run whose data has token ids of its own, exports AI2's own tools read,
and soups that train: olmax against ai2-olmo-core 3.0.0 on CPU (its Trainer, ``load_keys``, the
merge of ``src/scripts/merge_core_checkpoints.py``, its HF conversion).

OLMo-core's ``Trainer`` (:mod:`helpers.oc_trainer`) trains a tiny OLMo 3 on token files written in
the ids of OLMo-core's ``TokenizerConfig(vocab_size=384, eos_token_id=383, pad_token_id=383)``: no
tokenizer file, not dolma2, with a planted loss spike (a batch of the rarest ids). It saves
``step0``, ``step2`` and ``step4`` (a hard stop at 4 of 8 steps), the skip rule active (a window of
4, 1 sigma). The olmax recipe names no tokenizer.

- resume: olmax continues ``step4`` with no override and trains OLMo-core's next 4 steps, the
  tokenizer taken from its ``config.json`` (and said so); a run that names other ids, other files
  or another sequence length is refused in one line, its run directory never created;
- export: olmax continues ``step4`` and checkpoints at 6 and 8. The export of 6 is OLMo-core's own
  ``step6`` key for key (DCP metadata, planner data, storage index, trainer state with the same
  dataset fingerprint, ``.metadata.json``, ``data_paths.txt``, ``config.json``); ``load_keys``
  loads every key; the merge script's merge of the exports of 6 and 8 is ``olmax merge``'s; its
  HF conversion of the export is olmax's checkpoint, bit for bit; its Trainer resumes the export
  with no override and trains the steps olmax trained next;
- soup: two OLMo-core checkpoints (two runs from one init on other data orders) averaged by
  ``olmax merge``, trained with a rolling window of 12, are OLMo-core's own soup (its merge
  script) trained by its Trainer; the soup converts both ways and ``olmax eval`` and ``olmax
  parity`` read it.

Each compared step (``helpers.oc_trainer.same_steps``): the same batch, CE loss within 1e-5
relative, grad norm within 1e-4, the same skipped steps.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import oc_trainer
from helpers import olmo_core as ref
from helpers.reference import require
from olmax.checkpoint.weights import load_meta, stored_arrays
from olmax.cli import main
from olmax.config import OptimConfig, to_dict
from olmax.data.instances import BatchPlan
from olmax.model.presets import get_preset

torch = require("torch")
require("olmo_core")

pytestmark = pytest.mark.slow

K, N = 4, 8
V = 384                  # OLMo-core TokenizerConfig(vocab_size=V, eos_token_id=V-1, pad_token_id=V-1)
EOS = PAD = V - 1
SEED = 11
WIDE = 128               # a skip window not filled yet: OLMo-core restarts its windows on a load
MODEL = get_preset("olmo3-tiny").replace(vocab_size=V, padded_vocab_size=V,
                                         window_pattern=(16, 16, 16, None), mlp_hidden=176,
                                         max_seq_len=64)
OPTIM = OptimConfig(lr=3e-3, rolling_interval_length=4, sigma_factor=1.0)
SOUP_SEED = 14           # the data order of the run from the soup: its 7th batch is the spike


@dataclass
class World:
    root: Path
    paths: list[str]
    recipe: Path
    runs: dict = field(default_factory=dict)     # OLMo-core's runs, by name

    def spec(self, name: str, **changes) -> dict:
        spec = dict(model=to_dict(MODEL), seq_len=32, global_batch_size=8, micro_batch_size=4,
                    optim=to_dict(OPTIM), warmup=2, alpha_f=0.1,
                    tokenizer=dict(vocab=V, eos=EOS, pad=PAD), paths=self.paths, seed=SEED,
                    save_folder=str(self.root / name), work_dir=str(self.root / "work"),
                    max_steps=N, save_interval=2, out=str(self.root / f"{name}.json"))
        spec.update(changes)
        return spec

    def olmo_core(self, name: str, **changes) -> dict:
        """OLMo-core's run ``name`` (made once)."""
        if name not in self.runs:
            self.runs[name] = oc_trainer.run(self.spec(name, **changes))
        return self.runs[name]

    def resumed(self) -> dict:
        """OLMo-core's Trainer resuming ``step4`` (it saves ``step6`` and ``step8``)."""
        return self.olmo_core("oc_resumed", load_path=str(self.step("oc", K)),
                              load_trainer_state=True, load_optim_state=True)

    def olmax(self, name: str, *overrides: str) -> list[dict]:
        return oc_trainer.olmax_train(self.recipe, self.root / name, *overrides)

    def step(self, run: str, step: int) -> Path:
        return self.root / run / f"step{step}"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("oc_continue")
    # the spike: the instances of the soup run's 7th batch (OLMo-core's order of 161 instances)
    spike = tuple(BatchPlan(3000 // 32 + 2200 // 32, 8, SOUP_SEED, 1, None).instance_ids(6))
    paths = oc_trainer.token_files(root, eos=EOS, top=EOS - 1, spike=spike)
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"preset": "olmo3-tiny", "vocab_size": V, "padded_vocab_size": V,
                  "window_pattern": [16, 16, 16, None], "mlp_hidden": 176, "max_seq_len": 64},
        "seed": SEED, "data": {"paths": paths},
        "train": {"seq_len": 32, "global_batch_size": 8, "micro_batch_size": 4, "max_steps": N},
        "optim": {"lr": 3e-3, "rolling_interval_length": 4, "sigma_factor": 1.0},
        "scheduler": {"name": "cos_with_warmup", "warmup_steps": 2},
        "checkpoint": {"interval": 100}, "logging": {"progress": False, "dashboard": False}}))
    w = World(root, paths, recipe)
    w.olmo_core("oc", hard_stop=K)
    return w


def _continue(world: World) -> list[str]:
    return [f"init.checkpoint={world.step('oc', K)}", "init.load_trainer_state=true",
            "init.load_optimizer=true"]


def test_resume_reads_the_data_in_the_checkpoints_token_ids(world, caplog):
    theirs = world.resumed()
    with caplog.at_level(logging.INFO, logger="olmax"):
        ours = world.olmax("resumed", *_continue(world))
    oc_trainer.same_steps(ours, theirs, list(range(K + 1, N + 1)))
    assert 1.0 in theirs["skipped"]   # the skip rule acts in the steps compared
    assert ("data.tokenizer is not set: the tokenizer of init.checkpoint, vocab_size 384, "
            "eos_token_id 383, pad_token_id 383, bos_token_id none ") in caplog.text
    recorded = yaml.safe_load((world.root / "resumed" / "config.yaml").read_text())
    assert recorded["data"]["tokenizer"] == {"vocab_size": V, "eos_token_id": EOS,
                                             "pad_token_id": PAD, "bos_token_id": None,
                                             "identifier": None}


@pytest.mark.parametrize("change, says", [
    ("data.tokenizer=gpt2",
     r"^data\.tokenizer \(gpt2\) has vocab_size 50257, eos_token_id 50256, pad_token_id 50256, "
     r"bos_token_id 50256, but init\.checkpoint was trained with vocab_size 384, eos_token_id "
     r"383, pad_token_id 383, bos_token_id none \(\S+/step4/config\.json dataset\.tokenizer\); "
     r"leave data\.tokenizer unset"),
    ("data.paths=[PART0]",
     r"^init\.checkpoint \S+/step4: dataset fingerprint mismatch: 1 file\(s\) removed, first: "
     r"part-1\.npy \(the checkpoint's data_paths\.txt\); the data order would change \(override "
     r"with data\.ignore_fingerprint_mismatch=true\)$"),
    ("train.seq_len=16",
     r"^init\.checkpoint \S+/step4: its data loader's sequence_length is 32, this run's "
     r"train\.seq_len 16; continuing it needs train\.seq_len=32$"),
])
def test_a_start_that_would_not_continue_it_is_refused_and_writes_nothing(world, capsys, change,
                                                                          says):
    import re

    run = world.root / f"refused-{change.split('=')[0]}"
    capsys.readouterr()
    rc = main(["train", str(world.recipe), "--run-dir", str(run), "--quiet", *_continue(world),
               change.replace("PART0", world.paths[0])])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    assert re.search(says, err[0].removeprefix("olmax train: error: ")), err[0]
    assert not run.exists()


def _dcp_layout(folder: Path) -> dict:
    """What OLMo-core's checkpointer writes into ``model_and_optim/.metadata``, key for key (not
    what differs from one save to another: file names, byte offsets, ids)."""
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata

    m = get_checkpoint_metadata(str(folder))
    return {"keys": list(m.state_dict_metadata),
            "entries": {k: repr(v) for k, v in m.state_dict_metadata.items()},
            "planner_data": m.planner_data,
            "index": sorted((i.fqn, None if i.offset is None else tuple(i.offset), i.index)
                            for i in m.storage_data),
            "storage_info": {type(v).__module__ + "." + type(v).__qualname__
                             for v in m.storage_data.values()},
            "fields": sorted(vars(m)), "version": m.version,
            "storage_meta": (sorted(vars(m.storage_meta)), m.storage_meta.modules)}


def _without_backend(d):
    if isinstance(d, dict):
        return {k: _without_backend(v) for k, v in d.items() if k != "backend"}
    return d


@pytest.fixture(scope="module")
def exported(world):
    """olmax continues ``step4`` (skip window 128 for the comparison across a load) and
    checkpoints at 6 and 8; both exported. ``(olmax's metrics lines, {step: export})``."""
    ours = world.olmax("to_export", *_continue(world), "checkpoint.interval=2",
                       f"optim.rolling_interval_length={WIDE}")
    exports = {}
    for step in (6, 8):
        exports[step] = world.root / f"export{step}"
        assert main(["convert", "olmax-to-olmo-core",
                     str(world.root / "to_export" / "checkpoints" / str(step)),
                     str(exports[step])]) == 0
    return ours, exports


def test_the_export_is_olmo_cores_own_layout(world, exported):
    world.resumed()
    _, exports = exported
    theirs, ours = world.step("oc_resumed", 6), exports[6]
    assert _dcp_layout(ours / "model_and_optim") == _dcp_layout(theirs / "model_and_optim")
    a = torch.load(theirs / "train" / "rank0.pt", weights_only=False)
    b = torch.load(ours / "train" / "rank0.pt", weights_only=False)
    assert set(a) == set(b)
    assert b["data_loader"] == a["data_loader"]          # OLMo-core's fingerprint, position, seed
    for key in ("global_step", "global_train_tokens_seen", "max_steps", "epoch", "world_size"):
        assert b[key] == a[key], key
    for name in (".metadata.json", "data_paths.txt"):
        assert (ours / name).read_text() == (theirs / name).read_text(), name
    config_a = json.loads((theirs / "config.json").read_text())
    config_b = json.loads((ours / "config.json").read_text())
    assert config_b["model"] == _without_backend(config_a["model"])   # OLMo-core's default backend
    assert config_b["dataset"]["tokenizer"] == config_a["dataset"]["tokenizer"]


def test_load_keys_reads_every_key_of_the_export(world, exported):
    """``load_keys`` (OLMo-core's key-by-key reader, which its scripts use) gives every key: each
    tensor as the DCP loader of its merge script reads it (``load_state_dict``), each
    param-group setting as OLMo-core's own checkpoint of that step holds it."""
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata, load_keys, load_state_dict
    from torch.distributed.checkpoint import TensorStorageMetadata

    _, exports = exported
    folder = str(exports[6] / "model_and_optim")
    meta = get_checkpoint_metadata(folder)
    keys = list(meta.state_dict_metadata)
    values = dict(zip(keys, load_keys(folder, keys)))
    tensors = {k: torch.empty(tuple(m.size)) for k, m in meta.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)}
    load_state_dict(folder, tensors)
    for key, t in tensors.items():
        assert torch.equal(values[key], t), key
    world.resumed()
    theirs = str(world.step("oc_resumed", 6) / "model_and_optim")
    settings = [k for k in keys if k.startswith("optim.param_groups.") and not k.endswith(".lr")]
    for key, value in zip(settings, load_keys(theirs, settings)):
        assert values[key] == value, key


def test_the_merge_script_merges_the_exports_as_olmax_merge(world, exported, tmp_path):
    """The merge of ``merge_core_checkpoints.py`` (its ``get_checkpoint_metadata``,
    ``load_state_dict`` and ``save_state_dict``) of the exports of 6 and 8 is ``olmax merge`` of the
    two checkpoints, exported: every tensor bit for bit (fp32 sums of halves in input order), Adam's
    step too (6 and 8 applied steps past the import: an integral mean)."""
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata, load_keys

    _, exports = exported
    ref.merge_core_checkpoints([exports[6], exports[8]], tmp_path / "script")
    steps = [str(world.root / "to_export" / "checkpoints" / str(s)) for s in (6, 8)]
    assert main(["merge", *steps, "--out", str(tmp_path / "soup")]) == 0
    assert main(["convert", "olmax-to-olmo-core", str(tmp_path / "soup"),
                 str(tmp_path / "soup-oc")]) == 0
    a, b = (str(tmp_path / name / "model_and_optim") for name in ("script", "soup-oc"))
    keys = list(get_checkpoint_metadata(a).state_dict_metadata)
    assert set(keys) == set(get_checkpoint_metadata(b).state_dict_metadata)
    for key, x, y in zip(keys, load_keys(a, keys), load_keys(b, keys)):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        elif not key.endswith(".lr"):
            assert x == y, key


def test_olmo_cores_trainer_resumes_the_export(world, exported):
    """No fingerprint override: the export's data-loader state is what OLMo-core computes."""
    ours, exports = exported
    wide = dict(to_dict(OPTIM), rolling_interval_length=WIDE)
    theirs = world.olmo_core("oc_from_export", load_path=str(exports[6]), optim=wide,
                             load_trainer_state=True, load_optim_state=True)
    oc_trainer.same_steps(ours[2:], theirs, [7, 8])


def _word_tokenizer(folder: Path) -> Path:
    """A tokenizer.json of the data's ``V`` ids, ``<|endoftext|>`` at ``EOS`` (OLMo-core's HF
    conversion exports a tokenizer with the checkpoint)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(EOS)}
    vocab["<|endoftext|>"] = EOS
    folder.mkdir()
    tok = Tokenizer(WordLevel(vocab, unk_token="t1"))
    tok.add_special_tokens(["<|endoftext|>"])     # as tokenizer_config.json declares it
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    return folder


def test_olmo_cores_hf_conversion_of_the_export_is_olmaxs_checkpoint(world, exported, tmp_path):
    """``convert_checkpoint_to_hf`` (validating its HF model against its own) on the export, then
    olmax's HF import: every weight of olmax's checkpoint, bit for bit."""
    require("transformers")
    from olmo_core.config import DType
    from olmo_core.nn.hf.convert_checkpoint import convert_checkpoint_to_hf

    _, exports = exported
    config = json.loads((exports[6] / "config.json").read_text())
    convert_checkpoint_to_hf(str(exports[6]), tmp_path / "hf", config["model"],
                             config["dataset"]["tokenizer"], dtype=DType.float32,
                             tokenizer_id=str(_word_tokenizer(tmp_path / "tok")),
                             max_sequence_length=MODEL.max_seq_len, validate=True)
    assert main(["convert", "hf-to-olmax", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back, _ = stored_arrays(tmp_path / "back")
    ours, _ = stored_arrays(world.root / "to_export" / "checkpoints" / "6")
    flat_back = dict(_leaves(back))
    for name, leaf in _leaves(ours):
        assert np.array_equal(leaf[...], flat_back[name][...]), name


def _leaves(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.fixture(scope="module")
def soup(world):
    """Two OLMo-core runs from one init (its Trainer seeds the model alike) on two data orders,
    each checkpointed at step 2, averaged by ``olmax merge``. ``(the soup, the two
    ingredients)``."""
    world.olmo_core("oc_b", hard_stop=2, seed=SEED + 1)
    ingredients = [world.step("oc", 2), world.step("oc_b", 2)]
    out = world.root / "soup"
    assert main(["merge", *map(str, ingredients), "--out", str(out)]) == 0
    return out, ingredients


def test_a_soup_of_olmo_core_checkpoints_trains_as_olmo_cores_own(world, soup, tmp_path):
    """A window of 12 (the soup's optimizer state was made for OLMo-core's 128; the windows
    restart empty, as OLMo-core's do), the data in a third order; 8 steps, the skip rule acting
    from the 7th, whose batch holds the spike."""
    out, ingredients = soup
    counts = [1 + sum(1 for s in world.runs[run]["skipped"][:2] if not s)   # step0's save counts 1
              for run in ("oc", "oc_b")]
    assert counts[0] == counts[1]       # an integral mean: olmax keeps one count, OLMo-core a float
    made = load_meta(out)["merge"]["inputs"]
    assert [(m["kind"], m["step"], m["adam_count"]) for m in made] == \
        [("olmo-core", 2, c) for c in counts]
    window = dict(to_dict(OPTIM), rolling_interval_length=12)
    ref.merge_core_checkpoints(ingredients, tmp_path / "oc-soup")
    theirs = world.olmo_core("oc_from_soup", load_path=str(tmp_path / "oc-soup"), optim=window,
                             load_trainer_state=False, load_optim_state=True, seed=SOUP_SEED)
    ours = world.olmax("from_soup", f"init.checkpoint={out}", "init.load_optimizer=true",
                       "optim.rolling_interval_length=12", f"seed={SOUP_SEED}")
    oc_trainer.same_steps(ours, theirs, list(range(1, N + 1)))
    assert theirs["skipped"][6] == 1.0      # the window of 12, full enough at step 7, skips it


def test_a_soup_is_a_checkpoint_every_command_takes(world, soup, tmp_path):
    """``convert`` both ways (OLMo-core and back bit for bit; HF), ``eval`` (its held-out data
    read in the soup's token ids) and ``parity`` against its HF export."""
    out, _ = soup
    oc = tmp_path / "oc"
    assert main(["convert", "olmax-to-olmo-core", str(out), str(oc)]) == 0
    assert main(["convert", "olmo-core-to-olmax", str(oc), str(tmp_path / "back")]) == 0
    a, _ = stored_arrays(out)
    b, _ = stored_arrays(tmp_path / "back")
    flat = dict(_leaves(b))
    for name, leaf in _leaves(a):
        assert np.array_equal(leaf[...], flat[name][...]), name
    assert main(["convert", "olmax-to-hf", str(out), str(tmp_path / "hf")]) == 0
    report = tmp_path / "eval.json"
    assert main(["eval", str(out), "--heldout", world.paths[1], "--json", str(report)]) == 0
    heldout = json.loads(report.read_text())["heldout"]
    assert all(np.isfinite(r["CE loss"]) for r in heldout.values()), heldout
    require("transformers")
    assert main(["parity", str(tmp_path / "hf"), "--checkpoint", str(out), "--seq-len", "32",
                 "--json", str(tmp_path / "parity.json")]) == 0
    parity = json.loads((tmp_path / "parity.json").read_text())
    assert parity["top1_agreement"] == 1.0, parity
