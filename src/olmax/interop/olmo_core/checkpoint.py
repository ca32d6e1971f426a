"""An OLMo-core checkpoint folder as olmax sees it: weights, Adam's state, the trainer's state.

OLMo-core's ``Checkpointer`` writes ``step<N>/`` with ``model_and_optim/`` (a DCP folder:
:mod:`olmax.interop.olmo_core.dcp`), ``train/rank<r>.pt`` (``torch.save`` of
``Trainer.state_dict()``; ``rank0.pt`` is enough, as OLMo-core itself falls back to it),
``.metadata.json`` and ``config.json``; a bare DCP folder (model, maybe optimizer) is accepted as
well. Keys: ``model.<fqn>``, ``optim.state.<fqn>.{exp_avg,exp_avg_sq,step}`` and
``optim.param_groups.<fqn>.{lr,betas,eps,weight_decay,initial_lr}`` (flattened, as OLMo-core's
trainer saves them) or ``optim.param_groups.<i>.*`` with ``params`` lists (unflattened).

The OLMo-core names of olmax's parameters are the ``olmo_core`` column of
:data:`olmax.model.params.PARAMS`; a tensor's transform (``[out, in]`` -> ``[in, out]``, layers
stacked) is the same for the weights and for both of Adam's moments. Every vocabulary row is kept.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from olmax.config import ModelConfig, YarnConfig, shown
from olmax.errors import ConfigError, OlmaxError
from olmax.interop.hf_config import json_number, whole_number
from olmax.interop.olmo_core.dcp import METADATA, DcpReader, Files
from olmax.interop.olmo_core.torch_zip import Archive
from olmax.model.params import OLMoCoreTensor, olmo_core_tensors

MODEL_AND_OPTIM = "model_and_optim"
TRAINER_STATE = "train/rank0.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")
PIECE_BYTES = 64 << 20       # OLMo-core rows read at once for a block of an unstacked leaf


def is_olmo_core_checkpoint(path: str | os.PathLike) -> bool:
    """``path`` is an OLMo-core checkpoint folder (``model_and_optim/.metadata``) or a bare DCP
    folder (``.metadata``): local or a URL."""
    files = Files(path)
    if not files.remote and not os.path.isdir(path):
        return False
    return files.exists(f"{MODEL_AND_OPTIM}/{METADATA}") or files.exists(METADATA)


@dataclass(frozen=True)
class TrainerState:
    """What olmax uses of ``train/rank0.pt``."""

    global_step: int
    tokens_seen: int
    epoch: int
    world_size: int | None
    max_steps: int | None
    data_loader: dict          # seed, epoch, tokens_processed, batches_processed, fingerprint, ...

    @property
    def seed(self) -> int | None:
        return self.data_loader.get("seed")

    @property
    def fingerprint(self) -> str | None:
        return self.data_loader.get("dataset_fingerprint")

    def data_position(self, global_batch_tokens: int) -> int:
        """Batches consumed in the current epoch, as OLMo-core's loader counts them on load."""
        return int(self.data_loader.get("tokens_processed", 0)) // global_batch_tokens


def read_model_config(path: str | os.PathLike) -> tuple[ModelConfig | None, str]:
    """The model of an OLMo-core checkpoint's ``config.json`` (None where it has none), and the
    file's path; reads that file only."""
    files = Files(path)
    where = files.path("config.json")
    if not files.exists("config.json"):
        return None, where
    try:
        cfg = json.loads(files.read_all("config.json"))
    except ValueError as e:
        raise OlmaxError(f"{where}: not JSON ({e})") from None
    return model_config_from_olmo_core(cfg, where), where


