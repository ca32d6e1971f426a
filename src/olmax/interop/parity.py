"""Logit parity between HF transformers (torch, CPU) and olmax on the same token batches.

Both models see identical token ids. HF runs ``Olmo3ForCausalLM`` with the eager attention
implementation (explicit mask, softmax in fp32: the reference math of ``modeling_olmo3.py``) in
the requested dtype; olmax runs :func:`olmax.model.forward` with that compute dtype from the same
weights (converted in memory, or an olmax checkpoint). Over every position and the first
``vocab_size`` logits (olmax's padded rows are not part of the HF model) it reports:

- ``kl_mean`` / ``kl_max``: KL(HF || olmax) per position, from log-softmaxes computed in float64;
- ``top1_agreement``: fraction of positions whose argmax agrees;
- ``max_abs_logit_diff``; the same KL mean/max over positions at or beyond the largest sliding
  window (``*_beyond_window``), where windowed attention is actually exercised.

Inputs are deterministic: uniform token ids from ``seed``, or the first ``batch * seq_len`` ids of
a token file (``.npy`` or raw uint32 as OLMo token files) or a text (tokenized with the HF
directory's ``tokenizer.json`` if present, else dolma2). torch and transformers are optional
dependencies imported only here.

A machine without torch (a TPU host) compares against HF's logits computed elsewhere: with
``save_reference`` a run with the reference writes its token ids and HF's logits to an ``.npz``
file (with the HF directory's config and weights fingerprinted), and ``reference`` reads them back
instead of running HF: the same tokens, the same report, for the same HF directory only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import time
import zipfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from olmax.checkpoint.weights import load_model_config, load_params
from olmax.config import ModelConfig
from olmax.errors import ConfigError, OlmaxError
from olmax.data.tokenizer import get_tokenizer
from olmax.interop.hf import load_hf
from olmax.interop.olmo_core.checkpoint import is_olmo_core_checkpoint, read_model_config
from olmax.interop.olmo_core.convert import read_weights as read_olmo_core_weights
from olmax.interop.hf_config import model_config_from_hf, read_hf_config
from olmax.interop.safetensors import check_safetensors_dir
from olmax.model.olmo3 import forward
from olmax.model.presets import describe_differences, differences
from olmax.model.runtime import Runtime

PARITY_DTYPES = ("float32", "bfloat16")


def _reference():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise OlmaxError(f"the parity tool needs torch and transformers ({e.name} is not installed; "
                         f"pip install 'olmax[test]')") from None
    return torch, transformers


# ----------------------------------------------------------------------------------------------
# Inputs


def default_seq_len(cfg: ModelConfig) -> int:
    """Twice the largest sliding window (so windows are exercised), capped at max_seq_len."""
    windows = [w for w in cfg.window_pattern if w is not None]
    want = 2 * max(windows) if windows else 512
    return min(want, cfg.max_seq_len)


def seeded_tokens(vocab_size: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, seq_len)).astype(np.int32)


NPY_MAGIC = b"\x93NUMPY"


def tokens_from_file(path: str | os.PathLike, batch: int, seq_len: int) -> np.ndarray:
    """The first batch*seq_len ids of a ``.npy`` array or a raw uint32 token file (told apart by
    the ``.npy`` magic bytes, not the name: OLMo's raw token files are named ``.npy`` too)."""
    p = Path(path)
    if not p.is_file():
        raise OlmaxError(f"token file not found: {p}" if not p.exists() else f"{p} is not a file")
    with open(p, "rb") as f:
        is_npy = f.read(len(NPY_MAGIC)) == NPY_MAGIC
    if is_npy:
        try:
            ids = np.load(p, mmap_mode="r", allow_pickle=False).reshape(-1)
        except ValueError as e:
            raise OlmaxError(f"{p}: not a numeric .npy array ({str(e).splitlines()[0]})") from None
        if ids.dtype.kind not in "iu":
            raise OlmaxError(f"{p}: a .npy array of {ids.dtype}, not token ids (integers)")
    elif p.stat().st_size % 4:
        raise OlmaxError(f"{p}: size {p.stat().st_size} bytes is not a multiple of 4 (raw uint32 "
                         f"token file) and it is no .npy array")
    else:
        ids = np.memmap(p, dtype=np.uint32, mode="r")
    need = batch * seq_len
    if ids.size < need:
        raise OlmaxError(f"{p}: has {ids.size} tokens, need batch*seq_len = {need}")
    return np.asarray(ids[:need], dtype=np.int64).astype(np.int32).reshape(batch, seq_len)


def tokens_from_text(text: str, hf_dir: str | os.PathLike, batch: int, seq_len: int) -> np.ndarray:
    tok_json = Path(hf_dir) / "tokenizer.json"
    tok = get_tokenizer(str(tok_json) if tok_json.is_file() else "dolma2")
    ids = np.asarray(tok.encode(text), dtype=np.int32)
    need = batch * seq_len
    if ids.size < need:
        raise OlmaxError(f"text has {ids.size} tokens, need batch*seq_len = {need}")
    return ids[:need].reshape(batch, seq_len)


# ----------------------------------------------------------------------------------------------
# Metrics


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def position_metrics(ref: np.ndarray, out: np.ndarray, chunk: int = 256
                     ) -> tuple[np.ndarray, np.ndarray, float]:
    """Per position KL(ref || out) (float64) and top-1 agreement, plus max |ref - out|.

    ``ref``/``out``: [T, V] logits over the same V ids; processed in chunks of positions.
    """
    kls, agree, max_diff = [], [], 0.0
    for s in range(0, ref.shape[0], chunk):
        r, o = ref[s:s + chunk], out[s:s + chunk]
        lr, lo = _log_softmax64(r), _log_softmax64(o)
        kls.append(np.sum(np.exp(lr) * (lr - lo), axis=-1))
        agree.append(np.argmax(r, axis=-1) == np.argmax(o, axis=-1))
        max_diff = max(max_diff, float(np.max(np.abs(r.astype(np.float64) - o.astype(np.float64)))))
    return np.concatenate(kls), np.concatenate(agree), max_diff


# ----------------------------------------------------------------------------------------------
# The comparison


# The reference's attention implementations parity offers (transformers' names).
HF_ATTN = ("eager", "sdpa")


def _hf_model(hf_dir: str | os.PathLike, dtype: str, attn: str = "eager"):
    torch, transformers = _reference()
    tdtype = getattr(torch, dtype)
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(hf_dir), dtype=tdtype, attn_implementation=attn, use_safetensors=True)
    except (OSError, ValueError) as e:
        raise OlmaxError(f"transformers cannot load {hf_dir}: {str(e).splitlines()[0]}") from None
    return model.eval()


