"""Recipes: YAML run configurations, packaged (``olmax/recipes/<name>.yaml``) or given by path,
resolved into a :class:`~olmax.config.RunConfig` in one downward pass (:func:`load_recipe`):

1. the recipe's plain data, with the ``key.sub=value`` overrides applied (an override of a data
   source replaces the recipe's source, one of the run's length replaces its length:
   :data:`~olmax.config.ONE_OF`);
2. a :class:`~olmax.config.RunSpec`: every section typed and checked once, the model as written;
3. the weights' own config, read once when the run starts from weights
   (:func:`~olmax.interop.architecture.read_weights_config`);
4. one pure :func:`~olmax.model.presets.resolve_model`;
5. the RunConfig, whose own checks hold the rules between sections.
"""

from __future__ import annotations

import dataclasses
import time
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

from olmax.config import ONE_OF, RunConfig, RunSpec, apply_overrides, load_yaml
from olmax.data.sources import resolve_mix
from olmax.errors import ConfigError, OlmaxError
from olmax.interop.architecture import read_weights_config
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


def recipe_dict(name_or_path: str, overrides: Sequence[str] = ()) -> dict:
    """The recipe's plain data with the overrides applied. An override that names a data source
    (``data.paths``, ``data.mix``, ``data.embedded``, ``data.mixture``) replaces the recipe's
    source, so ``olmo3_tiny data.paths=[...]`` trains on those files."""
    return apply_overrides(load_yaml(recipe_path(name_or_path)), overrides, one_of=ONE_OF)


def resolve_run(raw: Mapping[str, Any], *, find_mix: bool = False,
                read_init: bool = False) -> RunConfig:
    """A run's plain data (overrides applied) -> RunConfig, in one pass (module docstring).

    ``find_mix``: look a ``data.mix`` name up on disk (False leaves it as written, for a config
    that runs elsewhere). ``read_init``: with ``init.hf_dir`` / ``init.checkpoint``, read the
    weights' config and take the model from it; False leaves the recipe's model as written and
    reads nothing there (a job written for a cluster whose storage this machine may not see: the
    trainer resolves the model again, by the same function, where it runs)."""
    spec = RunSpec.parse(raw)
    replaced = {}
    data = spec.sections.get("data")
    if find_mix and data is not None and data.mix:
        replaced["data"] = dataclasses.replace(data, mix=resolve_mix(data.mix))
    weights = None
    if read_init:
        padded = spec.model.fields.get("padded_vocab_size")
        try:
            weights = read_weights_config(spec.init, padded_vocab_size=padded)
        except OlmaxError:
            if not spec.model:
                raise
            # the recipe gives the model; a resumed run may not need the weights: the trainer
            # reports it at start if it does
    model = resolve_model(spec.model, weights,
                          allow_override=spec.init.allow_architecture_override)
    return spec.finish(model, **replaced)


def run_config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """A run's plain data -> RunConfig, reading nothing (the model section may name a preset)."""
    return resolve_run(data)


def load_recipe(name_or_path: str, overrides: Sequence[str] = (), *, find_mix: bool = True,
                read_init: bool = True) -> RunConfig:
    """Recipe + ``key.sub=value`` overrides -> validated RunConfig (ConfigError on bad keys, types
    or values, before any JAX work); see :func:`resolve_run` for ``find_mix`` and ``read_init``."""
    return resolve_run(recipe_dict(name_or_path, overrides), find_mix=find_mix, read_init=read_init)
