"""Hugging Face ``Olmo3ForCausalLM`` directories <-> olmax params, without torch: the mapping and
the conversions.

The config is :mod:`olmax.interop.hf_config`'s; the files are :mod:`olmax.interop.safetensors`'.
Weights (``model.safetensors`` or a sharded ``model.safetensors.index.json``; F32/BF16/F16) map
tensor by tensor into the stacked olmax pytree as :data:`olmax.model.params.PARAMS` declares: e.g.
``model.layers.{i}.self_attn.q_proj.weight`` is ``layers.q_proj[i]`` transposed (HF linear weights
are [out, in], olmax [in, out]); ``post_attention_layernorm``/``post_feedforward_layernorm`` are
``attn_norm``/``mlp_norm`` (on the sub-layer outputs); ``lm_head.weight`` is ``lm_head`` transposed.

The HF vocabulary (``vocab_size`` rows, e.g. dolma2's 100278) is padded to a multiple of 128
(OLMo-core's ``padded_vocab_size``, 100352) on import and cut back on export; the padding rows start
as OLMo-core's HF loader makes them and stay out of an imported model's softmax
(:mod:`olmax.interop.vocab_padding`). A tensor holding NaN/Inf is refused by name as it is read.
Both directions stream (``benchmarks/convert_scale.py`` measures them): import hands the checkpoint
writer :class:`~olmax.checkpoint.weights.StreamedArray` leaves that read each chunk (one layer's
tensor, a block of vocabulary rows) from the safetensors files with plain reads as it is written;
export reads the checkpoint slice by slice and writes each shard's header first, then its tensors
one at a time. Neither holds more than a chunk and a tensor. Import then export reproduces every
tensor bit for bit (export defaults to the imported file's dtype). Outputs are written atomically.
:func:`load_hf` (training's ``init.hf_dir``, parity) reads the whole model into numpy instead.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from olmax.checkpoint.weights import (StreamedArray, load_meta, load_model_config, save_params,
                                     stored_arrays)
from olmax.config import ModelConfig
from olmax.errors import ConfigError, OlmaxError
from olmax.interop import vocab_padding
from olmax.interop.hf_config import HF_ARCHITECTURE, hf_config_from_model, model_config_from_hf, read_hf_config
from olmax.interop.safetensors import (DEFAULT_MAX_SHARD_BYTES, DTYPES as SAFETENSORS_DTYPES, INDEX_FILE,
                                       SafetensorsDir, check_safetensors_dir, plan_shards,
                                       write_safetensors)
from olmax.interop.vocab_padding import padding_rows
from olmax.io import atomic_output_dir, check_output_dir
from olmax.model.params import HFTensor, Param, hf_tensors, param_shapes, params_of
from olmax.model.runtime import dtype_of

# The dtypes olmax writes HF weights in, by name.
STORED_DTYPES = {name: np.dtype(dtype_of(name)) for name in ("float32", "bfloat16")}

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some old exports contain


def stored_dtype(name: str) -> np.dtype:
    """The numpy dtype of HF weights stored as ``name`` (``float32``, ``bfloat16``)."""
    if name not in STORED_DTYPES:
        raise ConfigError(f"unsupported dtype '{name}' (choose from {', '.join(STORED_DTYPES)})")
    return STORED_DTYPES[name]


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF state dict (name -> [out, in] shape) of ``cfg``, in HF's module order."""
    return {t.name: t.shape for t in hf_tensors(cfg)}


def load_hf(hf_dir: str | os.PathLike, *, dtype: str = "float32",
            padded_vocab_size: int | None = None) -> tuple[dict, ModelConfig, dict]:
    """Read an HF Olmo3 directory -> (numpy params in ``dtype``, ModelConfig, source info).

    The source info holds the original ``hf_config`` and the file's ``hf_dtype`` (so an export
    can reproduce the directory). Every tensor is checked against the config's shapes.
    """
    target = stored_dtype(dtype)
    weights, cfg, info = open_hf(hf_dir, padded_vocab_size=padded_vocab_size)
    # Preallocated (lazily zeroed) stacked arrays, filled one HF tensor at a time.
    params = _tree_map_shapes(lambda s: np.zeros(s, target), param_shapes(cfg))
    for tensor in hf_tensors(cfg):
        t = weights.read(tensor.name)
        _stored(params, tensor)[tensor.index] = t.T if tensor.transposed else t
        del t
    v = cfg.vocab_size
    exact = target == np.float32     # float32 holds the file's values: no second read needed
    params["embed"][v:] = _padding(weights, "model.embed_tokens.weight", cfg, "embed",
                                   params["embed"] if exact else None)
    if "lm_head" in params:
        params["lm_head"][:, v:] = _padding(weights, "lm_head.weight", cfg, "lm_head",
                                            params["lm_head"].T if exact else None).T
    return params, cfg, info


