"""Token files are regular files whose size agrees with their manifest (olmax.data.manifests).

``olmax tokenize`` writes ``manifest.json`` with every file's token count: a copy cut short is
refused by name instead of trained on, and so is a folder given where a file belongs (it used to
pass as "1024 tokens", the size of a directory entry).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from olmax.cli import main
from olmax.config import DataConfig
from olmax.errors import OlmaxError
from olmax.data.loader import build_train_data
from olmax.data.token_files import file_num_tokens

U32 = np.dtype("<u4")


@pytest.fixture()
def tokenized(tmp_path):
    """A folder as ``olmax tokenize`` leaves it: two token files and their manifest."""
    d = tmp_path / "tok"
    d.mkdir()
    files = []
    for k, n in enumerate((600, 400)):
        name = f"part-00000-{k:04d}.npy"
        np.arange(n, dtype=U32).tofile(d / name)
        files.append({"path": name, "documents": 3, "tokens": n, "sha256": "-"})
    (d / "manifest.json").write_text(json.dumps({"dtype": "uint32", "files": files}))
    return d


def test_intact_files_pass_and_cut_ones_are_named(tokenized):
    a = str(tokenized / "part-00000-0000.npy")
    assert file_num_tokens(a, U32) == 600
    with open(a, "r+b") as f:
        f.truncate(4 * 550)
    with pytest.raises(OlmaxError, match=r"part-00000-0000.npy: 2200 bytes on disk, but .*manifest.json "
                                         r"lists 600 uint32 tokens \(2400 bytes\): the file is truncated"):
        file_num_tokens(a, U32)
    b = str(tokenized / "part-00000-0001.npy")
    with open(b, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(OlmaxError, match="longer than written"):
        file_num_tokens(b, U32)


def test_the_dtype_must_be_the_manifests(tokenized):
    with pytest.raises(OlmaxError, match="says the tokens are uint32, but they are being read as uint16"):
        file_num_tokens(str(tokenized / "part-00000-0000.npy"), np.dtype("<u2"))


def test_files_without_a_manifest_entry_are_taken_as_they_are(tmp_path, tokenized):
    np.arange(10, dtype=U32).tofile(tmp_path / "loose.npy")
    assert file_num_tokens(str(tmp_path / "loose.npy"), U32) == 10
    np.arange(7, dtype=U32).tofile(tokenized / "extra.npy")      # not listed
    assert file_num_tokens(str(tokenized / "extra.npy"), U32) == 7
    (tmp_path / "manifest.json").write_text("not json")           # not one of ours
    assert file_num_tokens(str(tmp_path / "loose.npy"), U32) == 10


def test_only_regular_files(tokenized):
    with pytest.raises(OlmaxError, match=r"tok is a directory, not a token file \(its manifest.json "
                                         r"lists 2 token file\(s\): name those instead\)"):
        file_num_tokens(str(tokenized), U32)
    fifo = tokenized / "pipe.npy"
    os.mkfifo(fifo)
    with pytest.raises(OlmaxError, match="pipe.npy is not a regular file"):
        file_num_tokens(str(fifo), U32)


def test_training_refuses_a_folder_and_a_cut_file(tokenized):
    with pytest.raises(OlmaxError, match="is a directory"):
        build_train_data(DataConfig(paths=(str(tokenized),)), seq_len=16, global_batch_size=2, seed=0)
    a = tokenized / "part-00000-0001.npy"
    with open(a, "r+b") as f:
        f.truncate(4 * 100)
    with pytest.raises(OlmaxError, match="part-00000-0001.npy: 400 bytes on disk"):
        build_train_data(DataConfig(paths=(str(tokenized / "part-00000-0000.npy"), str(a))),
                         seq_len=16, global_batch_size=2, seed=0)


def test_data_inspect_names_the_folder(tokenized, capsys):
    rc = main(["data", "inspect", "--paths", str(tokenized), "--seq-len", "16",
               "--global-batch-size", "2", "--seed", "0", "--batches", "0:1"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "is a directory, not a token file" in err[0]
