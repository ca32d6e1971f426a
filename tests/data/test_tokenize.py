"""``olmax tokenize``: formats, OLMo file layout, manifest, splitting, resume, parallelism, bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from olmax.cli import main
from olmax.errors import OlmaxError
from olmax.data import tokenize_files as tk
from olmax.data.tokenizer import get_tokenizer

EOS = 100257


def docs(n, tag):
    return [f"{tag} document {i}: " + "word " * (i % 9) + "<|endoftext|> tail" * (i % 5 == 0) for i in range(n)]


@pytest.fixture
def inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d = tmp_path / "in"
    d.mkdir()
    texts = {"a": docs(60, "json"), "b": docs(40, "gz"), "c": docs(30, "zst"), "d": docs(25, "pq")}
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t, "meta": 1}) + "\n" for t in texts["a"]))
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts["b"])
    with zstandard.open(d / "c.jsonl.zst", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts["c"])
    pq.write_table(pa.table({"text": texts["d"]}), d / "d.parquet")
    (d / "e.txt").write_text("A plain text file.\nSecond line.\n")
    ordered = texts["a"] + texts["b"] + texts["c"] + texts["d"] + ["A plain text file.\nSecond line.\n"]
    return d, ordered


def expected_stream(texts):
    tok = get_tokenizer("dolma2")
    return np.concatenate([np.array(ids + [EOS], dtype=np.uint32) for ids in tok.encode_batch(texts)])


def read_output(out: Path):
    m = json.loads((out / "manifest.json").read_text())
    arrays = [np.fromfile(out / f["path"], dtype="<u4") for f in m["files"]]
    return m, arrays


def test_formats_layout_and_manifest(inputs, tmp_path):
    src, texts = inputs
    out = tmp_path / "out"
    settings = tk.TokenizeSettings(max_file_tokens=500, group_bytes=3000)
    tk.tokenize_files([str(src)], str(out), settings, workers=1, progress=False, log=lambda s: None)
    m, arrays = read_output(out)
    np.testing.assert_array_equal(np.concatenate(arrays), expected_stream(texts))
    assert m["documents"] == len(texts) and m["tokens"] == sum(a.size for a in arrays)
    assert m["dtype"] == "uint32" and m["tokenizer"]["eos_token_id"] == EOS
    for f, a in zip(m["files"], arrays):
        raw = (out / f["path"]).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == f["sha256"] and f["tokens"] == a.size
        assert a.size <= 500 and a[-1] == EOS and (a == EOS).sum() >= f["documents"]
    assert len(m["files"]) > 3
    assert not (out / ".progress").exists()


def test_parallel_equals_serial_and_cli(inputs, tmp_path, capsys):
    src, _ = inputs
    serial = tmp_path / "serial"
    tk.tokenize_files([str(src)], str(serial), tk.TokenizeSettings(max_file_tokens=700, group_bytes=2000),
                      workers=1, progress=False)
    rc = main(["tokenize", str(src), "--out", str(tmp_path / "par"), "--workers", "2",
               "--max-file-tokens", "700", "--group-mb", str(2000 / (1 << 20)), "--no-progress"])
    assert rc == 0 and "documents" in capsys.readouterr().out
    a, b = read_output(serial), read_output(tmp_path / "par")
    assert [f["sha256"] for f in a[0]["files"]] == [f["sha256"] for f in b[0]["files"]]


def test_resume_after_interruption(inputs, tmp_path, monkeypatch):
    src, texts = inputs
    out = tmp_path / "out"
    settings = tk.TokenizeSettings(max_file_tokens=400, group_bytes=2500)
    real = tk._tokenize_group
    calls = []

    def crash_on_second(task):
        calls.append(task[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(tk, "_tokenize_group", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        tk.tokenize_files([str(src)], str(out), settings, workers=1, progress=False)
    assert not (out / "manifest.json").exists()
    assert not list(out.glob(".tmp-*")) and list(out.glob("part-00000-*.npy"))
    assert not list(out.glob("part-00001-*.npy"))
    monkeypatch.setattr(tk, "_tokenize_group", real)
    logs = []
    tk.tokenize_files([str(src)], str(out), settings, workers=1, progress=False, log=logs.append)
    assert any("resuming" in line for line in logs)
    _, arrays = read_output(out)
    np.testing.assert_array_equal(np.concatenate(arrays), expected_stream(texts))
    with pytest.raises(OlmaxError, match="already holds a finished tokenization"):
        tk.tokenize_files([str(src)], str(out), settings, workers=1, progress=False)


@pytest.mark.parametrize("content,pattern", [
    ('{"text": "ok"}\n{"text": "ok2"\n', r"bad\.jsonl:2: unreadable JSON line"),
    ('{"text": "ok"}\n{"body": "x"}\n', r"bad\.jsonl:2: no 'text' field"),
    ('{"text": 3}\n', r"bad\.jsonl:1: field 'text' is not a string"),
    ("", r"bad\.jsonl: empty input"),
    ('{"text": ""}\n', r"bad\.jsonl: empty input"),
])
def test_bad_jsonl_input(tmp_path, capsys, content, pattern):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "fine"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    out = tmp_path / "out"
    rc = main(["tokenize", str(good), str(bad), "--out", str(out), "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc != 0 and len(err.strip().splitlines()) == 1
    import re
    assert re.search(pattern, err), err
    assert not (out / "manifest.json").exists()
    assert not list(out.glob("*.npy")) and not list(out.glob(".tmp-*"))  # same group: nothing half-written
    bad.write_text('{"text": "fixed"}\n')  # fixing the input and rerunning just works
    assert main(["tokenize", str(good), str(bad), "--out", str(out), "--workers", "1", "--no-progress"]) == 0


def test_missing_input_and_nonempty_out(tmp_path, capsys):
    rc = main(["tokenize", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc != 0 and "input not found" in capsys.readouterr().err
    (tmp_path / "in.txt").write_text("hello")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    rc = main(["tokenize", str(tmp_path / "in.txt"), "--out", str(tmp_path / "busy"), "--no-progress"])
    assert rc != 0 and "not empty" in capsys.readouterr().err


def test_output_trains(inputs, tmp_path):
    """The tokenize output is directly usable as data.paths."""
    from olmax.config import DataConfig
    from olmax.data.loader import build_train_data

    src, _ = inputs
    out = tmp_path / "out"
    tk.tokenize_files([str(src)], str(out), tk.TokenizeSettings(max_file_tokens=1000),
                      workers=1, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    td = build_train_data(DataConfig(paths=tuple(f["path"] for f in m["files"]), root=str(out)),
                          seq_len=32, global_batch_size=2, seed=0)
    assert td.global_batch(0)["tokens"].shape == (2, 32)


def test_big_jsonl_is_split_into_byte_ranges(tmp_path):
    """A plain JSONL file larger than a group is cut at line starts: same stream, correct line numbers."""
    texts = docs(80, "split")
    texts[10] = "a very long document " * 200  # longer than a range: some ranges start no line
    src = tmp_path / "big.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    settings = tk.TokenizeSettings(max_file_tokens=300, group_bytes=700)
    assert len(tk.plan_groups([src], settings.group_bytes)) > 5
    out = tmp_path / "out"
    tk.tokenize_files([str(src)], str(out), settings, workers=1, progress=False)
    _, arrays = read_output(out)
    np.testing.assert_array_equal(np.concatenate(arrays), expected_stream(texts))

    lines = src.read_text().splitlines(keepends=True)
    lines[57] = '{"text": broken\n'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines))
    with pytest.raises(OlmaxError, match=r"bad\.jsonl:58: unreadable JSON line"):
        tk.tokenize_files([str(bad)], str(tmp_path / "out2"), settings, workers=1, progress=False)