def _stored(params: Mapping[str, Any], tensor: HFTensor) -> Any:
    """The olmax array an HF tensor lives in (one layer's slice of a stacked one)."""
    x = params
    for key in tensor.path:
        x = x[key]
    return x if tensor.layer is None else x[tensor.layer]


def open_hf(hf_dir: str | os.PathLike, *, padded_vocab_size: int | None = None,
            collect_non_finite: bool = False) -> tuple[SafetensorsDir, ModelConfig, dict]:
    """An HF Olmo3 directory, checked (every tensor's name, shape and dtype against config.json)
    without reading any weights -> (weights, ModelConfig, source info: the original ``hf_config``
    and the files' ``hf_dtype``, so an export can reproduce the directory)."""
    hf_cfg = read_hf_config(hf_dir)       # (as given: a Path would fold a URL's "//")
    hf_dir = Path(hf_dir)
    cfg = model_config_from_hf(hf_cfg, where=str(hf_dir / "config.json"),
                               padded_vocab_size=padded_vocab_size)
    weights = SafetensorsDir(check_safetensors_dir(hf_dir), collect_non_finite=collect_non_finite)
    expected = hf_tensor_shapes(cfg)
    for name in weights.names():
        if name in expected or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and cfg.tie_embeddings:
            _check_tied_head(weights, hf_dir)
            continue
        raise OlmaxError(f"{weights.dir / weights.location[name]}: unexpected tensor '{name}' "
                         f"for {HF_ARCHITECTURE}")
    file_dtypes = set()
    for name, shape in expected.items():
        if name not in weights.location:
            raise OlmaxError(f"{hf_dir}: missing tensor '{name}'")
        got, st_dtype = weights.info(name)
        if got != shape:
            raise OlmaxError(f"{weights.dir / weights.location[name]}: tensor '{name}' has shape "
                             f"{list(got)}, config.json implies {list(shape)}")
        if st_dtype not in SAFETENSORS_DTYPES:
            raise OlmaxError(f"{weights.dir / weights.location[name]}: tensor '{name}' has "
                             f"unsupported dtype {st_dtype}")
        file_dtypes.add(SAFETENSORS_DTYPES[st_dtype].name)
    info = {"format": "hf", "path": str(hf_dir), "hf_config": hf_cfg,
            "hf_dtype": file_dtypes.pop() if len(file_dtypes) == 1 else None}
    return weights, cfg, info


TIE_CHECK_BYTES = 64 << 20     # rows of the embedding and the LM head compared at once