def _hf_rope_dtype(model, dtype) -> str | None:
    """The dtype of the cos table HF's rotary embedding returns for ``dtype`` activations."""
    torch, _ = _reference()
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rot is None:
        return None
    x = torch.zeros(1, 1, 1, dtype=dtype)
    pos = torch.arange(1)[None]
    for kwargs in ({"layer_type": "full_attention"}, {}):
        try:
            cos, _ = rot(x, pos, **kwargs)
            return str(cos.dtype).replace("torch.", "")
        except TypeError:
            continue
    return None


def _hf_rope_warnings(model, cfg: ModelConfig) -> list[str]:
    """Where transformers' resolved per-layer-type RoPE theta differs from olmax's reading of
    config.json (transformers 5.x gives sliding layers its default 500000 when a v4.57-style
    config has only a top-level ``rope_theta``)."""
    rp = getattr(model.config, "rope_parameters", None) or {}
    out = []
    for t in sorted(set(getattr(model.config, "layer_types", None) or [])):
        theta = (rp.get(t) or {}).get("rope_theta") if isinstance(rp, dict) else None
        if theta is not None and float(theta) != cfg.rope_theta:
            out.append(f"transformers uses rope_theta {theta} on {t} layers; config.json "
                       f"(as olmax reads it) says {cfg.rope_theta}")
    return out


def _check_same_architecture(ckpt_cfg: ModelConfig, hf_cfg: ModelConfig, ckpt: Any,
                             hf_dir: Any) -> None:
    diff = differences(hf_cfg, ckpt_cfg)
    if diff:
        raise OlmaxError(f"checkpoint {ckpt} is another model than {hf_dir}: "
                         + describe_differences(hf_cfg, ckpt_cfg, diff, f"{hf_dir}/config.json",
                                                "the checkpoint"))


