"""Typed configuration: the schema (:mod:`olmax.config.schema`) and its strict loader
(:mod:`olmax.config.load`). Both sit at the bottom of the import graph with :mod:`olmax.errors`:
they import nothing else from olmax."""

from olmax.config.load import (MAX_YAML_BYTES, MAX_YAML_VALUES, apply_overrides, check_choices,
                               build, check_positive, check_yaml_size, from_dict, load_yaml,
                               parse_override, safe_load_strict, shown, to_dict,
                               typed_fields)
from olmax.config.schema import *  # noqa: F403
from olmax.config.schema import __all__ as _schema_all
from olmax.errors import ConfigError, NeedsAttentionError, OlmaxError, RestartableError

__all__ = ["ConfigError", "OlmaxError", "RestartableError", "NeedsAttentionError",  # noqa: PLE0604 (+ the schema's)
           "MAX_YAML_BYTES", "MAX_YAML_VALUES", "apply_overrides", "check_choices",
           "build", "check_positive", "check_yaml_size", "from_dict", "load_yaml", "parse_override",
           "safe_load_strict", "shown", "to_dict", "typed_fields", *_schema_all]