def _check_tied_head(weights: SafetensorsDir, hf_dir: Path) -> None:
    """A tied model (``tie_word_embeddings: true``) whose files also hold ``lm_head.weight``:
    transformers ties the two only when they are equal, and otherwise computes with the file's
    LM head; olmax ties them, so a different one is refused (compared a block of rows at a
    time)."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    shape, _ = weights.info(embed)
    if weights.info(head)[0] != shape:
        raise OlmaxError(f"{hf_dir}/config.json: tie_word_embeddings is true, but {head} has shape "
                         f"{list(weights.info(head)[0])}, {embed} {list(shape)}")
    step = max(1, TIE_CHECK_BYTES // max(1, 4 * math.prod(shape[1:])))
    for a in range(0, shape[0], step):
        b = min(a + step, shape[0])
        if not np.array_equal(weights.read_rows(embed, a, b), weights.read_rows(head, a, b)):
            raise OlmaxError(f"{hf_dir}/config.json: tie_word_embeddings is true, but the files' "
                             f"{head} differs from {embed} (from row {a}): transformers then "
                             f"computes with {head}, untied; set tie_word_embeddings to false")


def _padding(weights: SafetensorsDir, name: str, cfg: ModelConfig, which: str,
             rows: np.ndarray | None = None) -> np.ndarray:
    """The padding rows ``[vocab_size, padded_vocab_size)`` of an HF embedding or LM head, as
    OLMo-core's HF loader makes them (:mod:`olmax.interop.vocab_padding`); float32, HF layout.
    The tensor's rows come from ``rows`` (HF layout, the file's values) or the file."""
    _, code = weights.info(name)
    read = (lambda a, b: rows[a:b]) if rows is not None else (
        lambda a, b: weights.read_rows(name, a, b))
    return padding_rows(read, cfg.vocab_size, cfg.d_model, cfg.padded_vocab_size,
                        SAFETENSORS_DTYPES[code], which=which)


def streamed_params(weights: SafetensorsDir, cfg: ModelConfig, dtype: str) -> dict:
    """The olmax params of an HF directory as a tree of :class:`StreamedArray` leaves: each block
    the checkpoint writer asks for is read from the safetensors files when asked (vocabulary
    rows, one layer's tensor), transposed and cast to ``dtype``; the padding rows are made as
    OLMo-core's HF loader makes them (computed once, from two passes over the rows)."""
    target = stored_dtype(dtype)
    v = cfg.vocab_size
    last: dict[str, np.ndarray] = {}      # the most recent layer tensor (a chunk may be part of one)
    pads: dict[str, np.ndarray] = {}

    def pad(name: str, which: str, a: int, b: int) -> np.ndarray:
        """Padding rows [a, b) (absolute vocabulary indices >= v), HF layout."""
        if name not in pads:
            pads[name] = _padding(weights, name, cfg, which)
        return pads[name][a - v:b - v]

    def layer_tensor(name: str, transposed: bool) -> np.ndarray:
        if name not in last:
            last.clear()
            t = weights.read(name)
            last[name] = t.T if transposed else t
        return last[name]

    def layer(p: Param):
        def read(index):
            layers, rest = index[0], index[1:]
            return np.stack([layer_tensor(p.hf.format(i=i), p.hf_transposed)[rest]
                             for i in range(*layers.indices(cfg.n_layers))]).astype(target)
        return read

    def vocab_rows(p: Param, k: int):
        """A weight with a (padded) vocabulary axis ``k``: the HF tensor's rows are the vocabulary,
        then the padding rows."""
        shape = p.shape(cfg)

        def read(index):
            a, b, _ = index[k].indices(cfg.padded_vocab_size)
            # The padding rows first: making them reads the whole tensor twice, and doing that
            # before this block's rows and output exist keeps one of them in memory at a time.
            padding = pad(p.hf, p.name, max(a, v), b) if max(a, v) < b else None
            out = np.empty(tuple(len(range(*s.indices(n))) for s, n in zip(index, shape)), target)

            def put(lo: int, hi: int, rows: np.ndarray) -> None:   # vocabulary rows [lo, hi)
                t = rows.T if p.hf_transposed else rows
                block = t[tuple(slice(None) if j == k else s for j, s in enumerate(index))]
                out[tuple(slice(lo - a, hi - a) if j == k else slice(None)
                          for j in range(len(shape)))] = block

            if a < min(b, v):
                put(a, min(b, v), weights.read_rows(p.hf, a, min(b, v)))
            if padding is not None:
                put(max(a, v), b, padding)
            return out
        return read

    def whole(p: Param):
        def read(index):
            t = weights.read(p.hf)
            return (t.T if p.hf_transposed else t)[index].astype(target)
        return read

    tree: dict[str, Any] = {}
    for p in params_of(cfg):
        axes = p.axes(cfg)
        if p.layer:
            reader = layer(p)
        else:
            reader = vocab_rows(p, axes.index("vocab")) if "vocab" in axes else whole(p)
        node = tree.setdefault("layers", {}) if p.layer else tree
        node[p.name] = StreamedArray(p.full_shape(cfg), target, reader, stacked=p.layer)
    return tree


def _hf_order(name: str) -> tuple:
    """Sort key: HF module order (embedding, layers by index, norm, head)."""
    if name.startswith("model.layers."):
        i, suffix = _layer_index(name)
        return (1, i, suffix)
    return (0 if "embed" in name else 2, 0, name)


def _layer_index(name: str) -> tuple[int, str]:
    """``model.layers.{i}.{suffix}`` -> (i, suffix)."""
    _, _, i, suffix = name.split(".", 3)
    return int(i), suffix


def _tree_map_shapes(fn, shapes: dict) -> dict:
    return {k: _tree_map_shapes(fn, v) if isinstance(v, dict) else fn(v) for k, v in shapes.items()}


def iter_hf_tensors(params: Mapping[str, Any], cfg: ModelConfig, dtype: str
                    ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, contiguous [out, in] numpy array in ``dtype``) for every tensor, one at a time."""
    target = stored_dtype(dtype)
    for tensor in hf_tensors(cfg):
        x = params
        for key in tensor.path:
            x = x[key]
        # Slice before converting: np.asarray on a whole jax array would keep a cached host
        # copy of the full stacked parameter alive. A layer is read as x[i] (a stored array
        # names the layer when it finds NaN/Inf there).
        index = tensor.index if tensor.layer is None else tensor.layer
        w = x[index] if isinstance(x, np.ndarray) else np.asarray(x[index])
        w = w if tensor.layer is None else w[tensor.index]
        w = w.T if tensor.transposed else w
        yield tensor.name, np.ascontiguousarray(w.astype(target, copy=False))


def write_hf_dir(out_dir: Path, params: Mapping[str, Any], cfg: ModelConfig, *, dtype: str,
                 base_config: Mapping[str, Any] | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write config.json and safetensors (sharded with an index when over ``max_shard_bytes``)
    into the existing directory ``out_dir``, streaming: one tensor is in memory at a time."""
    target = stored_dtype(dtype)
    shapes = hf_tensor_shapes(cfg)
    shard_of = plan_shards(shapes, target.itemsize, max_shard_bytes)
    fnames = list(dict.fromkeys(shard_of.values()))
    n = len(fnames)
    tensors = iter_hf_tensors(params, cfg, dtype)   # in the order of ``shapes``, like the shards
    total = 0
    for fname in fnames:
        layout = [(name, shape, target) for name, shape in shapes.items() if shard_of[name] == fname]
        total += write_safetensors(out_dir / fname, layout, (next(tensors) for _ in layout))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": shard_of}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    hf_cfg = hf_config_from_model(cfg, dtype=dtype, base=base_config)
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------
# Conversions (what ``olmax convert`` runs)


def convert_hf_to_olmax(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        dtype: str = "float32") -> Path:
    """HF ``Olmo3ForCausalLM`` directory -> olmax step dir (params + meta with the HF source).

    Streams: each chunk of the checkpoint is read from the safetensors files as it is written,
    so the host holds one chunk (at most one layer's tensor or a block of vocabulary rows)."""
    check_output_dir(out_dir)
    stored_dtype(dtype)
    weights, cfg, info = open_hf(hf_dir, collect_non_finite=True)
    padding = vocab_padding.record(cfg, in_softmax=False, init=vocab_padding.IMPORTED)
    return save_params(out_dir, streamed_params(weights, cfg, dtype), cfg,
                       extra_meta={"source": info, vocab_padding.META_KEY: padding},
                       before_commit=lambda: weights.check_non_finite(_hf_order))


def convert_olmax_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        dtype: str | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """olmax checkpoint -> HF directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    ``dtype`` None: the dtype of the HF directory the checkpoint was imported from, else float32.
    """
    check_output_dir(out_dir)
    if dtype is not None:
        stored_dtype(dtype)
    meta = load_meta(ckpt_dir)
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    dtype = dtype or source.get("hf_dtype") or "float32"
    if dtype not in STORED_DTYPES:
        dtype = "float32"
    cfg = load_model_config(ckpt_dir)
    hf_config_from_model(cfg, dtype=dtype, base=source.get("hf_config"))  # fail before reading
    params, cfg = stored_arrays(ckpt_dir)       # read slice by slice as the tensors are written
    with atomic_output_dir(out_dir) as tmp:
        write_hf_dir(tmp, params, cfg, dtype=dtype, base_config=source.get("hf_config"),
                     max_shard_bytes=max_shard_bytes)
    return Path(out_dir)
