"""Every key of the run configuration, walked with boundary values (0, negative, NaN, infinities,
huge, wrong case, empty, null, the wrong type): each either resolves into a configuration whose
derived quantities (RoPE tables, the learning-rate schedule, the distributed settings, the
epoch order) are finite and accepted, or is refused with one line naming the key (a ConfigError: exit 2). None may reach the
math as an internal error."""

from __future__ import annotations

import copy
import dataclasses
import math
import typing

import numpy as np
import pytest

from olmax.config import schema
from olmax.data.instances import BatchPlan
from olmax.errors import ConfigError
from olmax.model.rope import attention_factor, inv_frequencies
from olmax.parallel.distributed import resolve_settings
from olmax.train.recipes import recipe_dict, resolve_run
from olmax.train.schedules import build_schedule

BOUNDARY = [0, -1, 1, 0.5, float("nan"), float("inf"), float("-inf"), 10**30, 2**63, 1e308,
            "", " ", "Auto", "auto", "NONE", None, True, [], {}, "x"]


def _base(kind: str) -> dict:
    raw = recipe_dict("olmo3_tiny")
    raw["model"]["rope_scaling"] = {}
    raw["distributed"] = {}
    if kind == "tokenizer":     # OLMo-core TokenizerConfig fields instead of a name
        raw["data"]["tokenizer"] = {"vocab_size": 100278, "eos_token_id": 100257,
                                    "pad_token_id": 100277}
    if kind == "mixture":
        raw["data"] = {"mixture": {"requested_tokens": 1000, "sources": [
            {"name": "a", "target_ratio": 1.0, "paths": ["a.npy"]}]}}
    return raw


def _sections() -> list[tuple[str, tuple[str, ...], type]]:
    """(base, key path, dataclass) of every section, nested ones included."""
    out = [("plain", (), schema.RunConfig)]
    for f in dataclasses.fields(schema.RunConfig):
        tp = typing.get_type_hints(schema.RunConfig)[f.name]
        if dataclasses.is_dataclass(tp):
            out.append(("plain", (f.name,), tp))
    out.append(("plain", ("model", "rope_scaling"), schema.YarnConfig))
    out.append(("tokenizer", ("data", "tokenizer"), schema.TokenizerConfig))
    out.append(("mixture", ("data", "mixture"), schema.SourceMixtureConfig))
    out.append(("mixture", ("data", "mixture", "sources", 0), schema.MixtureSourceConfig))
    return out


def _keys() -> list[tuple[str, tuple, str]]:
    keys = []
    for base, path, cls in _sections():
        keys += [(base, path, f.name) for f in dataclasses.fields(cls)]
    return keys


KEYS = _keys()


def _dotted(path: tuple, name: str) -> str:
    return ".".join([p for p in path if isinstance(p, str)] + [name])


def _exercise(cfg: schema.RunConfig) -> None:
    """What the trainer derives first from the numbers: each must be finite."""
    m = cfg.model
    inv = inv_frequencies(m.head_dim, m.rope_theta, m.rope_scaling)
    assert np.all(np.isfinite(inv)), "RoPE frequencies not finite"
    assert math.isfinite(attention_factor(m.rope_scaling))
    gbs = cfg.train.global_batch_size
    train = cfg.train.resolved(batches_per_epoch=2, first_epoch=cfg.data.epoch)   # 2 * gbs instances
    lr = build_schedule(cfg.scheduler, cfg.optim.lr, train.max_steps)
    for step in (1, 2, cfg.scheduler.warmup_steps + 1, train.max_steps, train.last_step):
        assert math.isfinite(lr(step)), f"learning rate not finite at step {step}"
    resolve_settings(cfg.distributed, {})
    BatchPlan(2 * gbs, gbs, cfg.seed, cfg.data.epoch).instance_ids(0, 0, 1)


def _leaves(cls: type, prefix: str = "") -> set[str]:
    """Every field under ``cls``, through optional and tuple sections too."""
    out = set()
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        inner = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        out.add(f"{prefix}{f.name}")        # a section is a key too (set to 0, null, ...)
        if inner:
            out |= _leaves(inner[0], f"{prefix}{f.name}.")
    return out


def test_the_walk_covers_every_field_of_the_schema():
    walked = [_dotted(p, n) for _, p, n in KEYS]
    assert len(set(walked)) == len(walked)
    assert set(walked) == _leaves(schema.RunConfig)
    print(f"{len(walked)} keys walked, {len(BOUNDARY)} values each")


@pytest.mark.parametrize("base,path,name", KEYS, ids=[_dotted(p, n) for _, p, n in KEYS])
def test_every_key_resolves_cleanly_or_is_refused_naming_it(base, path, name):
    template = _base(base)
    if path == ("train",) and name in schema.LENGTH_KEYS:   # the run's length is one of these
        for key in schema.LENGTH_KEYS:
            template["train"].pop(key, None)
    for value in BOUNDARY:
        raw = copy.deepcopy(template)
        node = raw
        for p in path:
            node = node.setdefault(p, {}) if isinstance(p, str) else node[p]
        node[name] = copy.deepcopy(value)
        try:
            cfg = resolve_run(raw)
        except ConfigError as e:
            text = str(e)
            assert "\n" not in text, f"{name}={value!r}: more than one line: {text!r}"
            assert name in text, f"{name}={value!r}: the message does not name the key: {text!r}"
            continue
        try:
            _exercise(cfg)
        except ConfigError as e:
            pytest.fail(f"{_dotted(path, name)}={value!r} resolved but was refused only later: {e}")
        except Exception as e:  # the point of the walk
            pytest.fail(f"{_dotted(path, name)}={value!r} resolved into an internal error: "
                        f"{type(e).__name__}: {e}")
