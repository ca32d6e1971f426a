"""Training FLOPs per token and per-device peak FLOP/s, for throughput and MFU.

Two conventions, both "6N + attention" with the attention term aware of each layer's window:

``convention="olmo_core"`` -- the convention behind OLMo 3's published MFU (OLMo-core up to 2.x,
``Attention.num_flops_per_token``)::

    6 * N  +  sum over layers of 12 * n_heads * head_dim * min(W_layer, T)

i.e. every query is charged ``min(W, T)`` keys (no causal halving; full layers charged T). For
OLMo 3 7B at T = 8192 this is 49.4 GFLOP/token.

``convention="causal"`` -- only the (query, key) pairs the causal/windowed mask actually keeps::

    6 * N  +  sum over layers of 12 * n_heads * head_dim * P(T, W_layer) // T
    P(T, W) = T (T + 1) / 2                      (full causal, or W >= T)
            = W (W + 1) / 2 + (T - W) W          (sliding window W < T)

This is exactly OLMo-core 3.0's ``Transformer.num_flops_per_token`` (``_causal_attention_positions``
in ``olmo_core/nn/attention/__init__.py``), including its per-layer integer division; 46.56
GFLOP/token for OLMo 3 7B at T = 8192.

In both, N is what OLMo-core sums (:func:`olmax.model.params.matmul_params`, from the parameter
table): every parameter of the attention and feed-forward modules (q/k/v/o projections, QK-norm
weights, gate/up/down) plus the LM head with its final norm. The input embedding (a lookup) and
the per-block output norms (not part of either sub-module in OLMo-core) are not counted. The 12 = 2 matmuls (QK^T, PV) x 2 FLOPs per MAC x 3 (forward +
backward). Recomputation (remat) and padding are never counted: this is *model* FLOPs.
"""

from __future__ import annotations

from typing import Any

from olmax import hardware
from olmax.config import ModelConfig
from olmax.errors import ConfigError
from olmax.model.params import matmul_params

CONVENTIONS = ("olmo_core", "causal")


def causal_attention_pairs(seq_len: int, window: int | None) -> int:
    """Number of (query, key) pairs a causal mask with sliding window ``window`` keeps over a
    sequence of ``seq_len`` tokens (a window of W sees W keys including the query itself)."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, convention: str = "olmo_core") -> int:
    """The attention-score term (QK^T and PV, forward + backward) summed over layers."""
    _check(seq_len, convention)
    width = cfg.n_heads * cfg.head_dim
    total = 0
    for window in cfg.layer_windows():
        if convention == "olmo_core":
            total += 12 * width * (seq_len if window is None else min(window, seq_len))
        else:
            total += 12 * width * causal_attention_pairs(seq_len, window) // seq_len
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int, convention: str = "olmo_core") -> float:
    """Training (forward + backward) model FLOPs per token at sequence length ``seq_len``."""
    _check(seq_len, convention)
    return float(6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, convention))


def _check(seq_len: int, convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ConfigError(f"unknown FLOPs convention '{convention}' (known: {', '.join(CONVENTIONS)})")
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be positive (got {seq_len})")


# ----------------------------------------------------------------------------------------------
# Peak FLOP/s

def peak_flops(device: Any) -> float | None:
    """Dense bf16 peak FLOP/s of one device (a ``jax.Device`` or its ``device_kind`` string): the
    hardware table's (:mod:`olmax.hardware`); None when unknown (CPUs, unlisted accelerators)."""
    acc = hardware.accelerator_of(device)
    return acc.peak_bf16 if acc else None


def mfu(tokens_per_second: float, cfg: ModelConfig, seq_len: int, peak: float | None,
        convention: str = "olmo_core", *, devices: int = 1) -> float | None:
    """Model FLOPs utilisation (fraction, not percent) of ``devices`` devices of ``peak`` FLOP/s
    each processing ``tokens_per_second`` together; None without a peak."""
    if not peak:
        return None
    return tokens_per_second * flops_per_token(cfg, seq_len, convention) / (peak * devices)
