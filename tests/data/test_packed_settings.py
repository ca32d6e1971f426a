"""Packed-instance settings: wrong ones end in one line naming the setting (load time and the
``olmax data inspect`` command line, non-zero exit)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.datahelp import EOS, write_tokens
from olmax.cli import main
from olmax.config import DataConfig
from olmax.errors import ConfigError
from olmax.train.recipes import run_config_from_dict


@pytest.mark.parametrize("data,message", [
    ({"instances": "packd"}, r"data\.instances: expected one of fsl, packed"),
    ({"instances": "packed", "source_group_size": 0}, r"data\.source_group_size must be positive"),
    ({"instances": "packed", "source_group_size": "eight"}, r"data\.source_group_size: expected int"),
    ({"instances": "packed", "long_doc_strategy": "split"}, r"data\.long_doc_strategy: expected one of"),
    ({"instances": "packed", "doc_lens": "yes"}, r"data\.doc_lens: expected bool"),
    ({"source_group_size": 8}, r"data\.source_group_size needs data\.instances=packed"),
    ({"doc_lens": True}, r"data\.doc_lens needs data\.instances=packed"),
    ({"instances": "packed", "max_target_seq_len": 8192}, r"packed takes neither"),
    ({"source_permutation_seed": -1}, r"data\.source_permutation_seed must be an integer in \[0, 2\^63\)"),
])
def test_bad_settings_fail_at_load_time(data, message):
    with pytest.raises(ConfigError, match=message) as e:
        run_config_from_dict({"model": {"preset": "olmo3-tiny"}, "train": {"seq_len": 64},
                              "data": {"paths": ["a.npy"], **data}})
    assert "\n" not in str(e.value)


def test_stage3_settings_load():
    cfg = run_config_from_dict({"model": {"preset": "olmo3-tiny"}, "train": {"seq_len": 64}, "data": {
        "mix": "OLMo-longmino-mix-0625", "instances": "packed", "source_group_size": 8,
        "source_permutation_seed": 123, "doc_lens": True}}).data
    assert (cfg.instances, cfg.source_group_size, cfg.source_permutation_seed, cfg.doc_lens) == \
        ("packed", 8, 123, True)
    assert DataConfig(paths=("a",)).instances == "fsl"


@pytest.mark.parametrize("extra,message", [
    (["--packed", "--source-group-size", "0"], "data.source_group_size must be positive"),
    (["--packed", "--long-doc-strategy", "split"], "data.long_doc_strategy must be one of"),
    (["--source-group-size", "4"], "data.source_group_size needs data.instances=packed"),
])
def test_inspect_refuses_bad_settings(tmp_path, capsys, extra, message):
    path = write_tokens(tmp_path / "docs.npy", np.tile([1, 2, EOS], 50))
    rc = main(["data", "inspect", "--paths", path, "--seq-len", "8", "--global-batch-size", "2",
               "--seed", "0", "--batches", "0:1", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err
