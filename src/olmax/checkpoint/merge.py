"""The average of checkpoints ("souping"), weights and Adam's state, streamed leaf by leaf.

OLMo 3 32B's stage-2 model is the average of its two mid-training ingredients, weights and Adam's
moments and count (the start of stage 3), and its released model the average of stage 3's last
three checkpoints, weights only. AI2 computed both with OLMo-core's
``src/scripts/merge_core_checkpoints.py``. :func:`merge` computes what that script's code does:

- every parameter, and (unless ``weights_only``) both of Adam's moments, is the average of the
  inputs' in float32: an fp32 accumulator starting at zero, to which each input's tensor (cast to
  fp32), times its weight, is added in the order the inputs are given (the script's
  ``zeros(...).add_(x, alpha=1/N)``; here ``alpha`` is ``weights[i] / sum(weights)``, ``1/N``
  without weights). The output is float32 whatever the inputs' dtype.
- Adam's count: the script averages OLMo-core's per-parameter ``step`` tensors like any other
  tensor (its docstring says the optimizer state is the first checkpoint's; its code averages it).
  olmax's count is one integer: the same weighted mean, rounded to the nearest integer (equal
  counts stay exact; the mean is kept in the output's meta, ``merge.adam_count_mean``).
- what is not a tensor (the step, data position, seed, run config; OLMo-core's ``param_groups``,
  trainer state and ``config.json``, which the script copies from the first input) comes from the
  first input. SkipStep AdamW's loss and gradient-norm windows start empty, as after any OLMo-core
  checkpoint (OLMo-core never saves them).
- ``weights_only`` (the script's ``--skip-optimizer-state``): the weights alone, a parameters-only
  step directory; otherwise a ``checkpoints/``-style folder holding ``<step>/`` with ``params``,
  ``opt_state`` and ``meta``, which ``init.checkpoint`` reads.
- the output's meta says what it was made from (``merge``: each input's path, kind, step, Adam's
  count and coefficient). A soup is a checkpoint like any other: ``olmax train`` warm-starts from
  it at any ``optim.rolling_interval_length`` (its windows restart empty), ``olmax convert`` takes
  it both ways, ``olmax eval`` and ``olmax parity`` read it.

Inputs must hold one architecture (every architectural field of their model configs, and the
padded vocabulary, equal) and, unless ``weights_only``, each its optimizer state; anything else is
refused in one line before anything is written. Each output chunk is computed from the same block
of every input, one chunk at a time (:class:`~olmax.checkpoint.weights.StreamedArray`): the inputs
are never whole in memory. The output directory is written atomically (a temporary beside it,
renamed when complete).

A :class:`Source` is one input: an olmax checkpoint (:func:`olmax_source`) or, through
:mod:`olmax.interop.olmo_core`, an OLMo-core one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from olmax.checkpoint.format import OPT_STATE_ITEM, resolve_step_dir
from olmax.checkpoint.weights import (StreamedArray, load_meta, save_params, save_train_state,
                                      stored_array, stored_arrays)
from olmax.config import ModelConfig, OptimConfig, from_dict
from olmax.errors import OlmaxError
from olmax.io import check_output_dir
from olmax.model.finite import raise_non_finite, tensor_problem
from olmax.model.params import olmo_core_tensors
from olmax.model.presets import ARCH_FIELDS, describe_differences, differences

ADAM = "inner.0."     # Adam's state in olmax's optimizer state (SkipStepAdamWState.inner[0])
META_KEY = "merge"


@dataclass(frozen=True)
class Adam:
    """Adam's state of one input: its count and its moments (trees of leaves read by blocks)."""

    count: int
    mu: Any
    nu: Any


@dataclass(frozen=True)
class Source:
    """One input of a merge. Leaves of ``params`` (and of ``adam``'s moments) have ``shape`` and
    give any block either by ``read(index)`` or by ``leaf[index]``. ``meta``: what the output's
    meta keeps when this input is the first (its step, data position, seed, run config, ...);
    ``optim``: the optimizer its state belongs to."""

    path: str
    model: ModelConfig
    params: Any
    adam: Adam | None
    meta: dict
    step: int
    optim: OptimConfig


