"""Hugging Face ``Olmo3ForCausalLM`` directories <-> olmax params, without torch.

Config (``config.json``, transformers ``configuration_olmo3.py``) -> :class:`ModelConfig`:

- ``layer_types`` (``sliding_attention`` | ``full_attention`` per layer; default: every 4th layer
  full) with ``sliding_window`` -> ``window_pattern``, the shortest period that repeats to the
  layer list (HF's sliding mask ``kv_idx > q_idx - sliding_window`` is olmax's window W).
- RoPE: v5 ``rope_parameters`` keyed by layer type, or v4.57 ``rope_theta`` + ``rope_scaling``
  (scaling on full-attention layers only). Default and YaRN types; one theta for all layers.
  Where a type entry has no ``rope_theta`` the top-level ``rope_theta`` applies to every layer (the
  v4.57 meaning; transformers 5.24 silently gives sliding layers 500000 in that case).
- ``rms_norm_eps``, ``tie_word_embeddings``, GQA (``num_key_value_heads``), ``head_dim``.
- QK-norm is full-width and blocks are reordered post-norm (the only Olmo3 form).

Weights (``model.safetensors`` or a sharded ``model.safetensors.index.json``; F32/BF16/F16) map
tensor by tensor into the stacked olmax pytree as :data:`olmax.model.params.PARAMS` declares: e.g.
``model.layers.{i}.self_attn.q_proj.weight`` is ``layers.q_proj[i]`` transposed (HF linear weights
are [out, in], olmax [in, out]); ``post_attention_layernorm``/``post_feedforward_layernorm`` are
``attn_norm``/``mlp_norm`` (on the sub-layer outputs); ``lm_head.weight`` is ``lm_head`` transposed.

The HF vocabulary (``vocab_size`` rows, e.g. dolma2's 100278) is padded to a multiple of 128
(OLMo-core's ``padded_vocab_size``, 100352) on import and cut back on export; the padding rows start
as OLMo-core's HF loader makes them and stay out of an imported model's softmax
(:mod:`olmax.interop.vocab_padding`). Only safetensors directories are read
(:func:`check_safetensors_dir`), and a tensor holding NaN/Inf is refused by name as it is read. Both directions
stream (``benchmarks/convert_scale.py`` measures them): import hands the checkpoint writer
:class:`~olmax.checkpoint.params.StreamedArray` leaves that read each chunk (one layer's tensor, a block
of vocabulary rows) from the safetensors files with plain reads as it is written; export reads
the checkpoint slice by slice and writes each shard's header first, then its tensors one at a
time. Neither holds more than a chunk and a tensor. Import then export reproduces every tensor bit
for bit (export defaults to the imported file's dtype). Outputs are written atomically.
:func:`load_hf` (training's ``init.hf_dir``, parity) reads the whole model into numpy instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

from olmax.checkpoint.params import (StreamedArray, load_meta, load_model_config, save_params,
                                     stored_arrays)
from olmax.config import ConfigError, ModelConfig, OlmaxError, YarnConfig
from olmax.interop import vocab_padding
from olmax.interop.vocab_padding import padding_rows
from olmax.io import atomic_output_dir, check_output_dir, read_text
from olmax.model.finite import raise_non_finite, tensor_problem
from olmax.model.params import HFTensor, Param, hf_tensors, param_shapes, params_of
from olmax.model.runtime import dtype_of

HF_ARCHITECTURE = "Olmo3ForCausalLM"
HF_MODEL_TYPE = "olmo3"
VOCAB_MULTIPLE = 128
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_ROPE_THETA = 500_000.0      # transformers Olmo3Config.default_theta
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

DTYPES = {name: np.dtype(dtype_of(name)) for name in ("float32", "bfloat16")}   # stored dtypes
_SAFETENSORS_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
                       "F16": np.dtype(np.float16)}

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some old exports contain


def dtype_of(name: str) -> np.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unsupported dtype '{name}' (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


# ----------------------------------------------------------------------------------------------
# Config


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")


def check_safetensors_dir(hf_dir: str | os.PathLike) -> Path:
    """``hf_dir`` as a Path when it is a directory with safetensors weights (``model.safetensors``
    or its sharded index). Any other HF directory is refused before a byte of it is read: the
    pickle formats (``pytorch_model.bin``, ``.pt``, ...) can run code when loaded."""
    d = Path(hf_dir)
    if not d.is_dir():
        if d.exists():
            raise OlmaxError(f"{d} is a file, not a Hugging Face model directory")
        raise OlmaxError(f"Hugging Face model directory not found: {d}")
    if (d / SINGLE_FILE).is_file() or (d / INDEX_FILE).is_file():
        return d
    pickled = sorted({p.name for pattern in PICKLE_WEIGHTS for p in d.glob(pattern)})
    if pickled:
        raise OlmaxError(f"{d} holds {', '.join(pickled[:3])} but no {SINGLE_FILE}: olmax reads "
                         f"safetensors weights only (pickled weights can run code when loaded); "
                         f"convert the directory to safetensors first")
    raise OlmaxError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE} (not a Hugging Face safetensors model "
                     f"directory)")


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    """``config.json`` of an HF directory, as a dict (its weights are not looked at here: see
    :func:`check_safetensors_dir`)."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        if Path(hf_dir).exists():
            raise OlmaxError(f"{hf_dir} is a file, not a Hugging Face model directory")
        raise OlmaxError(f"Hugging Face model directory not found: {hf_dir}")
    if not path.is_file():
        raise OlmaxError(f"{path}: missing (not a Hugging Face model directory)")
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise OlmaxError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise OlmaxError(f"{path}: top level must be an object")
    return data


