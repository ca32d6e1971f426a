"""How the model runs, as one value: :class:`Runtime` (compute dtype, attention implementation,
remat policy), and the one table of compute dtypes by name.

The architecture is the config (:class:`olmax.config.ModelConfig`); a Runtime only chooses how the
same function is computed: in which dtype the matmuls run (parameters are cast to it; RMSNorm,
RoPE, softmax and logits stay fp32), which attention kernel runs (every one equals the ``xla``
reference), and what the backward pass recomputes instead of storing (named remat policies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from olmax.config import ConfigError, TrainConfig
from olmax.model.attention import IMPLEMENTATIONS

DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _save_names_and_kernels(*names: str):
    """Save the values named ``names`` (``checkpoint_name`` in :mod:`olmax.model.olmo3`) and the
    outputs of Pallas kernels -- splash attention's output and softmax statistics, so that its
    forward kernel does not run again in the backward pass."""
    by_name = jax.checkpoint_policies.save_only_these_names(*names)

    def policy(prim, *args, **params):
        return prim.name == "pallas_call" or by_name(prim, *args, **params)
    return policy


# Per-layer rematerialisation (``jax.checkpoint`` around each layer; its input is always kept).
# ``dots`` keeps every matmul's fp32 accumulator output; the ``save_*`` policies keep named values
# in the compute dtype (bf16 under mixed precision: half the bytes of ``dots``). What each costs
# and saves for OLMo 3 7B on TPU: benchmarks/README.md (the TPU study).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_outputs": jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_out"),
    # q/k/v projections and the attention kernel: the backward pass recomputes the MLP and the
    # output projection
    "save_attn": _save_names_and_kernels("q_proj", "k_proj", "v_proj"),
    # every projection's output and the attention kernel: only element-wise work is recomputed
    "save_proj": _save_names_and_kernels("q_proj", "k_proj", "v_proj", "attn_out", "mlp_gate",
                                         "mlp_up", "mlp_out"),
}


def dtype_of(name: str | Any) -> Any:
    """A dtype given by name (``float32``, ``bfloat16``, ``float16``); a dtype passes through."""
    if not isinstance(name, str):
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype '{name}' (known: {', '.join(DTYPES)})")
    return DTYPES[name]


@dataclass(frozen=True)
class Runtime:
    compute_dtype: Any = jnp.float32     # a dtype or its name
    attn_impl: str = "xla"               # "auto" or a key of olmax.model.attention.IMPLEMENTATIONS
    remat: str = "none"                  # a key of REMAT_POLICIES

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute_dtype", dtype_of(self.compute_dtype))
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat policy '{self.remat}' (known: {', '.join(REMAT_POLICIES)})")
        if self.attn_impl != "auto" and self.attn_impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attention implementation '{self.attn_impl}' "
                             f"(known: auto, {', '.join(IMPLEMENTATIONS)})")

    @classmethod
    def of(cls, train: TrainConfig) -> "Runtime":
        """The runtime a training config asks for (``train.compute_dtype/attn_impl/remat``)."""
        return cls(train.compute_dtype, train.attn_impl, train.remat)
