"""``data.tokenizer`` as OLMo-core names tokenizers: its ``TokenizerConfig`` presets by name and
its fields, against ai2-olmo-core 3.0.0's own definitions; and what a tokenizer that gives only
token ids can and cannot do."""

from __future__ import annotations

import pytest

from helpers.reference import require
from olmax.config import ConfigError, DataConfig, TokenizerConfig, from_dict, to_dict
from olmax.data.tokenizer import PRESETS, get_tokenizer, tokenizer_config
from olmax.errors import OlmaxError


def test_presets_are_olmo_cores():
    """Every preset is the classmethod of the same name of OLMo-core's ``TokenizerConfig``, field
    for field, and OLMo-core has no other."""
    require("olmo_core")
    from olmo_core.data.tokenizer import TokenizerConfig as OC, TokenizerName

    for name, ours in PRESETS.items():
        theirs = getattr(OC, name)()
        assert (ours.vocab_size, ours.eos_token_id, ours.pad_token_id, ours.bos_token_id,
                ours.identifier) == (theirs.vocab_size, theirs.eos_token_id, theirs.pad_token_id,
                                     theirs.bos_token_id, str(theirs.identifier)), name
    assert set(PRESETS) == {n.name for n in TokenizerName}


def test_a_preset_by_name_or_identifier_gives_its_ids():
    for name in ("gpt_neox_olmo_dolma_v1_5", "allenai/gpt-neox-olmo-dolma-v1_5"):
        tok = get_tokenizer(name)
        assert (tok.vocab_size, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == \
            (50280, 50279, 1, None)
        assert not tok.can_encode
    assert tokenizer_config("gpt2") == PRESETS["gpt2"]
    assert tokenizer_config(None) == PRESETS["dolma2"]     # none named: dolma2
    with pytest.raises(OlmaxError, match=r"data.tokenizer gpt2 gives token ids only .*tokenizer\.json"):
        get_tokenizer("gpt2").encode("hello")


def test_fields_give_ids_and_encode_where_the_identifier_is_dolma2():
    ids = TokenizerConfig(vocab_size=384, eos_token_id=383, pad_token_id=383)
    tok = get_tokenizer(ids)
    assert tok.identity == {"name": "(token ids)", "identifier": None, "vocab_size": 384,
                            "eos_token_id": 383, "pad_token_id": 383, "bos_token_id": None}
    assert not tok.can_encode
    dolma2 = get_tokenizer(TokenizerConfig(100278, 100257, 100277,
                                           identifier="allenai/dolma2-tokenizer"))
    assert dolma2.can_encode and dolma2.encode("Hello world") == get_tokenizer().encode("Hello world")


def test_data_tokenizer_is_a_name_or_fields():
    cfg = from_dict(DataConfig, {"tokenizer": {"vocab_size": 384, "eos_token_id": 383,
                                               "pad_token_id": 383}}, "data")
    assert cfg.tokenizer == TokenizerConfig(384, 383, 383)
    assert from_dict(DataConfig, to_dict(cfg), "data") == cfg     # config.yaml reads back
    assert from_dict(DataConfig, {"tokenizer": "gpt2"}, "data").tokenizer == "gpt2"
    assert DataConfig().tokenizer is None
    with pytest.raises(ConfigError, match=r"^missing config key 'data.tokenizer.pad_token_id'$"):
        from_dict(DataConfig, {"tokenizer": {"vocab_size": 384, "eos_token_id": 383}}, "data")
    with pytest.raises(ConfigError, match=r"^data.tokenizer.eos_token_id must be an id below "
                                          r"vocab_size 384 \(got 384\)$"):
        from_dict(DataConfig, {"tokenizer": {"vocab_size": 384, "eos_token_id": 384,
                                             "pad_token_id": 0}}, "data")
    with pytest.raises(ConfigError, match=r"^unknown config key 'data.tokenizer.eos'"):
        from_dict(DataConfig, {"tokenizer": {"vocab_size": 384, "eos": 1}}, "data")