def run_parity(hf_dir: str | os.PathLike, *, checkpoint: str | os.PathLike | None = None,
               seq_len: int | None = None, batch: int = 1, dtype: str = "float32", seed: int = 0,
               tokens: np.ndarray | None = None, token_file: str | None = None,
               text: str | None = None, profile: str = "auto", attn_impl: str = "auto",
               hf_dtype: str | None = None, hf_attn: str = "eager",
               reference: str | os.PathLike | None = None,
               save_reference: str | os.PathLike | None = None) -> dict[str, Any]:
    """Run both models on the same batch and return the parity report (a JSON-able dict).
    ``profile``: the platform profile whose code path olmax runs (``auto``: this machine's
    devices'; ``cpu``, ``tpu``, ``gpu`` force it, see :mod:`olmax.platforms`), with its attention
    for ``attn_impl=auto``. ``hf_dtype``: the reference's dtype (default: ``dtype``), e.g.
    olmax in bfloat16 against HF in float32. ``hf_attn``: the reference's attention (``eager``, the
    default, holds [heads, T, T] scores; ``sdpa`` does not, for long sequences). ``reference``:
    HF's logits and their token ids from a file ``save_reference`` wrote (no torch needed; the
    inputs, ``hf_dtype`` and ``hf_attn`` are the file's); ``save_reference``: write them there."""
    hf_dtype = hf_dtype or dtype
    if hf_attn not in HF_ATTN:
        raise ConfigError(f"unsupported reference attention '{hf_attn}' (choose from {', '.join(HF_ATTN)})")
    for d in (dtype, hf_dtype):
        if d not in PARITY_DTYPES:
            raise ConfigError(f"unsupported dtype '{d}' (choose from {', '.join(PARITY_DTYPES)})")
    if batch < 1 or (seq_len is not None and seq_len < 1):
        raise ConfigError("batch and seq_len must be positive")
    runtime = Runtime.resolve(dtype, attn_impl=attn_impl, profile=profile)
    if reference is None:     # the reference implementations first: without them, nothing runs
        torch, transformers = _reference()
    params, cfg, source = _olmax_params(hf_dir, checkpoint, dtype)
    v = cfg.vocab_size
    rows: list[np.ndarray] = []       # HF's logits, kept for save_reference
    if reference is not None:
        saved = read_reference(reference, hf_dir, v)
        tokens, meta = saved["tokens"], saved["meta"]
        inputs = f"reference file {reference} ({meta['inputs']})"
        hf_dtype, hf_attn = meta["hf_dtype"], meta["hf_attn"]
        ref_fn: Any = lambda b, row: saved["logits"][b]  # noqa: E731
        hf_meta = {k: meta[k] for k in ("hf_attn_implementation", "hf_rope_dtype", "warnings", "versions")}
    else:
        tokens, inputs = _inputs(cfg, hf_dir, tokens, token_file, text, batch,
                                 seq_len or default_seq_len(cfg), seed)
        model = _hf_model(hf_dir, hf_dtype, hf_attn)
        ref_fn = hf_logits(model, v)
        hf_meta = {"hf_attn_implementation": getattr(model.config, "_attn_implementation", None) or hf_attn,
                   "hf_rope_dtype": _hf_rope_dtype(model, getattr(torch, hf_dtype)),
                   "warnings": _hf_rope_warnings(model, cfg),
                   "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}
        if save_reference is not None:
            ref_fn = _recording(ref_fn, rows)
    # fp32 means fp32: no TF32 / reduced-precision matmul passes on accelerators.
    with jax.default_matmul_precision("highest"):
        fwd = jax.jit(lambda p, t: forward(p, t, cfg, runtime))
    windows = [w for w in cfg.window_pattern if w is not None]
    kl, agree, far_kl, max_diff, t_hf, t_ox = _compare(ref_fn, fwd, params, tokens, v,
                                                       max(windows) if windows else None)
    if reference is None and save_reference is not None:
        write_reference(save_reference, hf_dir, tokens, np.stack(rows),
                        {"inputs": inputs, "hf_dtype": hf_dtype, "hf_attn": hf_attn, **hf_meta})
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": float(agree.mean()),
        "max_abs_logit_diff": max_diff,
        "num_positions": int(kl.size),
        "dtype": dtype,
        "hf_dtype": hf_dtype,
        "profile": runtime.profile_name,
        "attn_impl": runtime.attn_impl,
        "seq_len": int(tokens.shape[1]),
        "batch": int(tokens.shape[0]),
        "vocab_compared": int(v),
        "window_pattern": list(cfg.window_pattern),
        "num_positions_beyond_window": int(far_kl.size),
        "kl_mean_beyond_window": float(far_kl.mean()) if far_kl.size else None,
        "kl_max_beyond_window": float(far_kl.max()) if far_kl.size else None,
        "inputs": inputs,
        "olmax_params": source,
        "hf_attn_implementation": hf_meta["hf_attn_implementation"],
        "olmax_device": jax.devices()[0].device_kind,
        "hf_rope_dtype": hf_meta["hf_rope_dtype"],
        "warnings": hf_meta["warnings"],
        "seconds_hf": round(t_hf, 3),
        "seconds_olmax": round(t_ox, 3),
        "versions": {**hf_meta["versions"], "jax": jax.__version__,
                     "python": platform.python_version()},
    }