class OLMoCoreCheckpoint:
    """An OLMo-core checkpoint, read one tensor at a time."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path).rstrip("/")
        self.files = Files(self.path)
        if not self.files.remote and not os.path.isdir(self.path):
            raise OlmaxError(f"OLMo-core checkpoint not found: {self.path}")
        if self.files.exists(f"{MODEL_AND_OPTIM}/{METADATA}"):
            self.dcp = DcpReader(Files(f"{self.path}/{MODEL_AND_OPTIM}"))
            self.full = True
        elif self.files.exists(METADATA):
            self.dcp = DcpReader(self.files)
            self.full = False
        else:
            raise OlmaxError(f"{self.path}: not an OLMo-core checkpoint (no {MODEL_AND_OPTIM}/"
                             f"{METADATA} and no {METADATA})")
        self.dcp.check_files()

    # -- the pieces -----------------------------------------------------------------------------
    @property
    def has_optimizer(self) -> bool:
        return any(k.startswith("optim.state.") for k in self.dcp.meta.tensors)

    def config(self) -> dict | None:
        """``config.json`` (the experiment config), or None where there is none."""
        if not self.files.exists("config.json"):
            return None
        try:
            return json.loads(self.files.read_all("config.json"))
        except ValueError as e:
            raise OlmaxError(f"{self.files.path('config.json')}: not JSON ({e})") from None

    def step_increment_bugfix(self) -> bool | None:
        """``config.json``'s ``train_module.optim.step_increment_bugfix`` (False: the run's Adam
        step count never advanced), or None where the config does not record it."""
        optim = ((self.config() or {}).get("train_module") or {}).get("optim") or {}
        value = optim.get("step_increment_bugfix") if isinstance(optim, dict) else None
        return value if isinstance(value, bool) else None

    def version(self) -> str | None:
        if not self.full or not self.files.exists(".metadata.json"):
            return None
        try:
            return json.loads(self.files.read_all(".metadata.json")).get("version")
        except (ValueError, AttributeError):
            return None

    def trainer_state(self) -> TrainerState | None:
        if not self.full or not self.files.exists(TRAINER_STATE):
            return None
        size = self.files.size(TRAINER_STATE)
        archive = Archive(lambda o, n: self.files.read(TRAINER_STATE, o, n), size,
                          self.files.path(TRAINER_STATE))
        state = archive.load()
        where = self.files.path(TRAINER_STATE)
        if not isinstance(state, dict) or "global_step" not in state:
            raise OlmaxError(f"{where}: not an OLMo-core trainer state (no global_step)")
        loader = state.get("data_loader") or {}
        if not isinstance(loader, dict):
            raise OlmaxError(f"{where}: data_loader is {type(loader).__name__}, not a dict")
        return TrainerState(int(state["global_step"]), int(state.get("global_train_tokens_seen", 0)),
                            int(state.get("epoch", loader.get("epoch", 1)) or 1),
                            state.get("world_size"), state.get("max_steps"),
                            {k: v for k, v in loader.items() if isinstance(v, (int, str, float))})

    def model_config(self) -> ModelConfig | None:
        """The model of ``config.json`` as an olmax ModelConfig (None without a config.json)."""
        cfg = self.config()
        if cfg is None:
            return None
        return model_config_from_olmo_core(cfg, self.files.path("config.json"))

    # -- tensors --------------------------------------------------------------------------------
    def _oc_tensor(self, name: str, kind: str, rows: slice | None = None) -> np.ndarray:
        key = f"model.{name}" if kind == "model" else f"optim.state.{name}.{kind}"
        if key not in self.dcp.meta.tensors:
            what = "parameter" if kind == "model" else f"optimizer state {kind} of"
            raise OlmaxError(f"{self.path}: the checkpoint has no {what} '{name}'")
        return self.dcp.tensor(key, rows)

    def check_model(self, cfg: ModelConfig) -> None:
        """The checkpoint holds exactly ``cfg``'s parameters, in its shapes."""
        names = {t.name: t.shape for t in olmo_core_tensors(cfg)}
        stored = {k[len("model."):]: m.shape for k, m in self.dcp.meta.tensors.items()
                  if k.startswith("model.")}
        for name in sorted(set(names) | set(stored)):
            if name not in stored:
                raise OlmaxError(f"{self.path}: no parameter '{name}', which the model has")
            if name not in names:
                raise OlmaxError(f"{self.path}: parameter '{name}' is not one of the model's")
            if tuple(stored[name]) != tuple(names[name]):
                raise OlmaxError(f"{self.path}: parameter '{name}' is {list(stored[name])}, the "
                                 f"model's is {list(names[name])}")

    def tree(self, cfg: ModelConfig, kind: str = "model") -> dict:
        """The olmax pytree of the weights (``kind="model"``) or of one of Adam's moments, each leaf
        a :class:`LazyLeaf` that reads its OLMo-core tensors when asked (a layer at a time)."""
        by_path: dict[tuple[str, ...], list[OLMoCoreTensor]] = {}
        for t in olmo_core_tensors(cfg):
            by_path.setdefault(t.path, []).append(t)
        tree: dict = {}
        for path, tensors in by_path.items():
            node = tree
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = LazyLeaf(tensors, lambda name, rows: self._oc_tensor(name, kind, rows))
        return tree

    def adam_count(self, cfg: ModelConfig) -> int:
        """OLMo-core's per-parameter ``step``, which must be one integer for every parameter."""
        steps: dict[str, float] = {}
        for t in olmo_core_tensors(cfg):
            steps[t.name] = float(self._oc_tensor(t.name, "step"))
        values = sorted(set(steps.values()))
        if len(values) != 1:
            common = max(values, key=lambda v: sum(1 for s in steps.values() if s == v))
            odd = sorted(n for n, s in steps.items() if s != common)
            raise OlmaxError(f"{self.path}: Adam's step differs between parameters ({common:g} for "
                             f"most; {', '.join(f'{n}={steps[n]:g}' for n in odd[:5])}"
                             f"{' ...' if len(odd) > 5 else ''}): olmax keeps one count")
        if values[0] != int(values[0]) or values[0] < 0:
            raise OlmaxError(f"{self.path}: Adam's step is {values[0]}, not a count")
        return int(values[0])

    def param_groups(self, cfg: ModelConfig) -> dict[str, dict[str, Any]]:
        """``{OLMo-core parameter name: its group's settings}`` (lr, betas, eps, weight_decay, ...),
        from flattened (per-parameter) or indexed groups."""
        values = self.dcp.meta.values
        names = [t.name for t in olmo_core_tensors(cfg)]
        if any(k.startswith("optim.param_groups.") and k.endswith(".params") for k in values):
            return self._indexed_groups(names)
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            prefix = f"optim.param_groups.{name}."
            out[name] = {k[len(prefix):]: self.dcp.value(k) for k in values if k.startswith(prefix)}
        return out

    def _indexed_groups(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """Unflattened groups: ``optim.param_groups.<i>.params`` lists the parameters by name."""
        out: dict[str, dict[str, Any]] = {}
        values = self.dcp.meta.values
        groups = sorted({int(k.split(".")[2]) for k in values if k.startswith("optim.param_groups.")})
        for i in groups:
            prefix = f"optim.param_groups.{i}."
            settings = {k[len(prefix):]: self.dcp.value(k) for k in values if k.startswith(prefix)}
            for name in settings.pop("params", []):
                out[str(name)] = settings
        return {n: out.get(n, {}) for n in names}


class LazyLeaf:
    """One olmax parameter (or moment) over its OLMo-core tensors, read when asked: ``read(index)``
    any block (a stacked leaf: the layers it spans, a layer's tensor at a time; another: only the
    OLMo-core rows the block needs)."""

    def __init__(self, tensors: list[OLMoCoreTensor],
                 read: Callable[[str, slice | None], np.ndarray]) -> None:
        self.tensors = tensors
        self._read = read
        first = tensors[0]
        shape = first.shape[::-1] if first.transposed else first.shape
        self.stacked = first.layer is not None
        self.shape = ((len(tensors),) if self.stacked else ()) + tuple(shape)
        self.dtype = np.dtype(np.float32)

    def layer(self, i: int) -> np.ndarray:
        t = self.tensors[i]
        a = self._read(t.name, None)
        return np.ascontiguousarray(a.T) if t.transposed else a

    def read(self, index: tuple[slice, ...] | None = None) -> np.ndarray:
        index = tuple(index or (slice(None),) * len(self.shape))
        if self.stacked:
            layers = range(*index[0].indices(self.shape[0]))
            return np.stack([self.layer(i)[index[1:]] for i in layers])
        return self._block(self.tensors[0], index)

    def _block(self, t: OLMoCoreTensor, index: tuple[slice, ...]) -> np.ndarray:
        """An unstacked leaf's block, from its OLMo-core rows read ``PIECE_BYTES`` at a time
        (olmax [a, b] is OLMo-core's [b, a] where transposed: its rows are olmax's columns)."""
        row_axis = 1 if t.transposed else 0
        n = self.shape[row_axis]
        lo, hi = index[row_axis].indices(n)[:2]
        width = int(np.prod(t.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        step = max(1, PIECE_BYTES // max(width, 1))
        out_shape = tuple(len(range(*s.indices(d))) for s, d in zip(index, self.shape))
        out = np.empty(out_shape, self.dtype)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            part = self._read(t.name, slice(a, b))
            if t.transposed:
                out[:, a - lo:b - lo] = part[:, index[0]].T
            else:
                out[a - lo:b - lo] = part[(slice(None),) + index[1:]]
            del part
        return out


# ----------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def model_config_from_olmo_core(cfg: dict, where: str) -> ModelConfig:
    """The olmax ModelConfig of an OLMo-core experiment config (``config.json``): its ``model``
    section (OLMo-core 2.x ``attention`` or 3.x ``sequence_mixer``) and the tokenizer's vocabulary
    size from ``dataset.tokenizer``."""
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else None
    if model is None:
        raise OlmaxError(f"{where}: no model section")
    try:
        return _model_config(model, cfg, where)
    except (KeyError, TypeError) as e:
        raise OlmaxError(f"{where}: model section without {e}") from None
    except ConfigError as e:
        raise OlmaxError(f"{where}: {e}") from None


def _section(parent: dict, key: str, where: str, path: str, required: bool = True) -> dict:
    value = parent.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        what = "missing" if value is None else f"{type(value).__name__} {shown(value)}, not an object"
        raise OlmaxError(f"{where}: {path}{key} is {what}")
    return value


def _model_config(model: dict, cfg: dict, where: str) -> ModelConfig:
    """Every value checked by the rules a recipe's are (a whole number where a count is meant, a
    finite number, a boolean; then ModelConfig's own ranges), each error naming the config key."""
    def whole(d: dict, key: str, path: str, default: Any = None) -> int:
        value = d.get(key)
        if value is None:
            if default is None:
                raise OlmaxError(f"{where}: {path}{key} is missing")
            return default
        return whole_number(value, f"{path}{key}", where)

    def flag(d: dict, key: str, path: str, default: bool) -> bool:
        value = d.get(key, default)
        if not isinstance(value, bool):
            raise OlmaxError(f"{where}: {path}{key} must be true or false (got {shown(value)})")
        return value

    block = _section(model, "block", where, "model.")
    mixer = "sequence_mixer" if "sequence_mixer" in block else "attention"
    attn = _section(block, mixer, where, "model.block.")
    a = f"model.block.{mixer}."
    if block.get("name") not in ("reordered_norm", None):
        raise OlmaxError(f"{where}: block {block.get('name')!r} is not OLMo 3's reordered_norm")
    n_heads = whole(attn, "n_heads", a)
    d_model = whole(model, "d_model", "model.")
    n_layers = whole(model, "n_layers", "model.")
    if n_heads <= 0 or n_layers <= 0:
        raise OlmaxError(f"{where}: model.n_layers and {a}n_heads must be positive "
                         f"(got {n_layers}, {n_heads})")
    window = _section(attn, "sliding_window", where, a, required=False)
    pattern: tuple = (None,)
    if window:
        raw = window.get("pattern")
        if not isinstance(raw, list) or not raw:
            raise OlmaxError(f"{where}: {a}sliding_window.pattern must be a non-empty list "
                             f"(got {shown(raw)})")
        pattern = tuple(None if w == -1 else whole_number(w, f"{a}sliding_window.pattern[{i}]", where)
                        for i, w in enumerate(raw))
        _check_forced_layers(window, pattern, n_layers, where)
    rope = _section(attn, "rope", where, a, required=False)
    padded = whole(model, "vocab_size", "model.")
    tokenizer = _section(_section(cfg, "dataset", where, "", required=False), "tokenizer", where,
                         "dataset.", required=False)
    qk = "none" if not attn.get("qk_norm") else \
        ("head" if flag(attn, "use_head_qk_norm", a, False) else "full")
    norm = _section(block, "layer_norm", where, "model.block.", required=False)
    feed_forward = _section(block, "feed_forward", where, "model.block.")
    return ModelConfig(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=whole(attn, "n_kv_heads", a, n_heads),
        head_dim=whole(attn, "head_dim", a, d_model // n_heads),
        mlp_hidden=whole(feed_forward, "hidden_size", "model.block.feed_forward."),
        vocab_size=whole(tokenizer, "vocab_size", "dataset.tokenizer.", padded),
        padded_vocab_size=padded,
        rope_theta=json_number(rope.get("theta", 500_000)),
        rope_scaling=_layers_yarn(model, block, mixer, pattern, n_layers, where)
        or _yarn(rope.get("scaling"), where, full_attention_only=False),
        norm_eps=json_number(norm.get("eps", 1e-6)), qk_norm=qk,
        window_pattern=pattern, tie_embeddings=flag(model, "tie_word_embeddings", "model.", False),
        init_std=json_number(model.get("init_std", 0.02)))


def _check_forced_layers(window: dict, pattern: tuple, n_layers: int, where: str) -> None:
    """OLMo-core may force full attention on the first or last layer; olmax's repeating pattern
    says it only where the pattern has it there already."""
    forced = [(0, window.get("force_full_attention_on_first_layer")),
              (n_layers - 1, window.get("force_full_attention_on_last_layer"))]
    for layer, force in forced:
        if force and pattern[layer % len(pattern)] is not None:
            raise OlmaxError(f"{where}: full attention is forced on layer {layer}, where the window "
                             f"pattern {list(pattern)} repeats a window; olmax cannot express that")


def _layers_yarn(model: dict, block: dict, mixer: str, pattern: tuple, n_layers: int,
                 where: str) -> YarnConfig | None:
    """YaRN on the full-attention layers only, as OLMo-core's ``with_rope_scaling`` writes it:
    ``block_overrides`` for exactly those layers, each the block with ``rope.scaling`` added, all
    alike. Any other ``block_overrides`` is refused (olmax's layers differ in their window only);
    None where there are none."""
    overrides = model.get("block_overrides")
    if not overrides:
        return None
    full = {str(i) for i in range(n_layers) if pattern[i % len(pattern)] is None}
    scalings = []
    if isinstance(overrides, dict) and set(map(str, overrides)) == full:
        for over in overrides.values():
            rope = (over.get(mixer) or {}).get("rope") if isinstance(over, dict) and \
                isinstance(over.get(mixer), dict) else None
            if not isinstance(rope, dict) or not rope.get("scaling"):
                break
            plain = {**over, mixer: {**over[mixer], "rope": {k: v for k, v in rope.items()
                                                            if k != "scaling"}}}
            if plain != block:
                break
            scalings.append(rope["scaling"])
    if len(scalings) != len(full) or any(x != scalings[0] for x in scalings):
        raise OlmaxError(f"{where}: model.block_overrides other than YaRN on the full-attention "
                         "layers (OLMo-core's with_rope_scaling) are not supported")
    return _yarn(scalings[0], where, full_attention_only=True)


def _yarn(scaling: Any, where: str, full_attention_only: bool = True) -> YarnConfig | None:
    """YaRN of a ``rope.scaling`` section: on the full-attention layers only when it comes from
    their ``block_overrides``; in the block itself OLMo-core scales every layer."""
    if not scaling:
        return None
    if not isinstance(scaling, dict) or "factor" not in scaling or "old_context_len" not in scaling:
        what = scaling.get("_CLASS_", scaling) if isinstance(scaling, dict) else shown(scaling)
        raise OlmaxError(f"{where}: RoPE scaling {what} is not YaRN")
    return YarnConfig(factor=json_number(scaling["factor"]),
                      beta_fast=json_number(scaling.get("beta_fast", 32)),
                      beta_slow=json_number(scaling.get("beta_slow", 1)),
                      original_max_position_embeddings=whole_number(
                          scaling["old_context_len"], "rope.scaling.old_context_len", where),
                      full_attention_only=full_attention_only)


__all__ = ["OLMoCoreCheckpoint", "TrainerState", "LazyLeaf", "is_olmo_core_checkpoint",
           "read_model_config",
           "model_config_from_olmo_core", "MOMENTS"]
