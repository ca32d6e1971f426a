"""The tokenizer stored with a run's starting checkpoint: the token ids its model was trained on.

An OLMo-core checkpoint's ``config.json`` holds its dataset's ``TokenizerConfig``
(``dataset.tokenizer``: ``vocab_size``, ``eos_token_id``, ``pad_token_id``, ``bos_token_id``,
``identifier``); an olmax checkpoint's meta the ids of its run's data
(``data_fingerprint.tokenizer``), or, for an import or a soup of OLMo-core checkpoints, the
``config.json`` it came from. :func:`read_weights_tokenizer` reads it for ``init.checkpoint``
(None where the checkpoint says nothing, or only part of it: a bare DCP folder). The trainer
takes it when the run names no ``data.tokenizer``, and refuses a run that names other ids
(:func:`olmax.train.start.run_tokenizer`); ``olmax eval`` reads a checkpoint's held-out data with
it unless ``--tokenizer`` names another.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, NamedTuple

from olmax.checkpoint.format import resolve_step_dir
from olmax.checkpoint.weights import load_meta
from olmax.config import ConfigError, InitConfig, TokenizerConfig, shown
from olmax.data.tokenizer import DOLMA2_IDENTIFIER
from olmax.errors import OlmaxError
from olmax.interop.hf_config import whole_number
from olmax.interop.olmo_core.checkpoint import is_olmo_core_checkpoint
from olmax.interop.olmo_core.dcp import Files


class WeightsTokenizer(NamedTuple):
    cfg: TokenizerConfig
    where: str          # the file and key it was read from


def tokenizer_from_section(section: Any, where: str) -> TokenizerConfig | None:
    """An OLMo-core ``TokenizerConfig`` dict (``_CLASS_`` and unknown keys ignored) as a
    TokenizerConfig; None when it is missing or lacks one of the ids OLMo-core requires."""
    if not isinstance(section, Mapping) or any(
            section.get(k) is None for k in ("vocab_size", "eos_token_id", "pad_token_id")):
        return None
    ids = {k: whole_number(section[k], k, where) for k in ("vocab_size", "eos_token_id",
                                                            "pad_token_id")}
    bos = section.get("bos_token_id")
    ident = section.get("identifier")
    if ident is not None and not isinstance(ident, str):
        raise OlmaxError(f"{where}: identifier must be a string (got {shown(ident)})")
    try:
        return TokenizerConfig(**ids, bos_token_id=None if bos is None else
                               whole_number(bos, "bos_token_id", where), identifier=ident)
    except ConfigError as e:
        raise OlmaxError(f"{where}: {str(e).removeprefix('data.tokenizer.')}") from None


def _config_tokenizer(config: Any, where: str) -> WeightsTokenizer | None:
    dataset = config.get("dataset") if isinstance(config, Mapping) else None
    section = dataset.get("tokenizer") if isinstance(dataset, Mapping) else None
    cfg = tokenizer_from_section(section, f"{where} dataset.tokenizer")
    return None if cfg is None else WeightsTokenizer(cfg, f"{where} dataset.tokenizer")


def read_weights_tokenizer(init: InitConfig) -> WeightsTokenizer | None:
    """The tokenizer of ``init.checkpoint`` (module docstring), or None."""
    return read_checkpoint_tokenizer(init.checkpoint) if init.checkpoint else None


def read_checkpoint_tokenizer(path: str) -> WeightsTokenizer | None:
    """The tokenizer of the OLMo-core or olmax checkpoint at ``path`` (module docstring), or
    None where it records none."""
    if is_olmo_core_checkpoint(path):
        files = Files(path)
        where = files.path("config.json")
        if not files.exists("config.json"):
            return None
        try:
            config = json.loads(files.read_all("config.json"))
        except ValueError as e:
            raise OlmaxError(f"{where}: not JSON ({e})") from None
        return _config_tokenizer(config, where)
    step = resolve_step_dir(path)
    meta = load_meta(step)
    saved = (meta.get("data_fingerprint") or {}).get("tokenizer")
    if isinstance(saved, Mapping):
        where = f"{step}/meta data_fingerprint.tokenizer"
        named = DOLMA2_IDENTIFIER if saved.get("name") == "dolma2" else None   # before identifiers
        cfg = tokenizer_from_section({**saved, "identifier": saved.get("identifier", named)}, where)
        if cfg is not None:
            return WeightsTokenizer(cfg, where)
    imported = (meta.get("olmo_core") or {}).get("config")
    return _config_tokenizer(imported, f"{step}/meta olmo_core.config")


__all__ = ["WeightsTokenizer", "read_weights_tokenizer", "read_checkpoint_tokenizer",
           "tokenizer_from_section"]
