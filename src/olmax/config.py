"""Typed configuration: frozen dataclasses, strict YAML loading, ``key.sub=value`` overrides.

Every configuration object in olmax is a frozen dataclass. ``from_dict`` turns plain data (parsed
YAML, JSON) into those dataclasses and rejects unknown keys and wrong types with a
:class:`ConfigError` whose message is one line naming the offending key. Every section checks its
own values when it is built (``__post_init__``; choices are ``Literal`` types), so a bad recipe or
override fails at load time, before any JAX work. What depends on several sections or on the
machine (a sequence longer than the model's, a mesh that does not divide the devices) is checked
where those meet: the trainer, the mesh.

YAML (a recipe file, the value of an override) is read strictly: ``safe_load``'s types only, a key
given twice in one mapping is an error naming both lines, and a document larger than
:data:`MAX_YAML_BYTES` or expanding, through its aliases, to more than :data:`MAX_YAML_VALUES`
values is refused before any value is looked at. Values quoted in error messages are shortened
(:func:`shown`), whatever their size.

Recipes (a model *preset* name plus overrides) are resolved by :mod:`olmax.train.recipes`.
This module sits at the bottom of the import graph: it imports nothing else from olmax.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


class OlmaxError(RuntimeError):
    """A user-facing failure (bad input file, mismatched checkpoint, ...): one line, no traceback.

    ``exit_code`` is the command's exit status when it ends in this error (olmax.reporting): 2, a
    configuration or input error that a restart cannot help, unless a subclass (or the instance)
    says otherwise."""

    exit_code: int = 2


class RestartableError(OlmaxError):
    """A failure that a restart may cure (storage, the network, a lost peer): exit status 75."""

    exit_code = 75


class NeedsAttentionError(OlmaxError):
    """The run cannot go on without a person (a non-finite loss): exit status 3."""

    exit_code = 3


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


def _positive(obj: Any, section: str, *names: str, optional: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        if (v is not None or not optional) and not v > 0:
            raise ConfigError(f"{section}.{name} must be positive{' or null' if optional else ''} "
                              f"(got {v})")


# ----------------------------------------------------------------------------------------------
# Model


@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling (OLMo 3 long-context stage; OLMo-core ``YaRNRoPEScalingConfig``)."""

    factor: float = 8.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 8192
    # None: 0.1 * ln(factor) + 1, as OLMo-core and HF compute it.
    attention_factor: float | None = None
    # OLMo 3 applies YaRN to the full-attention layers only.
    full_attention_only: bool = True


QkNorm = Literal["full", "head", "none"]
BlockType = Literal["reordered_norm", "prenorm"]
QK_NORM_SCOPES = typing.get_args(QkNorm)
BLOCK_TYPES = typing.get_args(BlockType)