def olmax_source(path: str | os.PathLike, *, with_optimizer: bool = True) -> Source:
    """An olmax checkpoint (a step dir, a run dir or a ``checkpoints/`` dir) as a merge input."""
    step_dir = resolve_step_dir(path)
    params, cfg = stored_arrays(step_dir)
    meta = load_meta(step_dir)
    adam = None
    if with_optimizer and (step_dir / OPT_STATE_ITEM).is_dir():
        mu, _ = stored_arrays(step_dir, OPT_STATE_ITEM, ADAM + "mu.")
        nu, _ = stored_arrays(step_dir, OPT_STATE_ITEM, ADAM + "nu.")
        adam = Adam(int(stored_array(step_dir, OPT_STATE_ITEM, ADAM + "count")[()]), mu, nu)
    saved = (meta.get("config") or {}).get("optim") or meta.get("optim") or {}
    optim = from_dict(OptimConfig, saved, f"{step_dir}: meta.optim")
    return Source(str(step_dir), cfg, params, adam, meta, int(meta.get("step", 0)), optim)


def check_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """The coefficient of each input: ``weights[i] / sum(weights)`` (``1/n`` each without
    weights). Weights are finite and positive, one per input; their sum is taken after scaling by
    the largest where it would overflow (``1e308 1e308`` is ``0.5 0.5``), and a weight whose share
    rounds to zero in float32 (its checkpoint would add nothing) is refused."""
    if weights is None:
        return [1 / n] * n
    if len(weights) != n:
        raise OlmaxError(f"--weights: {len(weights)} weights for {n} checkpoints (one each)")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w > 0):
            raise OlmaxError(f"--weights: every weight must be a positive number (got {w})")
    scaled = list(weights)
    try:
        total = math.fsum(scaled)
    except OverflowError:
        total = math.inf
    if not math.isfinite(total):       # each divided by the largest first: a sum of at most n
        top = max(scaled)
        scaled = [w / top for w in scaled]
        total = math.fsum(scaled)
    alphas = [w / total for w in scaled]
    for w, a in zip(weights, alphas):
        if np.float32(a) == 0:
            raise OlmaxError(f"--weights: weight {w:g} is {a:.3g} of the total, which rounds to 0 "
                             f"in float32: its checkpoint would add nothing (drop it, or give "
                             f"weights closer together)")
    return alphas


def check_sources(sources: Sequence[Source], weights_only: bool) -> None:
    """One architecture, and each input's optimizer state unless ``weights_only`` (one line)."""
    if len(sources) < 2:
        raise OlmaxError(f"olmax merge averages two or more checkpoints (got {len(sources)})")
    first = sources[0]
    fields = ARCH_FIELDS + ("padded_vocab_size",)
    for src in sources[1:]:
        diff = differences(first.model, src.model, fields)
        if diff:
            raise OlmaxError(f"{src.path} and {first.path} are different models: "
                             f"{describe_differences(first.model, src.model, diff[:3], first.path, src.path)}"
                             f"{' ...' if len(diff) > 3 else ''} (a merge averages checkpoints of "
                             f"one architecture)")
    if not weights_only:
        for src in sources:
            if src.adam is None:
                raise OlmaxError(f"{src.path} holds no optimizer state: merge the weights alone "
                                 "(--weights-only), or give checkpoints with their optimizer state")


def _block(leaf: Any, index: tuple[slice, ...]) -> np.ndarray:
    return leaf.read(index) if hasattr(leaf, "read") else leaf[index]


def averaged(leaves: Sequence[Any], alphas: Sequence[float], stacked: bool,
             name: str = "a tensor") -> StreamedArray:
    """The weighted average of ``leaves`` (one per input, the same shape), computed a block at a
    time when the block is written: fp32, ``acc += float32(alpha) * float32(x)`` in input order.
    Inputs are checked finite as they are read; a block of the average that is not (a sum past
    float32's range) is refused naming ``name``, before it is written."""
    shape = tuple(leaves[0].shape)
    for leaf in leaves[1:]:
        if tuple(leaf.shape) != shape:   # the configs agree, so only a damaged input gets here
            raise OlmaxError(f"a tensor has shape {list(leaf.shape)} in one input and {list(shape)} "
                             "in another")
    coefficients = [np.float32(a) for a in alphas]

    def read(index: tuple[slice, ...]) -> np.ndarray:
        acc: np.ndarray | None = None
        for leaf, alpha in zip(leaves, coefficients):
            x = np.asarray(_block(leaf, index), dtype=np.float32)
            if acc is None:
                acc = np.zeros(x.shape, np.float32)
            with np.errstate(over="ignore"):    # a sum past float32 is refused below
                acc += alpha * x
            del x
        assert acc is not None
        problem = tensor_problem(f"{name}[{index[0].start}]" if stacked else name, acc)
        if problem:
            raise_non_finite("the average", [f"{problem}: the weighted sum leaves float32's range"])
        return acc

    return StreamedArray(shape, np.float32, read, stacked=stacked)