def _minimal_period(seq: list) -> tuple:
    n = len(seq)
    for p in range(1, n + 1):
        if n % p == 0 and all(seq[i] == seq[i % p] for i in range(n)):
            return tuple(seq[:p])
    return tuple(seq)


def _rope_type(params: Mapping[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def _rope_from_hf(hf: Mapping[str, Any], used_types: set[str], where: str
                  ) -> tuple[float, YarnConfig | None]:
    """(theta, YaRN or None) from v5 ``rope_parameters`` or v4.57 ``rope_theta``/``rope_scaling``."""
    top_theta = float(hf.get("rope_theta") or DEFAULT_ROPE_THETA)
    rp = hf.get("rope_parameters")
    legacy_scaling = hf.get("rope_scaling")
    if rp is not None and not isinstance(rp, Mapping):
        raise OlmaxError(f"{where}: rope_parameters must be an object")
    if rp and ("sliding_attention" in rp or "full_attention" in rp):
        per = {t: dict(rp.get(t) or {}) for t in ("sliding_attention", "full_attention")}
    elif rp:  # one flat entry for every layer type
        per = {t: dict(rp) for t in ("sliding_attention", "full_attention")}
    else:
        per = {t: {} for t in ("sliding_attention", "full_attention")}
    if legacy_scaling:  # merged into the full-attention layers, as transformers does
        if not isinstance(legacy_scaling, Mapping):
            raise OlmaxError(f"{where}: rope_scaling must be an object or null")
        per["full_attention"].update(legacy_scaling)

    thetas = {t: float(per[t].get("rope_theta") or top_theta) for t in used_types}
    if len(set(thetas.values())) > 1:
        raise OlmaxError(f"{where}: different rope_theta per layer type ({thetas}) is not supported")
    theta = next(iter(thetas.values())) if thetas else top_theta

    yarns = {}
    for t in used_types:
        kind = _rope_type(per[t])
        if kind == "default":
            continue
        if kind != "yarn":
            raise OlmaxError(f"{where}: rope_type '{kind}' on {t} layers is not supported "
                             f"(OLMo 3 uses default RoPE and YaRN)")
        p = per[t]
        if p.get("mscale") or p.get("mscale_all_dim"):
            raise OlmaxError(f"{where}: YaRN mscale/mscale_all_dim is not supported")
        if p.get("truncate", True) is not True:
            raise OlmaxError(f"{where}: YaRN truncate=false is not supported")
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise OlmaxError(f"{where}: partial_rotary_factor != 1 is not supported")
        orig = int(p.get("original_max_position_embeddings") or hf.get("max_position_embeddings"))
        factor = p.get("factor")
        factor = float(factor) if factor is not None else hf["max_position_embeddings"] / orig
        yarns[t] = YarnConfig(factor=factor, beta_fast=float(p.get("beta_fast") or 32.0),
                              beta_slow=float(p.get("beta_slow") or 1.0),
                              original_max_position_embeddings=orig,
                              attention_factor=(None if p.get("attention_factor") is None
                                                else float(p["attention_factor"])))
    if not yarns:
        return theta, None
    if "sliding_attention" in yarns:
        full = yarns.get("full_attention")
        if "full_attention" in used_types and full != yarns["sliding_attention"]:
            raise OlmaxError(f"{where}: YaRN on sliding-window layers only is not supported")
        return theta, dataclasses.replace(yarns["sliding_attention"], full_attention_only=False)
    return theta, yarns["full_attention"]


def model_config_from_hf(hf: Mapping[str, Any], *, where: str = "config.json",
                         padded_vocab_size: int | None = None) -> ModelConfig:
    """An HF ``Olmo3ForCausalLM`` config dict -> ModelConfig (other architectures: OlmaxError)."""
    try:
        return _model_config_from_hf(hf, where, padded_vocab_size)
    except ConfigError as e:
        raise OlmaxError(f"{where}: {e}") from None
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        raise OlmaxError(f"{where}: malformed Olmo3 config ({type(e).__name__}: {e})") from None


def _model_config_from_hf(hf: Mapping[str, Any], where: str,
                          padded_vocab_size: int | None) -> ModelConfig:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type != HF_MODEL_TYPE or (archs and HF_ARCHITECTURE not in archs):
        found = f"model_type '{model_type}'" + (f" ({', '.join(archs)})" if archs else "")
        raise OlmaxError(f"{where}: {found} is not supported; olmax imports {HF_ARCHITECTURE} only")

    def req(key: str) -> Any:
        if hf.get(key) is None:
            raise OlmaxError(f"{where}: missing '{key}'")
        return hf[key]

    for key, ok in (("hidden_act", "silu"), ("attention_bias", False)):
        if key in hf and hf[key] != ok:
            raise OlmaxError(f"{where}: {key}={hf[key]!r} is not supported (Olmo3 uses {ok!r})")
    d_model, n_layers = int(req("hidden_size")), int(req("num_hidden_layers"))
    n_heads = int(req("num_attention_heads"))
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or d_model // n_heads)
    vocab = int(req("vocab_size"))
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise OlmaxError(f"{where}: layer_types has {len(layer_types)} entries for "
                         f"{n_layers} layers")
    bad_types = set(layer_types) - {"sliding_attention", "full_attention"}
    if bad_types:
        raise OlmaxError(f"{where}: unknown layer type(s) {sorted(bad_types)}")
    window = hf.get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise OlmaxError(f"{where}: sliding_attention layers need a positive sliding_window")
    windows = [int(window) if t == "sliding_attention" else None for t in layer_types]
    theta, yarn = _rope_from_hf(hf, set(layer_types), where)
    return ModelConfig(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, mlp_hidden=int(req("intermediate_size")), vocab_size=vocab,
        padded_vocab_size=padded_vocab_size or VOCAB_MULTIPLE * math.ceil(vocab / VOCAB_MULTIPLE),
        rope_theta=theta, rope_scaling=yarn, norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        qk_norm="full", block_type="reordered_norm", window_pattern=_minimal_period(windows),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings") or 8192))


def _rope_entry(cfg: ModelConfig, yarn: YarnConfig | None) -> dict:
    if yarn is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    entry = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": yarn.factor,
             "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
             "original_max_position_embeddings": yarn.original_max_position_embeddings}
    if yarn.attention_factor is not None:
        entry["attention_factor"] = yarn.attention_factor
    return entry


def _same_rope(base: Mapping[str, Any] | None, cfg: ModelConfig) -> bool:
    if not base:
        return False
    try:
        other = model_config_from_hf(base)
    except OlmaxError:
        return False
    return (other.rope_theta, other.rope_scaling, other.layer_windows()) == (
        cfg.rope_theta, cfg.rope_scaling, cfg.layer_windows())


def hf_config_from_model(cfg: ModelConfig, *, dtype: str = "float32",
                         base: Mapping[str, Any] | None = None) -> dict:
    """ModelConfig -> an ``Olmo3ForCausalLM`` config dict (v5 ``rope_parameters`` plus the v4.57
    ``rope_theta``/``rope_scaling`` keys). Fields the model does not determine (token ids,
    ...) come from ``base`` (the imported config) when given, else dolma2's."""
    if cfg.qk_norm != "full" or cfg.block_type != "reordered_norm":
        raise OlmaxError(f"cannot export to {HF_ARCHITECTURE}: it needs qk_norm='full' and "
                         f"block_type='reordered_norm' (got {cfg.qk_norm!r}, {cfg.block_type!r})")
    windows = cfg.layer_windows()
    sliding = sorted({w for w in windows if w is not None})
    if len(sliding) > 1:
        raise OlmaxError(f"cannot export to {HF_ARCHITECTURE}: it has one sliding_window, "
                         f"the model uses {sliding}")
    yarn = cfg.rope_scaling
    out = dict(base or {})
    rope_keys = ("rope_scaling", "rope_parameters", "rope_theta")
    kept_rope = {k: out[k] for k in rope_keys if k in out} if _same_rope(base, cfg) else None
    for k in rope_keys + ("torch_dtype", "head_dim", "transformers_version"):
        out.pop(k, None)
    if base is None:
        dolma2 = cfg.vocab_size > 100277
        out.update(pad_token_id=100277 if dolma2 else None, eos_token_id=100257 if dolma2 else None,
                   bos_token_id=None)
    out.update(
        architectures=[HF_ARCHITECTURE], model_type=HF_MODEL_TYPE, vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
        attention_dropout=out.get("attention_dropout", 0.0),
        sliding_window=sliding[0] if sliding else None,
        layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
        rope_parameters={
            "full_attention": _rope_entry(cfg, yarn),
            "sliding_attention": _rope_entry(
                cfg, yarn if yarn is not None and not yarn.full_attention_only else None)},
        rope_theta=cfg.rope_theta,
        rope_scaling=({k: v for k, v in _rope_entry(cfg, yarn).items() if k != "rope_theta"}
                      if yarn is not None else None),
        dtype=dtype)
    if kept_rope is not None:  # the imported spelling, when it means the same RoPE
        for k in rope_keys:
            out.pop(k)
        out.update(kept_rope)
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        out["head_dim"] = cfg.head_dim
    return out


# ----------------------------------------------------------------------------------------------
# Tensors


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF state dict (name -> [out, in] shape) of ``cfg``, in HF's module order."""
    return {t.name: t.shape for t in hf_tensors(cfg)}


_MAX_HEADER_BYTES = 100 << 20


def read_safetensors_header(path: Path) -> tuple[int, dict[str, dict]]:
    """``(data start offset, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors file,
    checked against the file's size (a truncated or foreign file is an OlmaxError naming it)."""
    def bad(why: str) -> OlmaxError:
        return OlmaxError(f"{path}: unreadable safetensors file ({why})")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            n = struct.unpack("<Q", head)[0]
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise bad(f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
    except OSError as e:
        raise OlmaxError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + n
    for name, entry in header.items():
        try:
            shape = [int(d) for d in entry["shape"]]
            lo, hi = (int(o) for o in entry["data_offsets"])
            code = str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"malformed entry for '{name}'") from None
        dt = _SAFETENSORS_DTYPES.get(code)
        if dt is not None and hi - lo != math.prod(shape) * dt.itemsize:
            raise bad(f"tensor '{name}' {shape} {code} spans {hi - lo} bytes")
        if not 0 <= lo <= hi or start + hi > size:
            raise bad(f"tensor '{name}' lies past the end of the file ({size} bytes; truncated?)")
    return start, header


class SafetensorsDir:
    """The weights of an HF directory (single file or sharded index), read tensor by tensor (or
    by row ranges) with plain reads: no memory map, so nothing but the requested bytes enters
    the process.

    Every block read is checked for NaN/Inf: an OlmaxError naming the tensor, or with
    ``collect_non_finite`` the tensor's name is noted in :attr:`non_finite` and reading goes on
    (a streaming writer fails after its last write instead of inside its writer threads, and
    every bad tensor is named)."""

    def __init__(self, hf_dir: str | os.PathLike, *, collect_non_finite: bool = False):
        self.dir = Path(hf_dir)
        self.collect_non_finite = collect_non_finite
        self.non_finite: dict[str, str] = {}     # tensor name -> file
        index, single = self.dir / INDEX_FILE, self.dir / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise OlmaxError(f"{index}: not a safetensors index (no weight_map)") from None
        elif single.is_file():
            weight_map = None
        else:
            raise OlmaxError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self._entries: dict[str, tuple[str, int, dict]] = {}   # name -> (file, data start, entry)
        self.location: dict[str, str] = {}
        for fname in files:
            path = self.dir / fname
            if not path.is_file():
                raise OlmaxError(f"{path}: missing (listed in {INDEX_FILE})")
            start, header = read_safetensors_header(path)
            for k, entry in header.items():
                if k not in self.location:
                    self.location[k] = fname
                    self._entries[k] = (fname, start, entry)
        if weight_map:
            for name, fname in weight_map.items():
                if self.location.get(name) != fname:
                    raise OlmaxError(f"{self.dir / fname}: has no tensor '{name}' "
                                     f"(listed in {INDEX_FILE})")

    def names(self) -> list[str]:
        return list(self.location)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        entry = self._entries[name][2]
        return tuple(int(d) for d in entry["shape"]), str(entry["dtype"])

    def read(self, name: str) -> np.ndarray:
        shape, _ = self.info(name)
        return self.read_rows(name, 0, shape[0] if shape else 1).reshape(shape)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (along the first axis) of a tensor, as a new numpy array."""
        fname, data_start, entry = self._entries[name]
        shape, code = self.info(name)
        dt = _SAFETENSORS_DTYPES[code]
        row = math.prod(shape[1:]) * dt.itemsize
        out = np.empty((stop - start, *shape[1:]), dt)
        view = memoryview(out.reshape(-1).view(np.uint8))
        path = self.dir / fname
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(data_start + int(entry["data_offsets"][0]) + start * row)
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise OlmaxError(f"{path}: cannot read tensor '{name}' (file truncated)")
                    got += n
        except OSError as e:
            raise OlmaxError(f"{path}: cannot read tensor '{name}' ({e.strerror})") from None
        problem = tensor_problem(name if (start, stop) == (0, shape[0] if shape else 1)
                                 else f"{name} rows {start}..{stop - 1}", out)
        if problem and not self.collect_non_finite:
            raise_non_finite(str(path), [problem])
        if problem:
            self.non_finite[name] = fname
        return out

    def check_non_finite(self) -> None:
        """Raise an OlmaxError naming every tensor found non-finite while collecting."""
        files = sorted({str(self.dir / f) for f in self.non_finite.values()})
        raise_non_finite(", ".join(files), sorted(self.non_finite, key=_hf_order))


def load_hf(hf_dir: str | os.PathLike, *, dtype: str = "float32",
            padded_vocab_size: int | None = None) -> tuple[dict, ModelConfig, dict]:
    """Read an HF Olmo3 directory -> (numpy params in ``dtype``, ModelConfig, source info).

    The source info holds the original ``hf_config`` and the file's ``hf_dtype`` (so an export
    can reproduce the directory). Every tensor is checked against the config's shapes.
    """
    target = dtype_of(dtype)
    weights, cfg, info = open_hf(hf_dir, padded_vocab_size=padded_vocab_size)
    expected = hf_tensor_shapes(cfg)
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
    hf_dir = Path(hf_dir)
    hf_cfg = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf_cfg, where=str(hf_dir / "config.json"),
                               padded_vocab_size=padded_vocab_size)
    weights = SafetensorsDir(check_safetensors_dir(hf_dir), collect_non_finite=collect_non_finite)
    expected = hf_tensor_shapes(cfg)
    for name in weights.names():
        if name in expected or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and cfg.tie_embeddings:
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
        if st_dtype not in _SAFETENSORS_DTYPES:
            raise OlmaxError(f"{weights.dir / weights.location[name]}: tensor '{name}' has "
                             f"unsupported dtype {st_dtype}")
        file_dtypes.add(_SAFETENSORS_DTYPES[st_dtype].name)
    info = {"format": "hf", "path": str(hf_dir), "hf_config": hf_cfg,
            "hf_dtype": file_dtypes.pop() if len(file_dtypes) == 1 else None}
    return weights, cfg, info


def _padding(weights: SafetensorsDir, name: str, cfg: ModelConfig, which: str,
             rows: np.ndarray | None = None) -> np.ndarray:
    """The padding rows ``[vocab_size, padded_vocab_size)`` of an HF embedding or LM head, as
    OLMo-core's HF loader makes them (:mod:`olmax.interop.vocab_padding`); float32, HF layout.
    The tensor's rows come from ``rows`` (HF layout, the file's values) or the file."""
    _, code = weights.info(name)
    read = (lambda a, b: rows[a:b]) if rows is not None else (
        lambda a, b: weights.read_rows(name, a, b))
    return padding_rows(read, cfg.vocab_size, cfg.d_model, cfg.padded_vocab_size,
                        _SAFETENSORS_DTYPES[code], which=which)


def streamed_params(weights: SafetensorsDir, cfg: ModelConfig, dtype: str) -> dict:
    """The olmax params of an HF directory as a tree of :class:`StreamedArray` leaves: each block
    the checkpoint writer asks for is read from the safetensors files when asked (vocabulary
    rows, one layer's tensor), transposed and cast to ``dtype``; the padding rows are made as
    OLMo-core's HF loader makes them (computed once, from two passes over the rows)."""
    target = dtype_of(dtype)
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
    target = dtype_of(dtype)
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


_SAFETENSORS_NAMES = {dt.name: code for code, dt in _SAFETENSORS_DTYPES.items()}


def _write_safetensors(path: Path, layout: list[tuple[str, tuple[int, ...], np.dtype]],
                       arrays: Iterable[tuple[str, np.ndarray]]) -> int:
    """Write one safetensors file tensor by tensor: the header (from ``layout``: name, shape,
    dtype in file order) first, then each array of ``arrays`` as it comes, so only one tensor is
    in memory. Format: u64 little-endian header length, the JSON header (``data_offsets`` relative
    to the data section, padded with spaces to 8 bytes), the tensors' bytes back to back.
    Returns the data bytes written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dt in layout:
        nbytes = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": _SAFETENSORS_NAMES[dt.name], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        it = iter(arrays)
        for name, shape, dt in layout:
            got_name, a = next(it)
            if got_name != name or tuple(a.shape) != tuple(shape) or a.dtype != dt:
                raise ValueError(f"{path}: expected {name} {shape} {dt}, got {got_name} "
                                 f"{a.shape} {a.dtype}")
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    return offset


def plan_shards(shapes: Mapping[str, tuple[int, ...]], itemsize: int,
                max_shard_bytes: int) -> dict[str, str]:
    """Tensor name -> safetensors file name: tensors in order, a new shard whenever the next one
    would pass ``max_shard_bytes`` (HF's ``model-0000k-of-0000n.safetensors`` names; one
    ``model.safetensors`` when everything fits)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    n = len(shards)
    fnames = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                                          for k in range(n)]
    return {name: fnames[k] for k, names in enumerate(shards) for name in names}