@dataclass(frozen=True)
class ModelConfig:
    """Every architectural choice of an OLMo-family decoder, as data.

    ``window_pattern`` repeats over the layers; an int W means sliding-window attention where a
    query sees W keys including itself, ``None`` means full causal attention.
    """

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab_size: int = 100278
    padded_vocab_size: int = 100352
    rope_theta: float = 500_000.0
    rope_scaling: YarnConfig | None = None
    norm_eps: float = 1e-6
    qk_norm: QkNorm = "full"
    block_type: BlockType = "reordered_norm"
    window_pattern: tuple[int | None, ...] = (4096, 4096, 4096, None)
    tie_embeddings: bool = False
    init_std: float = 0.02
    max_seq_len: int = 8192

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"model: {msg}")

        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
                     "vocab_size", "padded_vocab_size"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive (got {getattr(self, name)})")
        if self.n_heads % self.n_kv_heads:
            bad(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.padded_vocab_size < self.vocab_size:
            bad(f"padded_vocab_size ({self.padded_vocab_size}) < vocab_size ({self.vocab_size})")
        check_choices(self, "model")
        if not self.window_pattern:
            bad("window_pattern must not be empty")
        if self.n_layers % len(self.window_pattern):
            bad(f"n_layers ({self.n_layers}) must be a multiple of len(window_pattern) "
                f"({len(self.window_pattern)})")
        for w in self.window_pattern:
            if w is not None and w <= 0:
                bad(f"window sizes must be positive or null (got {w})")
        if self.head_dim % 2:
            bad(f"head_dim must be even for RoPE (got {self.head_dim})")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_windows(self) -> tuple[int | None, ...]:
        """The attention window of every layer (None = full attention)."""
        p = self.window_pattern
        return tuple(p[i % len(p)] for i in range(self.n_layers))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------------
# Generic loading


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
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert containers; raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in args and not (isinstance(value, bool) and not isinstance(args[0], bool)):
            return value
        raise ConfigError(f"{path}: expected one of {', '.join(map(str, args))}, got {shown(value)}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:   # X | None: X's own error says more than "expected X or None"
            return _convert(value, options[0], path)
        for a in options:
            try:
                return _convert(value, a, path)
            except ConfigError:
                continue
        names = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{path}: expected {names}, got {type(value).__name__} {shown(value)}")
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
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
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
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected str, got {type(value).__name__} {shown(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {shown(value)}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: cannot interpret {shown(value)} as {_type_name(tp)}")


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, strictly: unknown keys and wrong types are errors."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{where}' (valid keys here: {', '.join(names)})")
        kwargs[key] = _convert(value, hints[key], where)
    missing = [f.name for f in dataclasses.fields(cls)
               if f.init and f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        where = f"{path}." if path else ""
        raise ConfigError(f"missing config key '{where}{missing[0]}'")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from None


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
        value = safe_load_strict(raw) if raw.strip() else ""
    except _DuplicateKey as e:
        raise ConfigError(f"override '{key}': {e.problem}") from None
    except yaml.YAMLError:
        value = raw
    check_yaml_size(value, f"override '{key}'")
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``key.sub=value`` overrides to a nested plain-data mapping (a deep copy is returned)."""
    data = copy.deepcopy(data)
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
        node[keys[-1]] = value
    return data


MAX_YAML_BYTES = 4 << 20        # a recipe file, or the value of one override
MAX_YAML_VALUES = 1_000_000     # values of a document once its aliases are expanded


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


def safe_load_strict(text: str) -> Any:
    """``yaml.safe_load`` with duplicate keys refused (a ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=_StrictLoader)   # noqa: S506 - a SafeLoader subclass


def check_yaml_size(value: Any, where: str) -> None:
    """Refuse a parsed YAML value holding more than :data:`MAX_YAML_VALUES` values once its aliases
    are expanded (an alias "bomb", or one that refers to itself), counting no further than that."""
    count, todo = 0, [value]
    while todo:
        v = todo.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise ConfigError(f"{where}: more than {MAX_YAML_VALUES:,} values once its YAML aliases "
                              f"are expanded (aliases nested too deep, or referring to themselves)")
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


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


# ----------------------------------------------------------------------------------------------
# Run configuration (one section per concern; each owner extends its own section)


@dataclass(frozen=True)
class MixtureSourceConfig:
    """One source of a run-time mixture (OLMo-core ``SourceMixtureConfig``)."""

    name: str
    target_ratio: float
    paths: tuple[str, ...]               # token files; globs allowed (sorted)
    max_repetition_ratio: float = 1.0
    max_source_fraction: float = 1.0

    def __post_init__(self) -> None:
        where = f"data.mixture source {self.name!r}"
        if not 0 < self.target_ratio <= 1:
            raise ConfigError(f"{where}: target_ratio must be in (0, 1]")
        if not 0 < self.max_source_fraction <= 1:
            raise ConfigError(f"{where}: max_source_fraction must be in (0, 1]")
        if self.max_repetition_ratio < 1:
            raise ConfigError(f"{where}: max_repetition_ratio must be >= 1")
        if not self.paths:
            raise ConfigError(f"{where}: paths must not be empty")


@dataclass(frozen=True)
class SourceMixtureConfig:
    """Run-time source mixture (OLMo-core ``SourceMixtureDatasetConfig``); global batch and seq_len
    come from the train section."""

    sources: tuple[MixtureSourceConfig, ...] = ()
    requested_tokens: int = 0
    seed: int = 42

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("data.mixture.sources must not be empty")
        if self.requested_tokens <= 0:
            raise ConfigError("data.mixture.requested_tokens must be > 0")
        total = sum(s.target_ratio for s in self.sources)
        if abs(total - 1.0) > 1e-8 + 1e-5:   # numpy.allclose(total, 1.0), as OLMo-core checks
            raise ConfigError(f"data.mixture target ratios must sum to 1.0, got {total}")


TokenDtype = Literal["uint8", "uint16", "uint32", "uint64"]
DataSource = Literal["paths", "mix", "embedded", "mixture"]   # the exclusive ways to name training data
DATA_SOURCES: tuple[DataSource, ...] = typing.get_args(DataSource)


@dataclass(frozen=True)
class DataConfig:
    """Training data: one source (explicit ``paths``, an OLMo-core ``mix`` file, the ``embedded``
    corpus or a run-time ``mixture``) and how to read it. More than one source is an error here;
    none is an error when the data is resolved (:mod:`olmax.data.sources`)."""

    paths: tuple[str, ...] = ()          # raw uint32 token files, in mix order (paths or s3/gs/http(s) URLs)
    mix: str | None = None               # OLMo-core mix file (label,path lines with {TOKENIZER})
    root: str | None = None              # where the mix's relative paths live (a folder or a URL)
    tokenizer: str = "dolma2"
    dtype: TokenDtype = "uint32"
    epoch: int = 1                       # OLMo-core's trainer starts at epoch 1
    repetition_filter: bool = False      # OLMo 3 7B ran without it
    num_workers: int = 0
    prefetch: int = 2
    ignore_fingerprint_mismatch: bool = False
    embedded: bool = False               # use the embedded corpus (stdlib sources + pydoc topics)
    mix_tokenizer: str = "allenai/dolma3-tokenizer"  # substituted for {TOKENIZER} in mix files
    remap: tuple[str, ...] = ()          # "OLD=NEW" path-prefix rewrites for mix entries
    repetition_max_period: int = 13      # OLMo-core InstanceFilterConfig defaults
    repetition_min_period: int = 1
    repetition_max_count: int = 32
    cache_dir: str | None = None         # index/embedded caches (None: $OLMAX_CACHE or ~/.cache/olmax);
    #                                      when set, also a read-through cache of remote token files
    mixture: SourceMixtureConfig | None = None  # run-time source mixture instead of paths/mix
    max_target_seq_len: int | None = None  # OLMo-core max_target_sequence_length (OLMo 3 scripts: 8192)

    def __post_init__(self) -> None:
        check_choices(self, "data")
        if len(self.sources_set()) > 1:
            raise ConfigError("set exactly one of data.paths, data.mix, data.embedded, data.mixture "
                              f"(got {', '.join(self.sources_set())})")
        for item in self.remap:
            if "=" not in item:
                raise ConfigError(f"data.remap: expected OLD=NEW, got {item!r}")
        _positive(self, "data", "max_target_seq_len", optional=True)
        if self.num_workers < 0 or self.prefetch < 0:
            raise ConfigError("data.num_workers and data.prefetch must be >= 0")

    def sources_set(self) -> list[str]:
        """The data sources this section names (``data.paths``, ...): exactly one for training."""
        on = {"paths": bool(self.paths), "mix": bool(self.mix), "embedded": self.embedded,
              "mixture": self.mixture is not None}
        return [f"data.{name}" for name in DATA_SOURCES if on[name]]

    def source(self) -> DataSource:
        """The one source this section names (a tagged view of the four fields); ConfigError
        when it names none."""
        named = self.sources_set()
        if not named:
            raise ConfigError("set exactly one of data.paths, data.mix, data.embedded, data.mixture "
                              "(got none)")
        return named[0].removeprefix("data.")  # type: ignore[return-value]


ComputeDtype = Literal["float32", "bfloat16"]
AttnImpl = Literal["auto", "xla", "chunked", "dot_product", "cudnn", "splash"]   # olmax.model.attention
PlatformProfile = Literal["auto", "cpu", "tpu", "gpu"]   # olmax.platforms
Remat = Literal["none", "full", "dots", "dots_no_batch", "save_outputs", "save_attn",
                "save_proj"]   # olmax.model.runtime.REMAT_POLICIES


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 8192
    global_batch_size: int = 512         # sequences
    micro_batch_size: int | None = None  # sequences per device per micro-step (None: no accumulation)
    max_steps: int = 100
    compute_dtype: ComputeDtype = "float32"   # params and Adam state stay fp32
    attn_impl: AttnImpl = "xla"
    remat: Remat = "none"
    # How the model is computed (kernels, layer scan, RoPE tables, attn_impl=auto, loss chunks):
    # "auto" follows the devices; "cpu", "tpu", "gpu" force that platform's code path anywhere.
    profile: PlatformProfile = "auto"
    z_loss_multiplier: float = 1e-5
    log_interval: int = 1
    # Seconds without a completed step (the first step, which compiles, excluded) after which
    # every thread's stack goes to RUN_DIR/hangs/ and the process exits 75 (None: no watchdog).
    watchdog_s: float | None = None

    def __post_init__(self) -> None:
        check_choices(self, "train")
        _positive(self, "train", "max_steps", "global_batch_size")
        _positive(self, "train", "micro_batch_size", "watchdog_s", optional=True)
        if self.seq_len <= 1:
            raise ConfigError(f"train.seq_len must be at least 2 (got {self.seq_len})")


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["skip_step_adamw", "adamw"] = "skip_step_adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: tuple[str, ...] = ("embed",)     # parameter names excluded from weight decay
    max_grad_norm: float = 1.0
    skip_steps: bool = True
    rolling_interval_length: int = 128
    sigma_factor: float = 6.0

    def __post_init__(self) -> None:
        check_choices(self, "optim")


@dataclass(frozen=True)
class SchedulerConfig:
    name: Literal["constant", "cos_with_warmup", "half_cos_with_warmup",
                  "linear_with_warmup"] = "cos_with_warmup"
    warmup_steps: int = 2000
    alpha_f: float = 0.1
    t_max: int | None = None        # None: train.max_steps
    warmup_min_lr: float = 0.0

    def __post_init__(self) -> None:
        check_choices(self, "scheduler")
        if self.name != "constant" and self.warmup_steps < 0:
            raise ConfigError(f"scheduler.warmup_steps must be >= 0 (got {self.warmup_steps})")
        _positive(self, "scheduler", "t_max", optional=True)


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 1000
    keep: int = 3
    permanent_interval: int | None = None
    async_save: bool = True

    def __post_init__(self) -> None:
        _positive(self, "checkpoint", "interval", "keep")


SEED_LIMIT = 2**63     # seeds are int64 for jax.random.key and non-negative for numpy's PCG64


def check_seed(value: int | None, key: str) -> None:
    if value is not None and not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"{key} must be an integer in [0, 2^63) (got {value})")


@dataclass(frozen=True)
class InitConfig:
    seed: int | None = None          # model init seed (None: the run seed)
    hf_dir: str | None = None        # start from HF Olmo3ForCausalLM weights
    checkpoint: str | None = None    # warm start from an olmax checkpoint
    load_optimizer: bool = False     # with checkpoint: carry Adam moments and step count
    # The model comes from the checkpoint's config (olmax.interop.architecture): true lets the
    # recipe's model fields win where they differ (shapes must still agree).
    allow_architecture_override: bool = False

    def __post_init__(self) -> None:
        check_seed(self.seed, "init.seed")


@dataclass(frozen=True)
class DistributedConfig:
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # Seconds every process waits for the others to join (None: JAX's 300); a process whose peers
    # have not all come by then exits 75. ``olmax launch`` jobs set 1800.
    init_timeout_s: int | None = None

    def __post_init__(self) -> None:
        _positive(self, "distributed", "init_timeout_s", optional=True)


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1                  # -1: all remaining devices
    tensor: int = 1

    def __post_init__(self) -> None:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        if sum(s == -1 for s in sizes.values()) > 1:
            raise ConfigError("mesh: at most one of data/fsdp/tensor may be -1")
        for name, s in sizes.items():
            if s == 0 or s < -1:
                raise ConfigError(f"mesh.{name} must be a positive size or -1 (got {s})")


@dataclass(frozen=True)
class EvalConfig:
    """In-loop evaluation (``olmax.train.callbacks.evaluator``; OLMo-core LM + downstream evaluators)."""

    interval: int | None = None      # steps between in-loop evaluations (None: off)
    heldout: tuple[str, ...] = ()    # LABEL=PATH[,PATH] | PATH/glob | mix .txt | "embedded"
    tasks: tuple[str, ...] = ()      # OLMES task names or suites ("fast": OLMo 3 stage 1)
    limit: int | None = None         # first N documents of each downstream task (None: all)
    batch_size: int = 8
    heldout_max_docs: int | None = None   # first N documents of each held-out set (None: all)
    seq_len: int | None = None       # held-out instance length and request context (None: train.seq_len)
    on_start: bool = False           # also evaluate before the first step
    on_end: bool = True              # evaluate after the last step when it is not an eval step
    overlap_check: bool = True       # refuse held-out sets that overlap the training files
    allow_overlap: bool = False      # ... or only warn
    drop_overlapping: bool = False   # ... or evaluate without the overlapping documents
    overlap_max_train_tokens: int | None = 1_000_000_000   # scan budget (None: every token)

    def __post_init__(self) -> None:
        _positive(self, "eval", "interval", "limit", "heldout_max_docs", "seq_len",
                  "overlap_max_train_tokens", optional=True)
        _positive(self, "eval", "batch_size")


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str | None = None
    progress: bool = True


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    seed: int = 34521
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    init: InitConfig = field(default_factory=InitConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        check_seed(self.seed, "seed")


__all__ = [
    "ConfigError", "OlmaxError", "RestartableError", "NeedsAttentionError", "ModelConfig", "YarnConfig", "RunConfig", "DataConfig",
    "SourceMixtureConfig", "MixtureSourceConfig",
    "TrainConfig", "OptimConfig", "SchedulerConfig", "CheckpointConfig", "InitConfig",
    "DistributedConfig", "MeshConfig", "EvalConfig", "LoggingConfig",
    "from_dict", "to_dict", "check_choices", "apply_overrides", "parse_override", "load_yaml",
    "field", "dataclass",
]
