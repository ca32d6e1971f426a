"""Typed configuration: frozen dataclasses, strict YAML loading, ``key.sub=value`` overrides.

Every configuration object in olmax is a frozen dataclass. ``from_dict`` turns plain data (parsed
YAML, JSON) into those dataclasses and rejects unknown keys and wrong types with a
:class:`ConfigError` whose message is one line naming the offending key.

This module sits at the bottom of the import graph: it imports nothing else from olmax.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


class OlmaxError(RuntimeError):
    """A user-facing failure (bad input file, mismatched checkpoint, ...): one line, no traceback."""


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


QK_NORM_SCOPES = ("full", "head", "none")
BLOCK_TYPES = ("reordered_norm", "prenorm")


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
    qk_norm: str = "full"
    block_type: str = "reordered_norm"
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
        if self.qk_norm not in QK_NORM_SCOPES:
            bad(f"qk_norm must be one of {QK_NORM_SCOPES} (got {self.qk_norm!r})")
        if self.block_type not in BLOCK_TYPES:
            bad(f"block_type must be one of {BLOCK_TYPES} (got {self.block_type!r})")
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

    def num_params(self) -> int:
        """Parameter count, embeddings and LM head at the padded vocabulary size."""
        d, f = self.d_model, self.mlp_hidden
        qk = {"full": self.q_dim + self.kv_dim, "head": 2 * self.head_dim, "none": 0}[self.qk_norm]
        attn = d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d + qk
        block = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else self.padded_vocab_size * d
        return self.n_layers * block + self.padded_vocab_size * d + head + d

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------------
# Generic loading


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert containers; raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        names = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{path}: expected {names}, got {type(value).__name__} {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, path)
    if origin is tuple or origin is list or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
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
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_convert(k, kt, f"{path}.{k}"): _convert(v, vt, f"{path}.{k}")
                for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected bool, got {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}: expected int, got {type(value).__name__} {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        # YAML 1.1 reads "1e-3" (no dot) as a string; accept numeric spellings for float fields.
        elif isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            number = float(value)
        if number is None:
            raise ConfigError(f"{path}: expected float, got {type(value).__name__} {value!r}")
        if not math.isfinite(number):   # 1e999 parses as inf: never a meaningful setting
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected str, got {type(value).__name__} {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: cannot interpret {value!r} as {_type_name(tp)}")


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
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``key.sub=value`` overrides to a nested plain-data mapping (a deep copy is returned)."""
    import copy

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


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{p}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
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


@dataclass(frozen=True)
class SourceMixtureConfig:
    """Run-time source mixture (OLMo-core ``SourceMixtureDatasetConfig``); global batch and seq_len
    come from the train section."""

    sources: tuple[MixtureSourceConfig, ...] = ()
    requested_tokens: int = 0
    seed: int = 42


@dataclass(frozen=True)
class DataConfig:
    """Training data: a realised file list (OLMo-core mix file or explicit paths)."""

    paths: tuple[str, ...] = ()          # raw uint32 token files, in mix order (paths or s3/gs/http(s) URLs)
    mix: str | None = None               # OLMo-core mix file (label,path lines with {TOKENIZER})
    root: str | None = None              # where the mix's relative paths live (a folder or a URL)
    tokenizer: str = "dolma2"
    dtype: str = "uint32"
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


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 8192
    global_batch_size: int = 512         # sequences
    micro_batch_size: int | None = None  # sequences per device per micro-step (None: no accumulation)
    max_steps: int = 100
    compute_dtype: str = "float32"       # float32 | bfloat16 (params and Adam state stay fp32)
    attn_impl: str = "xla"
    remat: str = "none"
    z_loss_multiplier: float = 1e-5
    log_interval: int = 1


@dataclass(frozen=True)
class OptimConfig:
    name: str = "skip_step_adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: tuple[str, ...] = ("embed",)     # parameter names excluded from weight decay
    max_grad_norm: float = 1.0
    skip_steps: bool = True
    rolling_interval_length: int = 128
    sigma_factor: float = 6.0


@dataclass(frozen=True)
class SchedulerConfig:
    name: str = "cos_with_warmup"   # cos_with_warmup | half_cos_with_warmup | linear_with_warmup | constant
    warmup_steps: int = 2000
    alpha_f: float = 0.1
    t_max: int | None = None        # None: train.max_steps
    warmup_min_lr: float = 0.0


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 1000
    keep: int = 3
    permanent_interval: int | None = None
    async_save: bool = True


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


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1                  # -1: all remaining devices
    tensor: int = 1


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
        for name in ("interval", "limit", "heldout_max_docs", "seq_len", "overlap_max_train_tokens"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"eval.{name} must be positive or null (got {v})")
        if self.batch_size <= 0:
            raise ConfigError(f"eval.batch_size must be positive (got {self.batch_size})")


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


def run_config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """A recipe (plain data, overrides applied) -> RunConfig; the model section may name a preset."""
    data = dict(data)
    model = resolve_model(data.pop("model", None))
    return from_dict(RunConfig, {"model": model, **data})


# ----------------------------------------------------------------------------------------------
# Model section of a recipe: a preset name plus field overrides


def resolve_model(section: Mapping[str, Any] | None, path: str = "model") -> ModelConfig:
    """``{"preset": "olmo3-7b", "n_layers": 4, ...}`` -> ModelConfig (preset fields overridden)."""
    from olmax.model.presets import get_preset  # presets are data built on ModelConfig

    if section is not None and not isinstance(section, Mapping):
        raise ConfigError(f"{path}: expected a mapping (a preset and fields), got "
                          f"{type(section).__name__} {section!r}")
    section = dict(section or {})
    preset = section.pop("preset", None)
    if preset is None:
        return from_dict(ModelConfig, section, path)
    if not isinstance(preset, str):
        raise ConfigError(f"{path}.preset: expected str, got {preset!r}")
    base = to_dict(get_preset(preset))
    base.update(section)
    return from_dict(ModelConfig, base, path)


__all__ = [
    "ConfigError", "OlmaxError", "ModelConfig", "YarnConfig", "RunConfig", "DataConfig",
    "SourceMixtureConfig", "MixtureSourceConfig",
    "TrainConfig", "OptimConfig", "SchedulerConfig", "CheckpointConfig", "InitConfig",
    "DistributedConfig", "MeshConfig", "EvalConfig", "LoggingConfig", "run_config_from_dict",
    "from_dict", "to_dict",
    "apply_overrides", "parse_override", "load_yaml", "resolve_model", "field", "dataclass",
]
