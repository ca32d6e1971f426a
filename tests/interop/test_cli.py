"""``olmax convert`` and ``olmax parity`` from the command line, including bad input: one line on
stderr, non-zero exit, no traceback, nothing left in or next to the output directory."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmax.cli import main
from helpers.reference import require

require("torch")
require("transformers")

from helpers.hf_models import make_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "hf"
    make_hf_model(d, window=8)
    return d


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "hf_sharded"
    make_hf_model(d, window=8, max_shard_size="40KB")
    return d


def _fails(capsys, argv, message):
    capsys.readouterr()  # drop earlier output (e.g. model building progress bars)
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and message in err, err
    return err


def _nothing_written(out: Path):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


def test_convert_round_trip_and_parity_from_checkpoint(tmp_path, hf_dir, capsys):
    ckpt, back, report = tmp_path / "ckpt", tmp_path / "back", tmp_path / "r" / "parity.json"
    assert main(["convert", "hf-to-olmax", str(hf_dir), str(ckpt)]) == 0
    assert main(["convert", "olmax-to-hf", str(ckpt), str(back), "--dtype", "float32"]) == 0
    assert (back / "config.json").is_file() and (back / "model.safetensors").is_file()
    assert main(["parity", str(hf_dir), "--checkpoint", str(ckpt), "--seq-len", "16",
                 "--batch", "2", "--seed", "3", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "KL(HF||olmax)" in out and "top-1 agreement 100.0000 %" in out
    r = json.loads(report.read_text())
    for key in ("kl_mean", "kl_max", "top1_agreement", "max_abs_logit_diff", "num_positions",
                "dtype", "seq_len"):
        assert key in r
    assert (r["num_positions"], r["seq_len"], r["dtype"]) == (32, 16, "float32")
    assert r["kl_max"] <= 1e-9 and r["top1_agreement"] == 1.0
    assert (r["profile"], r["attn_impl"]) == ("cpu", "chunked")      # this machine's
    assert r["hf_attn_implementation"] == "eager"                   # the reference's default


def test_parity_with_hf_sdpa_attention(tmp_path, hf_dir, capsys):
    """--hf-attn sdpa: the reference without [heads, T, T] scores, as long sequences need it; the
    same logits within fp32 and the report says which attention HF ran."""
    report = tmp_path / "parity.json"
    assert main(["parity", str(hf_dir), "--seq-len", "16", "--hf-attn", "sdpa", "--json", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["hf_attn_implementation"] == "sdpa"
    assert r["kl_max"] <= 1e-9 and r["top1_agreement"] == 1.0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:                             # argparse: one line, exit 2
        main(["parity", str(hf_dir), "--hf-attn", "flash"])
    assert e.value.code == 2 and "invalid choice: 'flash'" in capsys.readouterr().err


def test_parity_on_a_forced_profile(tmp_path, hf_dir, capsys):
    """--profile tpu on CPU: the TPU's code path, its splash kernel in interpret mode; bf16 olmax
    against the fp32 reference with --hf-dtype; an existing --json is refused without --force."""
    report = tmp_path / "parity.json"
    argv = ["parity", str(hf_dir), "--seq-len", "20", "--profile", "tpu", "--dtype", "bfloat16",
            "--hf-dtype", "float32", "--json", str(report)]
    assert main(argv) == 0
    assert "profile tpu, attention splash" in capsys.readouterr().out
    r = json.loads(report.read_text())
    assert (r["profile"], r["attn_impl"], r["dtype"], r["hf_dtype"]) == ("tpu", "splash", "bfloat16", "float32")
    assert r["kl_mean"] <= 1.5e-3
    before = report.read_text()
    _fails(capsys, argv, "already exists")
    assert report.read_text() == before
    assert main(argv + ["--force"]) == 0


def test_relative_paths(tmp_path, hf_dir, monkeypatch):
    """Checkpoint and output paths relative to the working directory, both directions (the
    checkpoint library itself accepts only absolute paths)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_dir, "hf")
    assert main(["convert", "hf-to-olmax", "hf", "runs/x/checkpoints/40"]) == 0
    assert main(["convert", "olmax-to-hf", "runs/x/checkpoints/40", "out"]) == 0
    assert main(["convert", "olmax-to-hf", "runs/x", "out2"]) == 0
    from safetensors.numpy import load_file

    want = load_file(str(hf_dir / "model.safetensors"))
    for d in ("out", "out2"):
        got = load_file(str(tmp_path / d / "model.safetensors"))
        assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_parity_from_a_token_file(tmp_path, hf_dir):
    ids = np.random.default_rng(0).integers(0, 300, 64).astype(np.uint32)
    ids.tofile(tmp_path / "tokens.bin")
    assert main(["parity", str(hf_dir), "--tokens", str(tmp_path / "tokens.bin"),
                 "--seq-len", "32", "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["inputs"].startswith("token file") and r["kl_max"] <= 1e-9


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_safetensors(tmp_path, hf_dir, capsys):
    d = _copy(hf_dir, tmp_path / "hf")
    (d / "model.safetensors").unlink()
    _fails(capsys, ["convert", "hf-to-olmax", str(d), str(tmp_path / "out")], "no model.safetensors")
    _nothing_written(tmp_path / "out")


def test_truncated_safetensors(tmp_path, hf_dir, capsys):
    d = _copy(hf_dir, tmp_path / "hf")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    _fails(capsys, ["convert", "hf-to-olmax", str(d), str(tmp_path / "out")], "model.safetensors")
    _nothing_written(tmp_path / "out")


def test_missing_and_truncated_shards(tmp_path, sharded_dir, capsys):
    d = _copy(sharded_dir, tmp_path / "hf")
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[:-10])
    _fails(capsys, ["convert", "hf-to-olmax", str(d), str(tmp_path / "out")], shards[-1].name)
    shards[-1].unlink()
    _fails(capsys, ["convert", "hf-to-olmax", str(d), str(tmp_path / "out")], "missing")
    _nothing_written(tmp_path / "out")


def test_llama_config_is_rejected(tmp_path, hf_dir, capsys):
    d = _copy(hf_dir, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    err = _fails(capsys, ["convert", "hf-to-olmax", str(d), str(tmp_path / "out")], "llama")
    assert "Olmo3ForCausalLM" in err
    _fails(capsys, ["parity", str(d)], "llama")
    _nothing_written(tmp_path / "out")


def test_shape_mismatch(tmp_path, hf_dir, capsys):
    d = _copy(hf_dir, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(capsys, ["convert", "hf-to-olmax", str(d), str(tmp_path / "out")], "mlp.gate_proj")
    _nothing_written(tmp_path / "out")


def test_non_empty_output_dir_is_refused_and_untouched(tmp_path, hf_dir, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _fails(capsys, ["convert", "hf-to-olmax", str(hf_dir), str(out)], "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "hf-to-olmax", str(hf_dir), str(ckpt)]) == 0
    _fails(capsys, ["convert", "olmax-to-hf", str(ckpt), str(out)], "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_export_failure_leaves_nothing(tmp_path, hf_dir, monkeypatch):
    from olmax.errors import OlmaxError
    from olmax.interop import hf as hfio

    ckpt, out = tmp_path / "ckpt", tmp_path / "deep" / "er" / "out"
    hfio.convert_hf_to_olmax(hf_dir, ckpt)
    calls = []

    def flaky(path, *args):
        calls.append(path)
        if len(calls) == 2:
            raise OlmaxError("disk full")
        return real(path, *args)

    real = hfio.write_safetensors
    monkeypatch.setattr(hfio, "write_safetensors", flaky)
    with pytest.raises(OlmaxError, match="disk full"):
        hfio.convert_olmax_to_hf(ckpt, out, max_shard_bytes=30_000)
    assert not (tmp_path / "deep").exists()


def test_bad_checkpoint_and_missing_dirs(tmp_path, hf_dir, capsys):
    _fails(capsys, ["convert", "olmax-to-hf", str(hf_dir), str(tmp_path / "out")],
           "no olmax checkpoint")
    _fails(capsys, ["convert", "hf-to-olmax", str(tmp_path / "nope"), str(tmp_path / "out")],
           "not found")
    _fails(capsys, ["parity", str(hf_dir), "--checkpoint", str(tmp_path / "nope")], "not found")
    _nothing_written(tmp_path / "out")


def test_console_script_prints_one_line(tmp_path):
    """The installed entry point (a fresh process): one line, exit code 2."""
    proc = subprocess.run([sys.executable, "-m", "olmax.cli", "convert", "hf-to-olmax",
                           str(tmp_path / "missing"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not found" in proc.stderr


def test_parity_on_text_with_the_dolma2_vocabulary(tmp_path, capsys):
    """Real text through the dolma2 tokenizer into a model with the real 100278-id vocabulary
    (padded to 100352 in olmax; only the first 100278 logits are compared)."""
    d = tmp_path / "hf"
    make_hf_model(d, vocab=100278, hidden=32, inter=64, heads=2, kv_heads=1, window=8)
    text = tmp_path / "doc.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    assert main(["parity", str(d), "--text", str(text), "--seq-len", "24",
                 "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["inputs"] == "text" and r["vocab_compared"] == 100278
    assert r["kl_max"] <= 1e-9 and r["top1_agreement"] == 1.0
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    _fails(capsys, ["parity", str(d), "--text", str(short), "--seq-len", "24"], "need batch*seq_len")
