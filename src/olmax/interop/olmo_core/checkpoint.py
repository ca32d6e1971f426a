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

from olmax.config import ModelConfig
from olmax.errors import OlmaxError
from olmax.interop.hf_config import whole_number
from olmax.interop.olmo_core.dcp import METADATA, DcpReader, Files
from olmax.interop.olmo_core.model_config import model_config_from_olmo_core
from olmax.interop.olmo_core.torch_zip import Archive
from olmax.model.finite import raise_non_finite, tensor_problem
from olmax.model.params import OLMoCoreTensor, olmo_core_tensors

MODEL_AND_OPTIM = "model_and_optim"
TRAINER_STATE = "train/rank0.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")
PIECE_BYTES = 64 << 20       # OLMo-core rows read at once for a block of an unstacked leaf
EXACT_IN_FP32 = ("float32", "bfloat16", "float16")   # dtypes float32 holds exactly


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
        """``train/rank0.pt``: None where the checkpoint has none (a bare DCP folder, or no such
        file: :meth:`no_trainer_state` says so); one that is there but cannot be read (a broken
        link or a link loop, a damaged archive, a state without a whole-number step) is an
        OlmaxError naming it. Never derived from anything else (Adam's count is not the step)."""
        if not self.full:
            return None
        where = self.files.path(TRAINER_STATE)
        if not self.files.exists(TRAINER_STATE):
            if not self.files.remote and os.path.lexists(where):
                raise OlmaxError(f"{where}: not a readable file (a directory, a broken link or a "
                                 f"link loop); the run's step, data position and seed are in it")
            return None
        size = self.files.size(TRAINER_STATE)
        archive = Archive(lambda o, n: self.files.read(TRAINER_STATE, o, n), size, where)
        state = archive.load()
        if not isinstance(state, dict) or "global_step" not in state:
            raise OlmaxError(f"{where}: not an OLMo-core trainer state (no global_step)")
        loader = state.get("data_loader") or {}
        if not isinstance(loader, dict):
            raise OlmaxError(f"{where}: data_loader is {type(loader).__name__}, not a dict")

        def count(value: Any, key: str) -> int:
            n = whole_number(value, key, where)
            if n < 0:
                raise OlmaxError(f"{where}: {key} is {n}, not a count")
            return n

        loader = {k: v for k, v in loader.items() if isinstance(v, (int, str, float))}
        for key in ("tokens_processed", "batches_processed", "seed", "epoch"):
            if key in loader:
                loader[key] = count(loader[key], f"data_loader.{key}")
        epoch = state.get("epoch", loader.get("epoch", 1))
        return TrainerState(count(state["global_step"], "global_step"),
                            count(state.get("global_train_tokens_seen", 0), "global_train_tokens_seen"),
                            count(epoch if epoch is not None else 1, "epoch") or 1,
                            state.get("world_size"), state.get("max_steps"), loader)

    def no_trainer_state(self) -> str:
        """What an import without a trainer state cannot know, in words (see :meth:`trainer_state`)."""
        what = "is a bare DCP folder" if not self.full else f"has no {TRAINER_STATE}"
        return (f"{self.path} {what}: its step, data position and seed are unknown (Adam's count "
                f"is not the step), so it starts a run (a warm start), not continues one")

    def model_config(self) -> ModelConfig | None:
        """The model of ``config.json`` as an olmax ModelConfig (None without a config.json)."""
        cfg = self.config()
        if cfg is None:
            return None
        return model_config_from_olmo_core(cfg, self.files.path("config.json"))

    # -- tensors --------------------------------------------------------------------------------
    def _oc_tensor(self, name: str, kind: str, rows: slice | None = None) -> np.ndarray:
        """One OLMo-core tensor (``rows``: a range of its first axis), refused by name when it
        holds NaN or Inf: every path that reads an OLMo-core checkpoint for use reads here."""
        key = f"model.{name}" if kind == "model" else f"optim.state.{name}.{kind}"
        if key not in self.dcp.meta.tensors:
            what = "parameter" if kind == "model" else f"optimizer state {kind} of"
            raise OlmaxError(f"{self.path}: the checkpoint has no {what} '{name}'")
        out = self.dcp.tensor(key, rows)
        if out.dtype.name not in EXACT_IN_FP32:
            raise OlmaxError(f"{self.path}: tensor {key} is {out.dtype.name}; olmax reads "
                             f"float32 weights and optimizer state (or bfloat16, float16, exactly "
                             f"widened)")
        out = out.astype(np.float32, copy=False)
        shown = key if rows is None else f"{key} rows {rows.start}..{rows.stop - 1}"
        problem = tensor_problem(shown, out)
        if problem:
            raise_non_finite(self.path, [problem])
        return out

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
            step = self._oc_tensor(t.name, "step")
            if step.size != 1:
                raise OlmaxError(f"{self.path}: Adam's step of '{t.name}' has shape "
                                 f"{list(step.shape)}, not one number")
            steps[t.name] = float(step.reshape(()))
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


__all__ = ["OLMoCoreCheckpoint", "TrainerState", "LazyLeaf", "is_olmo_core_checkpoint",
           "read_model_config",
           "model_config_from_olmo_core", "MOMENTS"]