def _stacked_paths(cfg: ModelConfig) -> set[tuple[str, ...]]:
    """The parameter paths stored ``[n_layers, ...]`` (written one layer per chunk)."""
    return {t.path for t in olmo_core_tensors(cfg) if t.layer is not None}


def averaged_tree(trees: Sequence[Any], alphas: Sequence[float], cfg: ModelConfig) -> Any:
    stacked = _stacked_paths(cfg)

    def one(path, *leaves):
        key = tuple(str(getattr(k, "key", k)) for k in path)
        return averaged(leaves, alphas, key in stacked, ".".join(key))

    return jax.tree_util.tree_map_with_path(one, trees[0], *trees[1:],
                                            is_leaf=lambda x: hasattr(x, "shape"))


def made_from(sources: Sequence[Source], alphas: Sequence[float]) -> list[dict[str, Any]]:
    """What a soup's meta records of each input: its path, kind (an olmax checkpoint, an
    OLMo-core one, an import), step, Adam's count and its coefficient."""
    def kind(meta: dict) -> str:
        source = meta.get("source")
        source = source if isinstance(source, dict) else {}
        return str(source.get("kind") or source.get("format") or "olmax")

    return [{"path": s.path, "kind": kind(s.meta),
             "step": s.step, "adam_count": None if s.adam is None else s.adam.count,
             "coefficient": a} for s, a in zip(sources, alphas)]


def merge(sources: Sequence[Source], out: str | os.PathLike, *,
          weights: Sequence[float] | None = None, weights_only: bool = False,
          opt_state: Callable[[OptimConfig, Any, Any, int], Any] | None = None) -> Path:
    """Average ``sources`` into a new olmax checkpoint at ``out`` (see the module docstring).
    ``opt_state(optim, mu, nu, count)``: olmax's optimizer state for those moments and count
    (:func:`olmax.interop.olmo_core.convert.olmax_opt_state` over the training layer's optimizer,
    which the command passes in); needed unless ``weights_only``."""
    check_output_dir(out)
    check_sources(sources, weights_only)
    alphas = check_weights(weights, len(sources))
    first = sources[0]
    cfg = first.model
    params = averaged_tree([s.params for s in sources], alphas, cfg)
    record: dict[str, Any] = {"sources": [s.path for s in sources], "coefficients": alphas,
                              "weights_only": weights_only, "inputs": made_from(sources, alphas)}
    meta = {k: v for k, v in first.meta.items() if k not in ("model", "format_version", "step")}
    if weights_only:
        meta[META_KEY] = record
        return save_params(out, params, cfg, extra_meta=meta)
    if opt_state is None:
        raise ValueError("merging the optimizer state needs olmax's optimizer (opt_state=...)")
    adams = [s.adam for s in sources]
    assert all(a is not None for a in adams)
    mean = math.fsum(a * s.adam.count for a, s in zip(alphas, sources) if s.adam is not None)
    count = int(math.floor(mean + 0.5))
    record["adam_counts"] = [s.adam.count for s in sources if s.adam is not None]
    record["adam_count_mean"] = mean
    meta[META_KEY] = record
    mu = averaged_tree([a.mu for a in adams if a is not None], alphas, cfg)
    nu = averaged_tree([a.nu for a in adams if a is not None], alphas, cfg)
    state = opt_state(first.optim, mu, nu, count)
    return save_train_state(out, first.step, params, state, cfg, extra_meta=meta)


__all__ = ["Source", "Adam", "olmax_source", "merge", "check_sources", "check_weights", "averaged"]
