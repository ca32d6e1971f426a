"""The torch-free OLMo-core checkpoint reader and writer, and ``olmax convert``'s bad input.

A tiny olmax training state is exported in OLMo-core's layout by olmax's own writer (OLMo-core
itself reads such exports in ``tests/train/test_oc_checkpoints.py``); here it is read back from
disk and from a loopback HTTP server (the file list from ``.metadata``; HTTP folders cannot be
listed), and broken in each way the issue lists: one line, exit 2, nothing written.
"""

import pickle

import jax
import numpy as np
import pytest

from helpers.olmo_core import oc_state_dict
from helpers.remote_servers import file_server
from helpers.tiny import tiny_cfg
from olmax.checkpoint.weights import load_meta, load_params, save_train_state
from helpers.cli import refused_in_one_line
from olmax.cli import main
from olmax.config import OptimConfig, to_dict
from olmax.errors import OlmaxError
from olmax.interop.olmo_core import pickles
from olmax.interop.olmo_core.checkpoint import OLMoCoreCheckpoint
from olmax.interop.olmo_core.convert import olmax_opt_state
from olmax.train.optim import skip_step_adamw
from olmax.interop.olmo_core.pickles import DCP_META, Call, Global, New, Pairs
from olmax.model.params import init_params

CFG = tiny_cfg()
STEP, COUNT, SEED = 5, 4, 3


@pytest.fixture
def exported(tmp_path):
    """An olmax step (params, Adam moments, count) and its OLMo-core export."""
    params = jax.tree.map(np.asarray, init_params(CFG, jax.random.key(1)))
    mu = jax.tree.map(lambda p: p * 0.5, params)
    nu = jax.tree.map(lambda p: p * p, params)
    opt = olmax_opt_state(skip_step_adamw(OptimConfig()), mu, nu, COUNT)
    meta = {"optim": to_dict(OptimConfig()), "data_position": STEP, "seed": SEED,
            "config": {"train": {"global_batch_size": 2, "seq_len": 8}}}
    ckpt = save_train_state(tmp_path / "olmax", STEP, params, opt, CFG, extra_meta=meta)
    folder = tmp_path / "oc"
    assert main(["convert", "olmax-to-olmo-core", str(ckpt), str(folder)]) == 0
    return params, mu, nu, folder


def test_reads_what_was_written(exported, tmp_path):
    params, mu, nu, folder = exported
    ck = OLMoCoreCheckpoint(folder)
    assert ck.full and ck.has_optimizer and ck.model_config() == CFG.replace(max_seq_len=8192)
    assert ck.adam_count(CFG) == COUNT
    trainer = ck.trainer_state()
    assert (trainer.global_step, trainer.seed, trainer.data_position(16)) == (STEP, SEED, STEP)
    for kind, tree in (("model", params), ("exp_avg", mu), ("exp_avg_sq", nu)):
        for name, want in oc_state_dict(tree, CFG).items():
            key = f"model.{name}" if kind == "model" else f"optim.state.{name}.{kind}"
            assert ck.dcp.tensor(key).tobytes() == want.tobytes(), key
    out = tmp_path / "back"
    assert main(["convert", "olmo-core-to-olmax", str(folder), str(out)]) == 0
    back, _ = load_params(out)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        assert np.asarray(a).tobytes() == b.tobytes()
    assert load_meta(out)["step"] == STEP


def test_reads_over_http_from_the_metadata_file_list(exported, tmp_path):
    params, _, _, folder = exported
    files = {"/ck/" + str(p.relative_to(folder)): p.read_bytes()
             for p in folder.rglob("*") if p.is_file()}
    with file_server(files) as srv:
        out = tmp_path / "from_http"
        assert main(["convert", "olmo-core-to-olmax", f"{srv.url}/ck", str(out),
                     "--weights-only"]) == 0
        asked = {path for _, path, _ in srv.log}
    back, _ = load_params(out)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        assert np.asarray(a).tobytes() == b.tobytes()
    assert "/ck/model_and_optim/__0_0.distcp" in asked   # named by .metadata, never listed


