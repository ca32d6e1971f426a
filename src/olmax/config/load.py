"""Strict loading of plain data into frozen dataclasses: YAML, ``key.sub=value`` overrides.

``from_dict`` turns plain data (parsed YAML, JSON) into dataclasses and rejects unknown keys and
wrong types with a :class:`~olmax.errors.ConfigError` whose message is one line naming the
offending key. Sections check their own values when they are built (``__post_init__``; choices
are ``Literal`` types, checked by :func:`check_choices`).

YAML (a recipe file, the value of an override) is read strictly: ``safe_load``'s types only, a key
given twice in one mapping is an error naming both lines, and a document larger than
:data:`MAX_YAML_BYTES`, expanding, through its aliases, to more than :data:`MAX_YAML_VALUES`
values or nested more than :data:`MAX_YAML_DEPTH` levels is refused before any value is looked
at. Values quoted in error messages are shortened
(:func:`shown`), whatever their size. This module knows no schema.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from olmax.errors import ConfigError


@functools.lru_cache(maxsize=None)
def _choices_of(cls: type) -> tuple[tuple[str, tuple], ...]:
    """(field, allowed values) of every field of ``cls`` annotated with a ``Literal``."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        if typing.get_origin(tp) is Literal:
            out.append((name, typing.get_args(tp)))
    return tuple(out)


def check_choices(obj: Any, section: str) -> None:
    """Every ``Literal`` field of the dataclass ``obj`` holds one of its values (ConfigError)."""
    for name, allowed in _choices_of(type(obj)):
        value = getattr(obj, name)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise ConfigError(f"{section}.{name} must be one of {', '.join(map(str, allowed))} "
                              f"(got {shown(value)})")


