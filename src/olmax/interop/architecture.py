"""The model config stored with a run's starting weights, read once.

Training that starts from ``init.hf_dir`` (the HF ``config.json``) or ``init.checkpoint`` (the
olmax checkpoint's ``meta``, or an OLMo-core checkpoint's ``config.json``) takes its architecture from that config:
:func:`read_weights_config` reads it (the only I/O of resolving a run) and
:func:`olmax.model.presets.resolve_model` reconciles it with the recipe's model section (the rule
and its messages are documented there). For an HF source, which stores no padding,
``padded_vocab_size`` is the recipe's, else the vocabulary rounded up to a multiple of 128 as
OLMo-core pads it. ``olmax parity --checkpoint`` checks its checkpoint against the HF config by the
same rule; ``olmax eval`` uses the checkpoint's own config.
"""

from __future__ import annotations

import os

from olmax.checkpoint.format import resolve_step_dir
from olmax.checkpoint.weights import load_meta, load_model_config
from olmax.config import InitConfig
from olmax.errors import ConfigError, OlmaxError
from olmax.interop.olmo_core.checkpoint import (OLMoCoreCheckpoint, is_olmo_core_checkpoint,
                                                read_model_config)
from olmax.interop.hf_config import model_config_from_hf, read_hf_config
from olmax.interop.safetensors import check_safetensors_dir
from olmax.model.presets import WeightsConfig
from olmax.transport import check_location


def read_weights_config(init: InitConfig, *, padded_vocab_size: int | None = None
                        ) -> WeightsConfig | None:
    """The config of ``init.checkpoint`` or ``init.hf_dir`` (the trainer's order), or None when
    neither is set. ``padded_vocab_size``: the run's padding, for an HF source (None: OLMo-core's)."""
    check_location(init.checkpoint, "init.checkpoint")     # a URL olmax reads, or a local path
    check_location(init.hf_dir, "init.hf_dir")
    if init.checkpoint and is_olmo_core_checkpoint(init.checkpoint):
        if init.load_trainer_state:
            ck = OLMoCoreCheckpoint(init.checkpoint)
            if ck.trainer_state() is None:
                _not_continuable(ck.no_trainer_state())
        cfg, where = read_model_config(init.checkpoint)
        if cfg is None:
            raise OlmaxError(f"init.checkpoint {init.checkpoint}: an OLMo-core checkpoint without "
                             "config.json: the recipe must give the model")
        return WeightsConfig(cfg, "init.checkpoint", where)
    if init.checkpoint:
        step = resolve_step_dir(init.checkpoint)
        if init.load_trainer_state and load_meta(step).get("warm_start_only"):
            _not_continuable(f"{step} is an import, and {load_meta(step)['warm_start_only']}")
        return WeightsConfig(load_model_config(step), "init.checkpoint", f"{step}/meta")
    if init.hf_dir:
        where = os.path.join(str(init.hf_dir), "config.json")
        cfg = model_config_from_hf(read_hf_config(init.hf_dir, "init.hf_dir"), where=where,
                                   padded_vocab_size=padded_vocab_size)
        check_safetensors_dir(init.hf_dir)
        return WeightsConfig(cfg, "init.hf_dir", where)
    return None


def _not_continuable(why: str) -> None:
    """``init.load_trainer_state=true`` on weights whose run's state is unknown: refused (a
    ConfigError, which a recipe that gives its model does not pass over)."""
    raise ConfigError(f"init.load_trainer_state=true: init.checkpoint {why}; set "
                      f"init.load_trainer_state=false")


__all__ = ["read_weights_config"]