def _fails(capsys, argv, needle, out):
    refused_in_one_line(capsys, argv, needle)
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))


def _metadata(chunks, stored):
    """A DCP ``.metadata`` of one [4, 2] tensor ``model.x`` with ``chunks`` (offsets, sizes) of
    which those in ``stored`` have a data location."""
    size = lambda t: Call(Global("torch", "Size"), (tuple(t),))  # noqa: E731
    props = New(Global(DCP_META, "TensorProperties"), (),
                (Global("torch", "float32"), "torch.strided", False, 0, False))
    meta = New(Global(DCP_META, "TensorStorageMetadata"), (), {
        "properties": props, "size": size((4, 2)),
        "chunks": [New(Global(DCP_META, "ChunkStorageMetadata"), (),
                       {"offsets": size(o), "sizes": size(s)}) for o, s in chunks]})
    storage = Pairs(tuple(
        (New(Global(DCP_META, "MetadataIndex"), (), {"fqn": "model.x", "offset": size(o), "index": 0}),
         New(Global("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"), (),
             {"relative_path": "__0_0.distcp", "offset": 0, "length": 10}))
        for o, _ in stored))
    return pickles.dumps(New(Global(DCP_META, "Metadata"), (),
                             {"state_dict_metadata": {"model.x": meta}, "storage_data": storage}))


def test_bad_checkpoints_are_one_line(exported, tmp_path, capsys):
    _, _, _, folder = exported
    out = tmp_path / "out"
    convert = ["convert", "olmo-core-to-olmax"]
    data = folder / "model_and_optim" / "__0_0.distcp"
    metadata = folder / "model_and_optim" / ".metadata"
    good_data, good_meta = data.read_bytes(), metadata.read_bytes()

    data.write_bytes(good_data[:-1000])
    _fails(capsys, convert + [str(folder), str(out)], "truncated", out)
    data.unlink()
    _fails(capsys, convert + [str(folder), str(out)], "__0_0.distcp: missing", out)
    data.write_bytes(good_data)

    metadata.write_bytes(pickle.dumps(Global("os", "system"), protocol=2)[:2]
                         + b"cos\nsystem\n(S'true'\ntR.")
    _fails(capsys, convert + [str(folder), str(out)], "names os.system", out)
    rows = [((0, 0), (2, 2)), ((2, 0), (2, 2))]
    metadata.write_bytes(_metadata(rows, rows[:1]))
    _fails(capsys, convert + [str(folder), str(out)], "missing chunk", out)
    metadata.write_bytes(_metadata(rows[:1], rows[:1]))
    _fails(capsys, convert + [str(folder), str(out)], "missing chunk", out)
    metadata.write_bytes(good_meta)

    weights = tmp_path / "weights"
    assert main(["convert", "olmax-to-olmo-core", str(tmp_path / "olmax"), str(weights),
                 "--weights-only"]) == 0
    _fails(capsys, convert + [str(weights), str(out)], "no config.json", out)
    (weights / "config.json").write_text((folder / "config.json").read_text())
    _fails(capsys, convert + [str(weights), str(out)], "holds no optimizer state", out)

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  preset: olmo3-tiny\ntrain:\n  seq_len: 8\n")
    _fails(capsys, convert + [str(folder), str(out), "--recipe", str(recipe)], "d_model", out)
    fields = ", ".join(f"{k}: {v}" for k, v in {
        "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8,
        "mlp_hidden": 64, "vocab_size": 100, "padded_vocab_size": 128}.items())
    recipe.write_text(f"model: {{{fields}, window_pattern: [8, null]}}\n"
                      "train:\n  seq_len: 8\noptim:\n  betas: [0.9, 0.99]\n")
    _fails(capsys, convert + [str(folder), str(out), "--recipe", str(recipe)], "betas", out)


