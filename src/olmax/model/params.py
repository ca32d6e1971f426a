"""Every parameter of the OLMo 3 decoder, declared once: :data:`PARAMS`.

One row per weight: its shape (from the config), its logical axes (mapped to mesh axes by
:mod:`olmax.parallel.sharding`), its initialisation, its Hugging Face tensor (name and layout),
its OLMo-core name (``olmo_core``), whether the config has it at all, and whether the "6N" FLOPs
count it. Everything else is derived from the rows: the shapes and axes of the parameter pytree,
the initial values, the parameter count, the N of :func:`olmax.model.flops.flops_per_token`, the
HF state-dict map of :mod:`olmax.interop.hf` and the OLMo-core map of
:mod:`olmax.interop.olmo_core` (:func:`olmo_core_tensors`). Adding a weight is a config field, a row here and its use in the layer
function (:mod:`olmax.model.olmo3`).

The pytree: ``{"embed": [Vp, D], "layers": {name: [L, ...]}, "final_norm": [D], "lm_head": [D, Vp]}``;
per-layer weights are stacked along a leading ``layers`` axis. Matrices are stored ``[in, out]``
(HF's and OLMo-core's ``nn.Linear`` weights are ``[out, in]``: ``hf_transposed``). The vocabulary
is padded to ``padded_vocab_size`` (OLMo-core); the HF tensors hold the first ``vocab_size`` rows
of any ``vocab`` axis, OLMo-core's all of them.

Initialisation (OLMo-core ``InitMethod.normal``): every matrix, the embedding and LM head included,
from a normal with std ``init_std`` truncated at +-3 std; norm weights 1; no depth scaling. Leaf
``i`` of the flattened pytree (JAX's sorted-key order) draws from ``fold_in(key, i)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp

from olmax.config import ModelConfig

Params = dict[str, Any]
Shape = tuple[int, ...]


def _always(cfg: ModelConfig) -> bool:
    return True


@dataclass(frozen=True)
class Param:
    """One weight. Layer weights (``layer=True``) give the shape and axes of one layer."""

    name: str
    shape: Callable[[ModelConfig], Shape]
    axes: Callable[[ModelConfig], tuple[str, ...]]
    init: Literal["normal", "ones"]
    hf: str                                         # HF name; ``{i}`` is the layer index
    olmo_core: str                                  # OLMo-core name (model state dict)
    hf_transposed: bool = False                     # HF (and OLMo-core) store it [out, in]
    layer: bool = False
    present: Callable[[ModelConfig], bool] = _always
    in_flops: Callable[[ModelConfig], bool] = _always   # counted in N of "6N"

    @property
    def path(self) -> tuple[str, ...]:
        return ("layers", self.name) if self.layer else (self.name,)

    def full_shape(self, cfg: ModelConfig) -> Shape:
        return ((cfg.n_layers,) if self.layer else ()) + tuple(self.shape(cfg))

    def full_axes(self, cfg: ModelConfig) -> tuple[str, ...]:
        return (("layers",) if self.layer else ()) + tuple(self.axes(cfg))


def _fixed(*axes: str) -> Callable[[ModelConfig], tuple[str, ...]]:
    return lambda cfg: axes


def _qk_norm_shape(width: Callable[[ModelConfig], int]) -> Callable[[ModelConfig], Shape]:
    """QK-norm over the full projected width, or over one head (shared by the heads)."""
    return lambda c: (width(c),) if c.qk_norm == "full" else (c.head_dim,)


def _qk_norm_axes(axis: str) -> Callable[[ModelConfig], tuple[str, ...]]:
    return lambda c: (axis,) if c.qk_norm == "full" else ("head_dim",)


def _has_qk_norm(cfg: ModelConfig) -> bool:
    return cfg.qk_norm != "none"


def _not_tied(cfg: ModelConfig) -> bool:
    return not cfg.tie_embeddings


def _outside_flops(cfg: ModelConfig) -> bool:
    return False


def _tied(cfg: ModelConfig) -> bool:
    return cfg.tie_embeddings


_ATTN, _MLP = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"

# In Hugging Face's module order (the order of an exported state dict).
PARAMS: tuple[Param, ...] = (
    # the embedding is counted in FLOPs only when it is also the output projection (tied)
    Param("embed", lambda c: (c.padded_vocab_size, c.d_model), _fixed("vocab", "embed"), "normal",
          "model.embed_tokens.weight", "embeddings.weight", in_flops=_tied),
    Param("q_proj", lambda c: (c.d_model, c.q_dim), _fixed("embed", "heads"), "normal",
          f"{_ATTN}.q_proj.weight", "blocks.{i}.attention.w_q.weight",
          hf_transposed=True, layer=True),
    Param("k_proj", lambda c: (c.d_model, c.kv_dim), _fixed("embed", "kv_heads"), "normal",
          f"{_ATTN}.k_proj.weight", "blocks.{i}.attention.w_k.weight",
          hf_transposed=True, layer=True),
    Param("v_proj", lambda c: (c.d_model, c.kv_dim), _fixed("embed", "kv_heads"), "normal",
          f"{_ATTN}.v_proj.weight", "blocks.{i}.attention.w_v.weight",
          hf_transposed=True, layer=True),
    Param("o_proj", lambda c: (c.q_dim, c.d_model), _fixed("heads", "embed"), "normal",
          f"{_ATTN}.o_proj.weight", "blocks.{i}.attention.w_out.weight",
          hf_transposed=True, layer=True),
    Param("q_norm", _qk_norm_shape(lambda c: c.q_dim), _qk_norm_axes("heads"), "ones",
          f"{_ATTN}.q_norm.weight", "blocks.{i}.attention.q_norm.weight",
          layer=True, present=_has_qk_norm),
    Param("k_norm", _qk_norm_shape(lambda c: c.kv_dim), _qk_norm_axes("kv_heads"), "ones",
          f"{_ATTN}.k_norm.weight", "blocks.{i}.attention.k_norm.weight",
          layer=True, present=_has_qk_norm),
    # the block norms belong to neither sub-module in OLMo-core: not in its FLOPs' N
    Param("attn_norm", lambda c: (c.d_model,), _fixed("norm"), "ones",
          "model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.attention_norm.weight",
          layer=True, in_flops=_outside_flops),
    Param("gate_proj", lambda c: (c.d_model, c.mlp_hidden), _fixed("embed", "mlp"), "normal",
          f"{_MLP}.gate_proj.weight", "blocks.{i}.feed_forward.w1.weight",
          hf_transposed=True, layer=True),
    Param("up_proj", lambda c: (c.d_model, c.mlp_hidden), _fixed("embed", "mlp"), "normal",
          f"{_MLP}.up_proj.weight", "blocks.{i}.feed_forward.w3.weight",
          hf_transposed=True, layer=True),
    Param("down_proj", lambda c: (c.mlp_hidden, c.d_model), _fixed("mlp", "embed"), "normal",
          f"{_MLP}.down_proj.weight", "blocks.{i}.feed_forward.w2.weight",
          hf_transposed=True, layer=True),
    Param("mlp_norm", lambda c: (c.d_model,), _fixed("norm"), "ones",
          "model.layers.{i}.post_feedforward_layernorm.weight",
          "blocks.{i}.feed_forward_norm.weight",
          layer=True, in_flops=_outside_flops),
    Param("final_norm", lambda c: (c.d_model,), _fixed("norm"), "ones", "model.norm.weight",
          "lm_head.norm.weight"),
    # the output projection counts in FLOPs whether it is stored (here) or tied (the embedding)
    Param("lm_head", lambda c: (c.d_model, c.padded_vocab_size), _fixed("embed", "vocab"), "normal",
          "lm_head.weight", "lm_head.w_out.weight",
          hf_transposed=True, present=_not_tied, in_flops=_not_tied),
)


def params_of(cfg: ModelConfig) -> list[Param]:
    """The rows of :data:`PARAMS` that ``cfg`` has."""
    return [p for p in PARAMS if p.present(cfg)]


def _tree(cfg: ModelConfig, leaf: Callable[[Param], Any]) -> Params:
    tree: Params = {}
    for p in params_of(cfg):
        node = tree.setdefault("layers", {}) if p.layer else tree
        node[p.name] = leaf(p)
    return tree


def param_shapes(cfg: ModelConfig) -> Params:
    """The parameter pytree as shapes (tuples), with the layer stack as leading axis."""
    return _tree(cfg, lambda p: p.full_shape(cfg))


def param_axes(cfg: ModelConfig) -> Params:
    """Logical axis names of every parameter (mapped to mesh axes by ``olmax.parallel``)."""
    return _tree(cfg, lambda p: p.full_axes(cfg))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Initial parameters (see the module docstring)."""
    kinds = _tree(cfg, lambda p: (p.full_shape(cfg), p.init))
    flat, treedef = jax.tree_util.tree_flatten(kinds, is_leaf=lambda x: isinstance(x, tuple))
    leaves = []
    for i, (shape, kind) in enumerate(flat):
        if kind == "ones":
            leaves.append(jnp.ones(shape, dtype))
        else:
            k = jax.random.fold_in(key, i)
            w = jax.random.truncated_normal(k, -3.0, 3.0, shape, jnp.float32) * cfg.init_std
            leaves.append(w.astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> Params:
    """ShapeDtypeStructs of the parameters (no allocation)."""
    return _tree(cfg, lambda p: jax.ShapeDtypeStruct(p.full_shape(cfg), dtype))


def _size(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def count_params(params_or_cfg: Params | ModelConfig) -> int:
    """Parameter count (embeddings and LM head at the padded vocabulary size)."""
    if isinstance(params_or_cfg, ModelConfig):
        return sum(_size(p.full_shape(params_or_cfg)) for p in params_of(params_or_cfg))
    return int(sum(x.size for x in jax.tree.leaves(params_or_cfg)))


def matmul_params(cfg: ModelConfig) -> int:
    """N of "6N": the parameters OLMo-core charges 6 FLOPs per token (:mod:`olmax.model.flops`)."""
    return sum(_size(p.full_shape(cfg)) for p in params_of(cfg) if p.in_flops(cfg))


class HFTensor(NamedTuple):
    """One tensor of an HF ``Olmo3ForCausalLM`` state dict and where it lives in the pytree."""

    name: str
    path: tuple[str, ...]       # the olmax parameter
    layer: int | None           # index along the stacked ``layers`` axis
    index: tuple                # the HF rows of one (layer's) olmax array: the vocabulary unpadded
    transposed: bool            # HF [out, in] vs olmax [in, out]
    shape: Shape                # the HF shape


def hf_tensors(cfg: ModelConfig) -> list[HFTensor]:
    """Every HF tensor of ``cfg``, in HF's module order (layer by layer)."""
    def one(p: Param, i: int | None) -> HFTensor:
        shape, axes = tuple(p.shape(cfg)), tuple(p.axes(cfg))
        index = tuple(slice(0, cfg.vocab_size) if a == "vocab" else slice(None) for a in axes)
        rows = tuple(cfg.vocab_size if a == "vocab" else d for a, d in zip(axes, shape))
        return HFTensor(p.hf.format(i=i), p.path, i, index, p.hf_transposed,
                        rows[::-1] if p.hf_transposed else rows)

    rows = params_of(cfg)
    first_layer = next(k for k, p in enumerate(rows) if p.layer)
    layers = [one(p, i) for i in range(cfg.n_layers) for p in rows if p.layer]
    return ([one(p, None) for p in rows[:first_layer]] + layers
            + [one(p, None) for p in rows[first_layer:] if not p.layer])


class OLMoCoreTensor(NamedTuple):
    """One tensor of an OLMo-core ``Transformer`` state dict and where it lives in the pytree."""

    name: str
    path: tuple[str, ...]       # the olmax parameter
    layer: int | None           # index along the stacked ``layers`` axis
    transposed: bool            # OLMo-core [out, in] vs olmax [in, out]
    shape: Shape                # the OLMo-core shape (every vocabulary row)


def olmo_core_tensors(cfg: ModelConfig) -> list[OLMoCoreTensor]:
    """Every OLMo-core tensor of ``cfg``: the non-layer ones first, then layer by layer."""
    def one(p: Param, i: int | None) -> OLMoCoreTensor:
        shape = tuple(p.shape(cfg))
        return OLMoCoreTensor(p.olmo_core.format(i=i), p.path, i, p.hf_transposed,
                              shape[::-1] if p.hf_transposed else shape)

    rows = params_of(cfg)
    return ([one(p, None) for p in rows if not p.layer]
            + [one(p, i) for i in range(cfg.n_layers) for p in rows if p.layer])