def check_positive(obj: Any, section: str, *names: str, optional: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        if (v is not None or not optional) and not v > 0:
            raise ConfigError(f"{section}.{name} must be positive{' or null' if optional else ''} "
                              f"(got {v})")



def check_number(obj: Any, section: str, name: str, *, low: float | None = None,
                 high: float | None = None, low_open: bool = False, high_open: bool = False,
                 optional: bool = False) -> None:
    """Field ``name`` of ``obj`` is a finite number within the bounds (``low``/``high``, each
    included unless ``*_open``; None: no bound), or null when ``optional``: else a ConfigError
    naming ``section.name`` and the range. For values built without :func:`from_dict` too (an
    imported config), so NaN, infinities and non-numbers are refused here as well; so is a value
    beyond float32's range, in which the model computes."""
    v = getattr(obj, name)
    if v is None and optional:
        return
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    ok = (number and math.isfinite(v)
          and (low is None or (v > low if low_open else v >= low))
          and (high is None or (v < high if high_open else v <= high)))
    if ok and abs(v) > FLOAT32_MAX:
        raise ConfigError(f"{section}.{name} must be within float32's range (|value| <= "
                          f"{FLOAT32_MAX:.4g}; got {shown(v)})")
    if ok:
        return
    if low is not None and high is not None:
        want = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        want = ("positive" if low == 0 and low_open else
                f"{'>' if low_open else '>='} {low:g}")
    elif high is not None:
        want = f"{'<' if high_open else '<='} {high:g}"
    else:
        want = "a finite number"
    if not number:
        want = f"a number {want}" if low is not None or high is not None else want
    raise ConfigError(f"{section}.{name} must be {want}{' or null' if optional else ''} "
                      f"(got {shown(v)})")


FLOAT32_MAX = 3.4028234663852886e38   # the model's arithmetic is float32
INT_LIMIT = 2**63          # an int field holds an int64 (JAX, numpy and the checkpoints' dtype)


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 160
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 8
_SHOWN.maxlevel = 3


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, shortened: bounded in time and length whatever the
    value's size (a long list, a deeply nested mapping)."""
    return _SHOWN.repr(value)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return ", ".join(map(str, typing.get_args(tp)))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _case_hint(value: Any, allowed: Sequence[Any]) -> str:
    """`` (did you mean 'auto'?)`` when ``value`` is one of ``allowed`` but for its case."""
    if isinstance(value, str):
        for a in allowed:
            if isinstance(a, str) and a.lower() == value.strip().lower() and a != value:
                return f" (did you mean {a!r}?)"
    return ""


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert containers; raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in args and not (isinstance(value, bool) and not isinstance(args[0], bool)):
            return value
        raise ConfigError(f"{path}: expected one of {', '.join(map(str, args))}, got {shown(value)}"
                          f"{_case_hint(value, args)}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:   # X | None: X's own error says more than "expected X or None"
            return _convert(value, options[0], path)
        # A mapping is the one section's, a string the string's: their own errors say more
        sections = [a for a in options if dataclasses.is_dataclass(a)]
        if isinstance(value, Mapping) and len(sections) == 1:
            return _convert(value, sections[0], path)
        if isinstance(value, str) and str in options:
            return _convert(value, str, path)
        for a in options:
            try:
                return _convert(value, a, path)
            except ConfigError:
                continue
        names = " or ".join(_type_name(a) for a in args)
        choices = [c for a in args if typing.get_origin(a) is Literal for c in typing.get_args(a)]
        raise ConfigError(f"{path}: expected {names}, got {type(value).__name__} {shown(value)}"
                          f"{_case_hint(value, choices)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {shown(value)}")
        return from_dict(tp, value, path)
    if origin is tuple or origin is list or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {shown(value)}")
        if args and len(args) == 2 and args[1] is Ellipsis:
            items = [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
        elif args and origin is tuple:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            items = [_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        elif args:
            items = [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
        else:
            items = list(value)
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {shown(value)}")
        kt, vt = args if args else (Any, Any)
        return {_convert(k, kt, f"{path}.{k}"): _convert(v, vt, f"{path}.{k}")
                for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected bool, got {type(value).__name__} {shown(value)}")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if -INT_LIMIT <= value < INT_LIMIT:
                return value
            raise ConfigError(f"{path}: {shown(value)} does not fit in 64 bits (|value| < 2^63)")
        raise ConfigError(f"{path}: expected int, got {type(value).__name__} {shown(value)}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        # YAML 1.1 reads "1e-3" (no dot) as a string; accept numeric spellings for float fields.
        elif isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            number = float(value)
        if number is None:
            raise ConfigError(f"{path}: expected float, got {type(value).__name__} {shown(value)}")
        if not math.isfinite(number):   # 1e999 parses as inf: never a meaningful setting
            raise ConfigError(f"{path}: expected a finite number, got {shown(value)}")
        return number
    if tp is str:
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, str):
            raise ConfigError(f"{path}: expected a non-empty string, got {shown(value)}")
        raise ConfigError(f"{path}: expected str, got {type(value).__name__} {shown(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {shown(value)}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: cannot interpret {shown(value)} as {_type_name(tp)}")


def typed_fields(cls: type, data: Mapping[str, Any], path: str = "", *,
                 also: Sequence[str] = ()) -> dict[str, Any]:
    """``data``'s values checked and converted against the fields of dataclass ``cls`` (an unknown
    key is a ConfigError naming it and the valid ones; ``also``: further keys the caller reads,
    returned unconverted). Missing fields are not this function's business: see :func:`build`."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key in also:
            kwargs[key] = value
        elif key in names:
            kwargs[key] = _convert(value, hints[key], where)
        else:
            valid = [*also, *(n for n in names if n not in also)]
            raise ConfigError(f"unknown config key '{where}' (valid keys here: {', '.join(valid)})")
    return kwargs


def build(cls: type, fields: Mapping[str, Any], path: str = "") -> Any:
    """Dataclass ``cls`` from already typed ``fields``: a missing required field, or a value its
    own checks refuse, is a ConfigError naming it."""
    missing = [f.name for f in dataclasses.fields(cls)
               if f.init and f.name not in fields
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        where = f"{path}." if path else ""
        raise ConfigError(f"missing config key '{where}{missing[0]}'")
    try:
        return cls(**fields)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from None


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, strictly: unknown keys and wrong types are errors."""
    return build(cls, typed_fields(cls, data, path), path)


def to_dict(obj: Any) -> Any:
    """Plain-data form of a config dataclass (tuples become lists), suitable for YAML/JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' has an empty key")
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"override '{key}': the value is {len(raw)} characters, more than "
                          f"{MAX_YAML_BYTES}")
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError as e:   # bytes the command line could not decode (surrogateescape)
        byte = ord(raw[e.start]) - 0xDC00 if 0xDC80 <= ord(raw[e.start]) <= 0xDCFF else None
        shown = f"byte 0x{byte:02x}" if byte is not None else f"{raw[e.start]!r}"
        raise ConfigError(f"override '{key}': the value is not UTF-8 text ({shown} at character "
                          f"{e.start}); a run's configuration is UTF-8 (config.yaml)") from None
    try:
        value = safe_load_strict(raw) if raw.strip() else ""
    except _DuplicateKey as e:
        raise ConfigError(f"override '{key}': {e.problem}") from None
    except yaml.YAMLError:
        value = raw
    check_yaml_size(value, f"override '{key}'")
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str], *,
                    one_of: Mapping[tuple[str, ...], Sequence[str]] | None = None) -> dict:
    """Apply ``key.sub=value`` overrides to a nested plain-data mapping (a deep copy is returned).

    ``one_of`` names tagged sections: ``{("data",): ("paths", "mix", ...)}`` says that a section
    holds exactly one of those keys, so an override of one of them replaces what the section held
    (the others given before the overrides are dropped; two given by overrides stay, for the
    section's own check to refuse)."""
    data = copy.deepcopy(data)
    given: dict[tuple[str, ...], set[str]] = {}
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{k}' is not a section")
            node = child
        section, key = tuple(keys[:-1]), keys[-1]
        tags = (one_of or {}).get(section, ())
        if key in tags:
            mine = given.setdefault(section, set())
            for other in tags:
                if other not in mine:
                    node.pop(other, None)
            mine.add(key)
        node[key] = value
    return data


MAX_YAML_BYTES = 4 << 20        # a recipe file, or the value of one override
MAX_YAML_VALUES = 1_000_000     # values of a document once its aliases are expanded
MAX_YAML_DEPTH = 100            # levels of nesting (a recipe or a pod template needs about 10)


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                    continue
                key = self.construct_object(key_node)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:   # an unhashable key: the base constructor words that
                    continue
                if earlier is not key_node:
                    raise _DuplicateKey(None, None, f"duplicate key {shown(key)} (first given at "
                                        f"line {earlier.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


class _TooDeep(yaml.YAMLError):
    problem = "nested deeper than olmax reads"

    def __str__(self) -> str:
        return self.problem


def safe_load_strict(text: str) -> Any:
    """``yaml.safe_load`` with duplicate keys refused (a ``yaml.YAMLError``), as is a document
    nested deeper than the parser's recursion can follow (it used to end in a RecursionError)."""
    try:
        return yaml.load(text, Loader=_StrictLoader)   # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise _TooDeep() from None


def check_yaml_size(value: Any, where: str) -> None:
    """Refuse a parsed YAML value holding more than :data:`MAX_YAML_VALUES` values once its aliases
    are expanded (an alias "bomb", or one that refers to itself), counting no further than that,
    or nested more than :data:`MAX_YAML_DEPTH` levels (which the recursive code after it, merging
    and writing, could not follow)."""
    count, todo = 0, [(value, 0)]
    while todo:
        v, depth = todo.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise ConfigError(f"{where}: more than {MAX_YAML_VALUES:,} values once its YAML aliases "
                              f"are expanded (aliases nested too deep, or referring to themselves)")
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"{where}: more than {MAX_YAML_DEPTH} levels of nesting (or YAML "
                              f"aliases referring to themselves)")
        if isinstance(v, dict):
            todo.extend((c, depth + 1) for c in v.values())
        elif isinstance(v, list):
            todo.extend((c, depth + 1) for c in v)


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    size = p.stat().st_size
    if size > MAX_YAML_BYTES:
        raise ConfigError(f"{p}: {size:,} bytes, more than a recipe may hold ({MAX_YAML_BYTES:,})")
    try:
        data = safe_load_strict(p.read_bytes())
    except yaml.reader.ReaderError as e:   # bytes that are not text in YAML's encodings
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.position})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{p}{where}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    check_yaml_size(data, str(p))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    return data