def test_blocks_read_in_pieces(exported, monkeypatch):
    """Any block of any leaf, its OLMo-core rows read a few at a time (the embedding's rows; the
    LM head's, which are its columns in olmax's layout)."""
    from olmax.interop.olmo_core import checkpoint

    params, mu, _, folder = exported
    monkeypatch.setattr(checkpoint, "PIECE_BYTES", 3 * 4 * CFG.d_model)   # 3 rows at a time
    ck = OLMoCoreCheckpoint(folder)
    for kind, want in (("model", params), ("exp_avg", mu)):
        tree = ck.tree(CFG, kind)
        for name in ("embed", "lm_head", "final_norm"):
            leaf, full = tree[name], want[name]
            index = (slice(5, 77),) + (slice(3, 29),) * (full.ndim - 1)
            np.testing.assert_array_equal(leaf.read(index), full[index])
            np.testing.assert_array_equal(leaf.read(), full)
        index = (slice(1, 2), slice(4, 20), slice(0, 9))
        np.testing.assert_array_equal(tree["layers"]["q_proj"].read(index),
                                      want["layers"]["q_proj"][index])


def _leaf_paths(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaf_paths(v, prefix + (k,))
        else:
            yield prefix + (k,)


def _oc_config_with_yarn():
    from olmax.config import YarnConfig
    from olmax.interop.olmo_core.convert import olmo_core_config

    cfg = CFG.replace(rope_scaling=YarnConfig(factor=8.0, original_max_position_embeddings=64))
    return cfg, olmo_core_config(cfg, None)


OC_BOUNDARY = [0, -1, 0.5, float("nan"), float("inf"), 10**30, "", "8", None, True, [], {}]


@pytest.mark.parametrize("path", sorted(".".join(p) for p in _leaf_paths(_oc_config_with_yarn()[1])))
def test_every_olmo_core_config_key_imports_cleanly_or_is_refused_in_one_line(path):
    """``config.json`` of an OLMo-core checkpoint is checked by the rules a recipe's values are: a
    boundary value either imports into a ModelConfig that passed them or is one OlmaxError line
    naming the file, never another exception and never a silent truncation (0.5 layers)."""
    import copy

    from olmax.errors import OlmaxError
    from olmax.interop.olmo_core.checkpoint import model_config_from_olmo_core

    cfg, base = _oc_config_with_yarn()
    imported = model_config_from_olmo_core(base, "config.json")
    assert imported == cfg.replace(max_seq_len=imported.max_seq_len)   # config.json has no length
    keys = path.split(".")
    for value in OC_BOUNDARY:
        config = copy.deepcopy(base)
        node = config
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        try:
            got = model_config_from_olmo_core(config, "config.json")
        except OlmaxError as e:
            assert "\n" not in str(e) and str(e).startswith("config.json: "), (path, value, e)
            continue
        if isinstance(value, float) and not value.is_integer():
            for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
                         "vocab_size", "padded_vocab_size"):
                assert getattr(got, name) == getattr(cfg, name), (path, value, name)


# ----------------------------------------------------------------------------------------------
# What is read is checked: CRC-32s, the trainer state, finite values


def _flip(path, offset, n=8):
    """``n`` bytes of ``path`` inverted at ``offset``: the same size, other bytes."""
    data = bytearray(path.read_bytes())
    data[offset:offset + n] = bytes(b ^ 0xFF for b in data[offset:offset + n])
    path.write_bytes(bytes(data))


def _chunk(folder, key):
    from olmax.interop.olmo_core.dcp import DcpReader, Files

    at = DcpReader(Files(str(folder / "model_and_optim"))).meta.tensors[key].chunks[0].at
    return folder / "model_and_optim" / at.file, at