def write_hf_dir(out_dir: Path, params: Mapping[str, Any], cfg: ModelConfig, *, dtype: str,
                 base_config: Mapping[str, Any] | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write config.json and safetensors (sharded with an index when over ``max_shard_bytes``)
    into the existing directory ``out_dir``, streaming: one tensor is in memory at a time."""
    target = dtype_of(dtype)
    shapes = hf_tensor_shapes(cfg)
    shard_of = plan_shards(shapes, target.itemsize, max_shard_bytes)
    fnames = list(dict.fromkeys(shard_of.values()))
    n = len(fnames)
    tensors = iter_hf_tensors(params, cfg, dtype)   # in the order of ``shapes``, like the shards
    total = 0
    for fname in fnames:
        layout = [(name, shape, target) for name, shape in shapes.items() if shard_of[name] == fname]
        total += _write_safetensors(out_dir / fname, layout, (next(tensors) for _ in layout))
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
    dtype_of(dtype)
    weights, cfg, info = open_hf(hf_dir, collect_non_finite=True)
    padding = vocab_padding.record(cfg, in_softmax=False, init=vocab_padding.IMPORTED)
    return save_params(out_dir, streamed_params(weights, cfg, dtype), cfg,
                       extra_meta={"source": info, vocab_padding.META_KEY: padding},
                       before_commit=weights.check_non_finite)


def convert_olmax_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        dtype: str | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """olmax checkpoint -> HF directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    ``dtype`` None: the dtype of the HF directory the checkpoint was imported from, else float32.
    """
    check_output_dir(out_dir)
    if dtype is not None:
        dtype_of(dtype)
    meta = load_meta(ckpt_dir)
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    dtype = dtype or source.get("hf_dtype") or "float32"
    if dtype not in DTYPES:
        dtype = "float32"
    cfg = load_model_config(ckpt_dir)
    hf_config_from_model(cfg, dtype=dtype, base=source.get("hf_config"))  # fail before reading
    params, cfg = stored_arrays(ckpt_dir)       # read slice by slice as the tensors are written
    with atomic_output_dir(out_dir) as tmp:
        write_hf_dir(tmp, params, cfg, dtype=dtype, base_config=source.get("hf_config"),
                     max_shard_bytes=max_shard_bytes)
    return Path(out_dir)


__all__ = ["read_hf_config", "check_safetensors_dir", "model_config_from_hf", "hf_config_from_model", "hf_tensor_shapes",
           "SafetensorsDir", "load_hf", "iter_hf_tensors", "write_hf_dir", "convert_hf_to_olmax",
           "convert_olmax_to_hf", "HF_ARCHITECTURE", "DTYPES"]
