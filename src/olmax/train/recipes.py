"""Recipes: YAML run configurations, packaged (``olmax/recipes/<name>.yaml``) or given by path."""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

from olmax.config import (DATA_SOURCES, RunConfig, apply_overrides, from_dict, load_yaml,
                          parse_override)
from olmax.errors import ConfigError
from olmax.data.sources import resolve_mix
from olmax.interop.architecture import model_from_init
from olmax.model.presets import resolve_model


def default_run_dir(recipe: str) -> str:
    """``runs/<recipe>-<UTC time>``: the run directory of a run that was given none."""
    name = Path(recipe).name
    for suffix in (".yaml", ".yml"):
        name = name[: -len(suffix)] if name.endswith(suffix) else name
    return str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")


def packaged_recipes() -> list[str]:
    root = resources.files("olmax") / "recipes"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def recipe_path(name_or_path: str) -> Path:
    """A YAML path as given, or the packaged recipe of that name (``.yaml`` optional)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    name = p.name[:-5] if p.name.endswith(".yaml") else p.name
    packaged = Path(str(resources.files("olmax") / "recipes" / f"{name}.yaml"))
    if str(p) == p.name and packaged.is_file():
        return packaged
    if p.is_file():
        return p
    raise ConfigError(f"recipe '{name_or_path}' is neither a YAML file nor a packaged recipe "
                      f"(packaged: {', '.join(packaged_recipes())})")


def recipe_dict(name_or_path: str, overrides: Sequence[str] = (), *, find_mix: bool = True) -> dict:
    """The recipe's plain data with overrides applied. An override that names a data source
    (``data.paths``, ``data.mix``, ``data.embedded``, ``data.mixture``) replaces the recipe's source:
    the recipe's other sources are dropped, so ``olmo3_tiny data.paths=[...]`` trains on those files.
    ``find_mix=False`` leaves a ``data.mix`` name as written (for a config that runs elsewhere)."""
    base = load_yaml(recipe_path(name_or_path))
    named = {keys[1] for keys, _ in map(parse_override, overrides)
             if len(keys) == 2 and keys[0] == "data" and keys[1] in DATA_SOURCES}
    if named and isinstance(base.get("data"), dict):
        base["data"] = {k: v for k, v in base["data"].items()
                        if k not in DATA_SOURCES or k in named}
    data = apply_overrides(base, overrides)
    if find_mix and isinstance(data.get("data"), dict) and isinstance(data["data"].get("mix"), str):
        data["data"]["mix"] = resolve_mix(data["data"]["mix"])
    return data


def run_config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """A recipe (plain data, overrides applied) -> RunConfig; the model section may name a preset."""
    data = dict(data)
    model = resolve_model(data.pop("model", None))
    return from_dict(RunConfig, {"model": model, **data})


def load_recipe(name_or_path: str, overrides: Sequence[str] = (), *, find_mix: bool = True,
                read_init: bool = True) -> RunConfig:
    """Recipe + ``key.sub=value`` overrides -> validated RunConfig (ConfigError on bad keys/types
    or values, before any JAX work). With ``init.hf_dir`` / ``init.checkpoint`` the model is the
    checkpoint's (:func:`olmax.interop.architecture.model_from_init`); ``read_init=False`` leaves
    the recipe's model as written and reads nothing there (a job written for a cluster whose storage
    this machine may not see: the trainer reconciles the architecture where it runs)."""
    data = recipe_dict(name_or_path, overrides, find_mix=find_mix)
    return run_config_from_dict(model_from_init(data) if read_init else data)
