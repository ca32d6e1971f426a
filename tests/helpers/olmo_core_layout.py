"""An olmax parameter pytree <-> OLMo-core state-dict names, by the parameter table's OLMo-core
column (:func:`olmax.model.params.olmo_core_tensors`): the map lives there, not here."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from olmax.config import ModelConfig
from olmax.model.params import olmo_core_tensors


def oc_state_dict(params: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """``{OLMo-core name: array}`` of an olmax pytree (weights, or moments in the same layout)."""
    p = jax.tree.map(np.asarray, params)
    out = {}
    for t in olmo_core_tensors(cfg):
        node = p
        for part in t.path:
            node = node[part]
        a = node[t.layer] if t.layer is not None else node
        out[t.name] = np.ascontiguousarray(a.T if t.transposed else a)
    return out


def olmax_tree(sd: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """The olmax pytree of an OLMo-core state dict (or a dict of its names, e.g. gradients)."""
    leaves: dict[tuple[str, ...], list] = {}
    for t in olmo_core_tensors(cfg):
        a = np.asarray(sd[t.name])
        leaves.setdefault(t.path, []).append(a.T if t.transposed else a)
    tree: dict = {}
    for path, arrays in leaves.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = np.stack(arrays) if path[0] == "layers" else arrays[0]
    return tree