def test_damaged_bytes_fail_their_crc_as_they_are_read(exported, tmp_path, capsys, monkeypatch):
    """8 flipped bytes of the embedding's chunk (same size) or of ``rank0.pt``: refused naming
    the file and the entry, nothing written; read in pieces (3 rows at a time) the same."""
    import shutil

    from olmax.interop.olmo_core import checkpoint

    params, _, _, folder = exported
    out = tmp_path / "out"
    for damaged in ("model", "trainer"):
        copy = tmp_path / f"oc-{damaged}"
        shutil.copytree(folder, copy)
        if damaged == "model":
            path, at = _chunk(copy, "model.embeddings.weight")
            _flip(path, at.offset + at.length // 2)
        else:
            _flip(copy / "train" / "rank0.pt", 100)
        _fails(capsys, ["convert", "olmo-core-to-olmax", str(copy), str(out)],
               "fails its CRC-32 check", out)
    monkeypatch.setattr(checkpoint, "PIECE_BYTES", 3 * 4 * CFG.d_model)
    with pytest.raises(OlmaxError, match=r"__0_0.distcp \(model.embeddings.weight\): entry "
                                         r"archive/data/0 fails its CRC-32 check"):
        OLMoCoreCheckpoint(tmp_path / "oc-model").tree(CFG)["embed"].read()
    # every entry an import reads is checked, the embedding's read in pieces included
    ck = OLMoCoreCheckpoint(folder)
    for kind in ("model", "exp_avg"):
        for name, leaf in ck.tree(CFG, kind).items():
            if name != "layers":
                leaf.read()
    assert ck.dcp.crcs.unchecked() == [] and len(ck.dcp.crcs._state) > 0


def test_without_a_trainer_state_an_import_is_a_warm_start_only(exported, tmp_path, capsys):
    """No ``train/rank0.pt`` (or a link loop there): never the step of Adam's count. The import
    is step 0 and says what it cannot know; continuing it is refused; a loop is named."""
    import shutil

    _, _, _, folder = exported
    bare = tmp_path / "step5"
    shutil.copytree(folder, bare)
    (bare / "train" / "rank0.pt").unlink()
    out = tmp_path / "imported"
    capsys.readouterr()
    assert main(["convert", "olmo-core-to-olmax", str(bare), str(out)]) == 0
    err = capsys.readouterr().err
    meta = load_meta(out)
    assert meta["step"] == 0 and COUNT != 0 and "data_position" not in meta
    assert "has no train/rank0.pt: its step, data position and seed are unknown" in err
    assert meta["warm_start_only"] in err
    loop = tmp_path / "loop"
    shutil.copytree(folder, loop)
    (loop / "train" / "rank0.pt").unlink()
    (loop / "train" / "rank0.pt").symlink_to("rank0.pt")
    _fails(capsys, ["convert", "olmo-core-to-olmax", str(loop), str(tmp_path / "o2")],
           "train/rank0.pt: not a readable file (a directory, a broken link or a link loop)", tmp_path / "o2")
    tokens = tmp_path / "tokens.npy"
    np.random.default_rng(0).integers(0, 100, 4096).astype("<u4").tofile(tokens)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data: {{paths: [{tokens}]}}\ntrain: {{seq_len: 8, global_batch_size: 2, "
                      f"max_steps: 6}}\nseed: {SEED}\n")
    for init in (f"init.checkpoint={out}", f"init.checkpoint={bare}"):
        run = tmp_path / f"run-{len(init)}"
        refused_in_one_line(capsys, ["train", str(recipe), "--run-dir", str(run), init,
                                     "init.load_optimizer=true", "init.load_trainer_state=true"],
                            "init.load_trainer_state=true: init.checkpoint ")
        assert not run.exists()
    # with the trainer state, the step, data position and seed are the run's
    with_state = tmp_path / "with-state"
    assert main(["convert", "olmo-core-to-olmax", str(folder), str(with_state)]) == 0
    meta = load_meta(with_state)
    assert (meta["step"], meta["data_position"], meta["seed"]) == (STEP, STEP, SEED)
    assert "warm_start_only" not in meta


def test_non_finite_olmo_core_weights_are_refused_on_every_path(exported, tmp_path, capsys):
    """A NaN in an OLMo-core checkpoint's weights: convert, merge and init.checkpoint refuse it
    by name, as they refuse HF and olmax inputs."""
    import shutil

    from olmax.interop.olmo_core.torch_zip import Archive

    _, _, _, folder = exported
    bad = tmp_path / "oc-nan"
    shutil.copytree(folder, bad)
    path, at = _chunk(bad, "model.blocks.1.feed_forward.w1.weight")
    archive = Archive(lambda o, n: path.read_bytes()[at.offset + o:at.offset + o + n], at.length,
                      str(path))
    start = at.offset + archive.data_offset("archive/data/0") + 4 * 5
    data = bytearray(path.read_bytes())
    data[start:start + 4] = np.float32(np.nan).tobytes()
    path.write_bytes(bytes(data))
    # the CRC catches the change first; a NaN stored with its CRC is what a diverged run writes
    _fails(capsys, ["convert", "olmo-core-to-olmax", str(bad), str(tmp_path / "o")],
           "fails its CRC-32 check", tmp_path / "o")
    import zlib

    entry = archive.entries["archive/data/0"]
    crc = zlib.crc32(bytes(data[at.offset + archive.data_offset("archive/data/0"):][:entry.size]))
    central = bytes(data).rfind(b"archive/data/0", at.offset, at.offset + at.length) - 46
    data[central + 16:central + 20] = crc.to_bytes(4, "little")
    local = at.offset + entry.header_offset
    data[local + 14:local + 18] = crc.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    needle = "non-finite weights in 1 tensor(s): model.blocks.1.feed_forward.w1.weight (1 NaN)"
    _fails(capsys, ["convert", "olmo-core-to-olmax", str(bad), str(tmp_path / "o")], needle,
           tmp_path / "o")
    _fails(capsys, ["merge", str(folder), str(bad), "--out", str(tmp_path / "m")], needle,
           tmp_path / "m")
    tokens = tmp_path / "tokens.npy"
    np.random.default_rng(0).integers(0, 100, 4096).astype("<u4").tofile(tokens)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data: {{paths: [{tokens}]}}\ntrain: {{seq_len: 8, global_batch_size: 2, "
                      f"max_steps: 6}}\n")
    refused_in_one_line(capsys, ["train", str(recipe), "--run-dir", str(tmp_path / "run"),
                                 f"init.checkpoint={bad}"], needle)


def test_eval_and_parity_read_an_olmo_core_checkpoint_as_its_import(exported, tmp_path):
    """``olmax eval`` (and ``olmax parity --checkpoint``) read an OLMo-core checkpoint in place:
    the same model, weights and softmax vocabulary as its olmax import, every tensor checked as
    it is read (a damaged chunk is refused as by ``convert``)."""
    import shutil

    from olmax.eval.runner import load_model

    _, _, _, folder = exported
    imported = tmp_path / "imported"
    assert main(["convert", "olmo-core-to-olmax", str(folder), str(imported), "--weights-only"]) == 0
    a, b = load_model(folder), load_model(imported)
    assert (a.cfg, a.softmax_vocab, a.source) == (b.cfg, b.softmax_vocab, "olmo-core")
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    path, at = _chunk(damaged, "model.lm_head.w_out.weight")
    _flip(path, at.offset + at.length // 2)
    with pytest.raises(OlmaxError, match="fails its CRC-32 check"):
        load_model(damaged)


def test_half_precision_tensors_widen_exactly_and_others_are_refused(tmp_path):
    """A checkpoint saved in bfloat16 (or float16) reads as its values in float32, exactly; a
    float64 one is refused naming the tensor (float32 cannot hold it)."""
    import ml_dtypes

    from olmax.interop.olmo_core.dcp import write_dcp

    params = jax.tree.map(np.asarray, init_params(CFG, jax.random.key(2)))
    for dtype in (ml_dtypes.bfloat16, np.float16, np.float64):
        folder = tmp_path / np.dtype(dtype).name
        folder.mkdir()
        state = {k: v.astype(dtype) for k, v in oc_state_dict(params, CFG).items()}
        write_dcp(folder, ((f"model.{k}", v) for k, v in state.items()), checkpoint_id=str(folder))
        leaf = OLMoCoreCheckpoint(folder).tree(CFG)["layers"]["q_proj"]
        if dtype is np.float64:
            with pytest.raises(OlmaxError, match=r"tensor model.blocks.0.attention.w_q.weight is "
                                                 r"float64; olmax reads float32"):
                leaf.read()
            continue
        want = np.stack([state[f"blocks.{i}.attention.w_q.weight"].T for i in range(CFG.n_layers)])
        got = leaf.read()
        assert got.dtype == np.float32 and np.array_equal(got, want.astype(np.float32))
