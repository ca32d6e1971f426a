"""How the model runs, as one value: :class:`Runtime` (compute dtype, attention implementation,
remat policy, platform profile, float8 dense layers), and the one table of compute dtypes by
name.

The architecture is the config (:class:`olmax.config.ModelConfig`); a Runtime only chooses how the
same function is computed: in which dtype the matmuls run (parameters are cast to it; RMSNorm,
RoPE, softmax and logits stay fp32), which attention kernel runs (every one equals the ``xla``
reference), what the backward pass recomputes instead of storing (named remat policies), and the
platform profile's choices (:mod:`olmax.platforms`: kernel set, layer-scan unrolling, RoPE tables),
and whether the transformer blocks' dense layers run in float8 (``float8``: torchao's tensorwise
recipe of OLMo 3's long-context stage, :mod:`olmax.model.kernels.float8`).

The model reads only this value; it never asks which device it runs on. A Runtime built without a
profile runs the plain JAX path: the reference kernels, a rolled layer scan, RoPE traced per call
(the path of the TPU and GPU profiles). :meth:`Runtime.of` resolves a training config's profile
for the devices the program compiles for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import jax
import jax.numpy as jnp

from olmax.config import TrainConfig
from olmax.errors import ConfigError
from olmax.model.attention import IMPLEMENTATIONS
from olmax.model.kernels import FLOAT8_KERNELS, KERNELS, Kernels
from olmax.model.splash import DEFAULT_BLOCK as DEFAULT_SPLASH_BLOCK
from olmax.model.splash import RESIDUALS as SPLASH_RESIDUALS
from olmax.platforms import Profile, auto_profile, backend_of, float8_matmuls, profile_for

COMPUTE_DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _save_names_and_kernels(*names: str):
    """Save the values named ``names`` (``checkpoint_name`` in :mod:`olmax.model.olmo3`) and the
    residuals of the attention kernel -- splash's output and softmax statistics, by their name
    (:data:`olmax.model.splash.RESIDUALS`), so that its forward kernel does not run again in the
    backward pass."""
    return jax.checkpoint_policies.save_only_these_names(*names, SPLASH_RESIDUALS)


# Per-layer rematerialisation (``jax.checkpoint`` around each layer; its input is always kept).
# ``dots`` keeps every matmul's fp32 accumulator output; the ``save_*`` policies keep named values
# in the compute dtype (bf16 under mixed precision: half the bytes of ``dots``). What each costs
# and saves for OLMo 3 7B on TPU: benchmarks/notes/2026-11-30-the-7b-tpu-study.md.
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
    # ``full`` but for the attention kernel's output and softmax statistics (one activation and a
    # row of statistics per layer): the backward pass recomputes every matmul, never the forward
    # kernel. Where attention is not a Pallas kernel (splash), this is ``full``.
    "save_kernels": _save_names_and_kernels(),
}


def dtype_of(name: str | Any) -> Any:
    """A dtype given by name (``float32``, ``bfloat16``, ``float16``); a dtype passes through."""
    if not isinstance(name, str):
        return name
    if name not in COMPUTE_DTYPES:
        raise ConfigError(f"unknown dtype '{name}' (known: {', '.join(COMPUTE_DTYPES)})")
    return COMPUTE_DTYPES[name]


@dataclass(frozen=True)
class Runtime:
    compute_dtype: Any = jnp.float32     # a dtype or its name
    attn_impl: str = "xla"               # "auto" (needs a profile) or a key of IMPLEMENTATIONS
    remat: str = "none"                  # a key of REMAT_POLICIES
    profile: Profile | None = None       # None: the plain JAX path (see the module docstring)
    # The backend the program compiles for. It decides only whether a hardware kernel runs
    # natively (splash by Mosaic on TPU, cuDNN on GPU) or in its portable form (Pallas interpret
    # mode; cuDNN's fallback). None: no hardware kernel runs natively.
    backend: str | None = None
    # The blocks' dense layers in float8 (olmax.model.kernels.float8); any backend computes them
    # (emulated in the cpu kernel set); a training config asks for them only where the devices
    # have float8 matmuls (Runtime.resolve).
    float8: bool = False
    # Context parallelism with split attention (olmax.model.attention_cp): the sequences are in the
    # zig-zag layout over this many devices and attention computes each device's own queries.
    # Set by the training step (olmax.train.step.split_context); 1: natural order, no split.
    context: int = 1
    # With ``context`` > 1: key heads whose keys and values are gathered at a time (None: all).
    context_head_stride: int | None = None
    # Splash attention's query and key block (``train.splash_block``); other kernels ignore it.
    splash_block: int = DEFAULT_SPLASH_BLOCK
    # Splash's backward in one kernel (``train.splash_fused_bwd``).
    splash_fused_bwd: bool = False
    # The layer scan unrolled (``train.unroll_layers``); None: the profile's choice.
    unroll: bool | None = None
    # A key of olmax.model.kernels.KERNELS (``train.kernels``); None: the profile's set.
    kernel_set: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute_dtype", dtype_of(self.compute_dtype))
        if self.remat == "auto":   # a training config's choice, made by fitting its step
            raise ConfigError("train.remat=auto is chosen by fitting the training step to the "
                              "devices (olmax.train.fit); this program was built without that")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat policy '{self.remat}' (known: {', '.join(REMAT_POLICIES)})")
        if self.attn_impl == "auto":
            if self.profile is None:
                raise ValueError("attention implementation 'auto' needs a platform profile")
            object.__setattr__(self, "attn_impl", self.profile.attn_auto)
        if self.attn_impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attention implementation '{self.attn_impl}' "
                             f"(known: auto, {', '.join(IMPLEMENTATIONS)})")
        if self.kernel_set is not None and self.kernel_set not in KERNELS:
            raise ValueError(f"unknown kernel set '{self.kernel_set}' (known: {', '.join(KERNELS)})")

    @classmethod
    def of(cls, train: TrainConfig, devices: Iterable | None = None, **changes: Any) -> "Runtime":
        """The runtime a training config asks for (``train.compute_dtype/attn_impl/remat/profile/
        float8``) on ``devices`` (default: JAX's devices; a mesh's ``devices.flat``; a topology's
        devices when compiling ahead of time), with ``changes`` to those fields."""
        return cls.resolve(**{"compute_dtype": train.compute_dtype, "attn_impl": train.attn_impl,
                              "remat": train.remat, "profile": train.profile,
                              "float8": train.float8, "splash_block": train.splash_block,
                              "splash_fused_bwd": train.splash_fused_bwd,
                              "unroll": train.unroll_layers, "kernel_set": train.kernels,
                              **changes},
                           devices=devices)

    @classmethod
    def resolve(cls, compute_dtype: Any = "float32", attn_impl: str = "auto", remat: str = "none",
                profile: str = "auto", devices: Iterable | None = None,
                float8: bool = False, splash_block: int = DEFAULT_SPLASH_BLOCK,
                splash_fused_bwd: bool = False, unroll: bool | None = None,
                kernel_set: str | None = None) -> "Runtime":
        """A runtime with the platform profile ``profile`` (``auto``: the devices' platform) for
        a program compiled for ``devices``. ``float8`` only where those devices have float8
        matmuls (:func:`olmax.platforms.float8_matmuls`; elsewhere a ConfigError)."""
        devices = None if devices is None else list(devices)   # read more than once below
        backend = backend_of(devices)
        if float8 and not float8_matmuls(devices):
            kind = next(iter(jax.devices() if devices is None else devices)).device_kind
            raise ConfigError(f"train.float8: the {backend} devices ({kind}) have no float8 "
                              "matmuls (GPUs of compute capability 8.9+, TPU7x); "
                              "set train.float8: false")
        return cls(compute_dtype, attn_impl, remat, profile_for(profile, auto_profile(devices)), backend,
                   float8, splash_block=splash_block, splash_fused_bwd=splash_fused_bwd, unroll=unroll,
                   kernel_set=kernel_set)

    @property
    def kernels(self) -> Kernels:
        name = self.kernel_set or (self.profile.kernels if self.profile else "reference")
        return (FLOAT8_KERNELS if self.float8 else KERNELS)[name]

    @property
    def unroll_layers(self) -> bool:
        if self.unroll is not None:
            return self.unroll
        return bool(self.profile and self.profile.unroll_layers)

    @property
    def cast_in_layer(self) -> bool:
        return bool(self.profile and self.profile.cast_in_layer)

    @property
    def rope_tables_at_trace(self) -> bool:
        return bool(self.profile and self.profile.rope_tables_at_trace)

    @property
    def profile_name(self) -> str:
        return self.profile.name if self.profile else "reference"