# ----------------------------------------------------------------------------------------------
# Saved references: HF's logits computed on a machine with torch, compared where there is none


REFERENCE_FORMAT = "olmax-parity-reference-1"


def hf_fingerprint(hf_dir: str | os.PathLike) -> str:
    """sha256 over an HF directory's config.json and its safetensors files (names and bytes): a
    saved reference is compared only against the weights it was computed from."""
    root = Path(hf_dir)
    h = hashlib.sha256()
    for path in [root / "config.json", *sorted(root.glob("*.safetensors"))]:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def write_reference(path: str | os.PathLike, hf_dir: str | os.PathLike, tokens: np.ndarray,
                    logits: np.ndarray, meta: dict) -> None:
    """HF's ``logits`` [B, T, V] (float32) for ``tokens`` [B, T] and how they were made, as one
    ``.npz`` file, written atomically."""
    from olmax.io import write_bytes_atomic

    meta = {"format": REFERENCE_FORMAT, "hf_fingerprint": hf_fingerprint(hf_dir), **meta}
    buf = io.BytesIO()
    np.savez(buf, tokens=tokens.astype(np.int32), logits=logits.astype(np.float32),
             meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    write_bytes_atomic(path, buf.getvalue())


def read_reference(path: str | os.PathLike, hf_dir: str | os.PathLike, vocab: int) -> dict:
    """A saved reference, checked: its format, that it was computed from ``hf_dir``'s config and
    weights, and its shapes (``vocab`` logits per position)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in ("tokens", "logits", "meta")}
        meta = json.loads(bytes(data["meta"]).decode())
    except FileNotFoundError:
        raise OlmaxError(f"--reference {path}: file not found") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError):
        raise OlmaxError(f"--reference {path}: not a parity reference (olmax parity "
                         "--save-reference writes them)") from None
    if not isinstance(meta, dict) or meta.get("format") != REFERENCE_FORMAT:
        raise OlmaxError(f"--reference {path}: not a parity reference (olmax parity "
                         "--save-reference writes them)")
    if meta.get("hf_fingerprint") != hf_fingerprint(hf_dir):
        raise OlmaxError(f"--reference {path} holds HF logits of another model: {hf_dir}'s "
                         "config.json or weights differ from those it was computed from")
    tokens, logits = data["tokens"], data["logits"]
    if tokens.ndim != 2 or logits.shape != (*tokens.shape, vocab):
        raise OlmaxError(f"--reference {path}: logits {logits.shape} do not match tokens "
                         f"{tokens.shape} x vocabulary {vocab}")
    return {"tokens": tokens, "logits": logits, "meta": meta}


def hf_logits(model: Any, v: int):
    """``row -> HF's logits [T, v] (float32)`` of a transformers model, row by row."""
    torch, _ = _reference()

    def run(b: int, row: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(row.astype(np.int64))).logits[0, :, :v].float().numpy()
    return run


def _recording(reference: Any, rows: list) -> Any:
    """``reference`` that also keeps every row's logits in ``rows``."""
    def run(b: int, row: np.ndarray) -> np.ndarray:
        rows.append(reference(b, row))
        return rows[-1]
    return run


def _compare(reference: Any, fwd: Any, params: Any, tokens: np.ndarray, v: int, far: int | None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float, float]:
    """The reference's logits (``reference(b, row)`` -> [T, v]) and olmax's, row by row over the
    first ``v`` logits: per-position KL and top-1 agreement, the KL of positions from ``far`` on,
    max |logit diff|, and each side's seconds."""
    kls, agrees, far_kls, max_diff = [], [], [], 0.0
    t_hf = t_ox = 0.0
    for b in range(tokens.shape[0]):
        row = tokens[b:b + 1]
        t0 = time.perf_counter()
        ref = reference(b, row)
        t1 = time.perf_counter()
        with jax.default_matmul_precision("highest"):
            out = np.asarray(fwd(params, jnp.asarray(row)))[0, :, :v]
        t2 = time.perf_counter()
        t_hf, t_ox = t_hf + t1 - t0, t_ox + t2 - t1
        kl, agree, diff = position_metrics(ref, out)
        kls.append(kl)
        agrees.append(agree)
        max_diff = max(max_diff, diff)
        if far is not None:
            far_kls.append(kl[far:])
        del ref, out
    far_kl = np.concatenate(far_kls) if far_kls else np.zeros(0)
    return np.concatenate(kls), np.concatenate(agrees), far_kl, max_diff, t_hf, t_ox


def _olmax_params(hf_dir: str | os.PathLike, checkpoint: str | os.PathLike | None,
                  dtype: str) -> tuple[Any, ModelConfig, str]:
    """olmax's weights: the checkpoint's (same architecture as config.json), or the HF
    directory's converted in memory. Returns (params, config, where they came from)."""
    hf_cfg = model_config_from_hf(read_hf_config(hf_dir), where=str(Path(hf_dir) / "config.json"))
    check_safetensors_dir(hf_dir)      # before transformers reads anything (no pickles)
    if checkpoint is not None and is_olmo_core_checkpoint(checkpoint):   # read in place
        oc_cfg, _ = read_model_config(checkpoint)     # its config.json, before any weight
        if oc_cfg is not None:
            _check_same_architecture(oc_cfg, hf_cfg, checkpoint, hf_dir)
        params, cfg, _ = read_olmo_core_weights(checkpoint)
        return jax.tree.map(jnp.asarray, params), cfg, str(checkpoint)
    if checkpoint is not None:
        _check_same_architecture(load_model_config(checkpoint), hf_cfg, checkpoint, hf_dir)
        params, cfg = load_params(checkpoint)
        return params, cfg, str(checkpoint)
    # bf16: rounding the weights on load is what the bf16 compute cast does anyway.
    params, cfg, _ = load_hf(hf_dir, dtype=dtype)
    return jax.tree.map(jnp.asarray, params), cfg, "in-memory conversion"


def _inputs(cfg: ModelConfig, hf_dir: str | os.PathLike, tokens: np.ndarray | None,
            token_file: str | None, text: str | None, batch: int, seq_len: int,
            seed: int) -> tuple[np.ndarray, str]:
    """int32 token ids [batch, seq_len] (given, from a token file, a text, or a seed) and what they are."""
    if tokens is not None:
        inputs = "given token ids"
    elif token_file is not None:
        tokens, inputs = tokens_from_file(token_file, batch, seq_len), f"token file {token_file}"
    elif text is not None:
        tokens, inputs = tokens_from_text(text, hf_dir, batch, seq_len), "text"
    else:
        tokens, inputs = seeded_tokens(cfg.vocab_size, batch, seq_len, seed), f"seed {seed}"
    tokens = np.asarray(tokens, dtype=np.int32)
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise OlmaxError(f"token ids must lie in [0, {cfg.vocab_size}) for this model "
                         f"(got {tokens.min()}..{tokens.max()})")
    return tokens, inputs


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"parity ({r['dtype']}" + (f" vs HF {r['hf_dtype']}" if r["hf_dtype"] != r["dtype"] else "")
        + f", profile {r['profile']}, attention {r['attn_impl']}, "
        f"batch {r['batch']} x seq_len {r['seq_len']} = "
        f"{r['num_positions']} positions, windows {r['window_pattern']}, vocab {r['vocab_compared']})",
        f"  KL(HF||olmax)  mean {r['kl_mean']:.3e}  max {r['kl_max']:.3e}",
        f"  top-1 agreement {100 * r['top1_agreement']:.4f} %",
        f"  max |logit diff| {r['max_abs_logit_diff']:.3e}",
    ]
    if r.get("num_positions_beyond_window"):
        lines.append(f"  beyond the window ({r['num_positions_beyond_window']} positions): "
                     f"KL mean {r['kl_mean_beyond_window']:.3e}  max {r['kl_max_beyond_window']:.3e}")
    lines += [f"  warning: {w}" for w in r.get("warnings", [])]
    lines.append(f"  HF RoPE table dtype: {r['hf_rope_dtype']}; transformers "
                 f"{r['versions']['transformers']}, torch {r['versions']['torch']}")
    return "\n".join(lines)


__all__ = ["run_parity", "position_metrics", "format_report", "seeded_tokens",
           "tokens_from_file", "tokens_from_text", "default_seq_len"]
