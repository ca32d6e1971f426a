"""Recipes: YAML run configurations, packaged (``olmax/recipes/<name>.yaml``) or given by path."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Sequence

from olmax.config import ConfigError, RunConfig, apply_overrides, load_yaml, run_config_from_dict


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


def recipe_dict(name_or_path: str, overrides: Sequence[str] = ()) -> dict:
    return apply_overrides(load_yaml(recipe_path(name_or_path)), overrides)


def load_recipe(name_or_path: str, overrides: Sequence[str] = ()) -> RunConfig:
    """Recipe + ``key.sub=value`` overrides -> validated RunConfig (ConfigError on bad keys/types)."""
    return run_config_from_dict(recipe_dict(name_or_path, overrides))
