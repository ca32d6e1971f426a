"""Where token files come from: training sources, held-out set entries, glob expansion."""

import numpy as np
import pytest

from olmax.config import DataConfig
from olmax.errors import OlmaxError
from olmax.data.heldout import load_heldout_sets
from olmax.data.sources import data_config_for, expand_globs, heldout_sets, resolve_paths


def test_training_paths_join_the_root_and_globs_expand_once(make_files, tmp_path):
    a = make_files([10, 10, 10])
    assert resolve_paths(DataConfig(paths=("part-000.npy", a[1]), root=str(tmp_path))) == (a[:2], None)
    assert expand_globs([str(tmp_path / "part-00[12].npy"), a[0]], "x") == [a[1], a[2], a[0]]
    with pytest.raises(OlmaxError, match=r"data\.mixture source 'web': '.*nope\*' matches no file"):
        expand_globs([str(tmp_path / "nope*")], "data.mixture source 'web'")


def test_command_line_training_entries(make_files, tmp_path, monkeypatch):
    a = make_files([10, 10])
    assert data_config_for(["embedded"]) == DataConfig(embedded=True)
    assert data_config_for(["mix.txt"], root="/r") == DataConfig(mix="mix.txt", root="/r")
    assert data_config_for(a).paths == tuple(a)
    monkeypatch.chdir(tmp_path)
    assert data_config_for(["part-000.npy"]).paths == ("part-000.npy",)   # an existing file


def test_heldout_set_labels(tmp_path):
    d = tmp_path / "c4_en" / "val"
    d.mkdir(parents=True)
    f = d / "part-0-00000.npy"
    f.write_bytes(np.array([1, 2, 100257], np.uint32).tobytes())
    g = tmp_path / "wiki.bin"
    g.write_bytes(b"")
    sets = heldout_sets([str(f), f"mine={g}", str(g)])
    assert sets == {"c4_en": [str(f)], "mine": [str(g)], "wiki": [str(g)]}
    with pytest.raises(OlmaxError, match="not found"):
        heldout_sets([str(tmp_path / "missing.bin")])


def test_heldout_file_without_documents(tmp_path):
    f = tmp_path / "noeos.bin"
    np.array([1, 2, 3], "<u4").tofile(f)
    with pytest.raises(OlmaxError, match="holds no EOS-terminated document"):
        load_heldout_sets({"x": [str(f)]}, 16, eos_token_id=100257, pad_token_id=100277)
    f.write_bytes(b"\x01\x02\x03")
    with pytest.raises(OlmaxError, match="not a multiple of 4"):
        load_heldout_sets({"x": [str(f)]}, 16, eos_token_id=100257, pad_token_id=100277)
