"""Platform profiles: how the model is computed on each platform, decided once, outside the model.

The model is one set of functions. A few choices of *how* it is computed depend on the hardware
that runs it; a :class:`Profile` holds all of them, and the model reads the profile it is given
(through :class:`olmax.model.runtime.Runtime`), never the device it runs on:

=====================  ==========================  =======================================
choice                 ``cpu``                     ``tpu`` / ``gpu``
=====================  ==========================  =======================================
kernels                written-out backward passes autodiff of the reference functions
                       (``olmax.model.kernels.cpu``)  (``olmax.model.kernels.reference``)
layer scan             unrolled                    ``tpu``: unrolled; ``gpu``: one compiled body
RoPE tables            constants at trace time     computed in the program
``attn_impl=auto``     ``chunked``                 ``splash`` / ``cudnn``
loss chunk             256 rows of logits per host ``tpu``: 4096 rows per device;
                                                   ``gpu``: 1024 positions per sequence
layer weights' cast    all parameters, up front    ``tpu``: in each layer, fp32 gradients
=====================  ==========================  =======================================

Why each CPU choice exists (XLA's CPU backend, measured in benchmarks/notes/2026-11-30-cpu-shapes-a-and-b-before-and-after.md): a
dense layer's weight gradient written by autodiff contracts over the operands' major dimension,
which that backend runs as a slow dot; autodiff of RMSNorm keeps several fp32 copies of the input
for the backward pass; a scanned loop's stacked residuals are copied in and out of their buffers;
sin/cos of the RoPE tables would be evaluated inside every fused consumer.

Why the TPU unrolls the layers and chunks the loss by rows (benchmarks/notes/2026-12-06-one-v5e-chip-round-three.md;
one v5e chip, steps interleaved): the rolled scan stacks every layer's residuals with
dynamic-update-slice and reads them back, 12 % of olmo3-370m's step; unrolled, that step took
0.956x the time, olmo3-600m's (full remat, little to stack) 1.001x, and the compiled peak fell in
every case on the chip (14.54 -> 9.77 GiB for olmo3-190m without remat). Not so for the 7B
sharded over 512 Ironwood devices (compiled: 32.90 -> 49.66 GiB, the note's section 6): the 7B
and 32B recipes set ``train.unroll_layers: false``, which keeps the scan. A chunk of 4096 rows per device makes
the LM head's memory the same at every micro-batch, and one chunk per 4096-position sequence
instead of four took 0.972x the time (olmo3-370m, micro-batch 1).

Why the TPU casts each layer's weights inside the layer (benchmarks/notes/2026-12-01-the-original-run-s-scale-with-collectives-timed.md): the cast then runs on each device's FSDP shard before the weights are gathered
(the gathers still move bf16), and the weight gradients leave the layer in fp32, the master
weights' dtype. Cast up front, the gradients are bf16, and on 512 Ironwood devices (8 rows of a
7B weight per device, half of a bf16 tile) libtpu reduces the MLP's with full-size all-reduces
that block the layer loop; in fp32 they run asynchronously. The GPU keeps the up-front cast: its
gradient reductions would move twice the bytes, unmeasured.

A profile is resolved once, from ``train.profile`` (``auto``: the devices' platform) by
:func:`profile_for`. Any profile can be forced on any device: on CPU, ``tpu`` runs the TPU's
code path with its splash attention kernel in Pallas interpret mode, and ``gpu`` runs the GPU's
code path with the attention the GPU path uses when cuDNN is not there (``chunked``). So the code
an accelerator runs meets the same reference tests as the CPU's.

Compiler options belong to the compiler, not to the profile: :func:`compiler_options` gives
those of the backend that compiles the program (the CPU's YNNPACK setting only when XLA's CPU
backend compiles; a TPU generation's scoped VMEM only when libtpu compiles for it), whatever
profile the program was traced with.

A new platform is one row in :data:`PROFILES`; its devices' facts and vendor are rows of
:mod:`olmax.hardware`, whose vendor rows name the JAX platform, the backend that compiles for it
(``cuda`` and ``rocm`` -> ``gpu``) and the profile ``auto`` gives (NVIDIA ``gpu``, AMD ``rocm``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from typing import Iterable, Mapping

import jax
import jax.numpy as jnp

from olmax.errors import ConfigError
from olmax.hardware import VENDORS, accelerator_of, vendor_of_platform

PROFILE_NAMES = ("auto", "cpu", "tpu", "gpu", "rocm")


@dataclass(frozen=True)
class Profile:
    """How the model is computed on one platform (see the module docstring)."""

    name: str
    kernels: str                      # a key of olmax.model.kernels.KERNELS
    unroll_layers: bool               # unroll the scan over layer groups
    rope_tables_at_trace: bool        # RoPE tables of plain positions as trace-time constants
    attn_auto: str                    # what train.attn_impl=auto means
    loss_chunk_rows: int | None       # rows of logits per host in one loss chunk, or
    loss_chunk_positions: int | None  # positions of every sequence in one loss chunk, or
    cast_in_layer: bool = False       # layer weights cast to the compute dtype inside each layer
    loss_chunk_device_rows: int | None = None  # rows of logits per device in one loss chunk

    def loss_chunk(self, rows_per_device: int, local_devices: int) -> int:
        """Positions per loss chunk for ``rows_per_device`` sequences on each of a host's
        ``local_devices`` devices. By rows per host (CPU): the host's devices share its memory and
        caches, so they share its rows. By rows per device (TPU): each device's own memory holds
        its chunk of logits, the same bytes at any micro-batch. By positions (GPU): the same for
        any batch."""
        if self.loss_chunk_device_rows is not None:
            return max(1, self.loss_chunk_device_rows // max(1, rows_per_device))
        if self.loss_chunk_rows is None:
            return int(self.loss_chunk_positions)
        rows = max(1, self.loss_chunk_rows // max(1, local_devices))
        return max(1, rows // max(1, rows_per_device))


PROFILES: dict[str, Profile] = {
    "cpu": Profile("cpu", kernels="cpu", unroll_layers=True, rope_tables_at_trace=True,
                   attn_auto="chunked", loss_chunk_rows=256, loss_chunk_positions=None),
    "tpu": Profile("tpu", kernels="reference", unroll_layers=True, rope_tables_at_trace=False,
                   attn_auto="splash", loss_chunk_rows=None, loss_chunk_positions=None,
                   cast_in_layer=True, loss_chunk_device_rows=4096),
    "gpu": Profile("gpu", kernels="reference", unroll_layers=False, rope_tables_at_trace=False,
                   attn_auto="cudnn", loss_chunk_rows=None, loss_chunk_positions=1024),
    # AMD GPUs: the NVIDIA profile but for attention, which has no cuDNN: XLA's chunked attention.
    "rocm": Profile("rocm", kernels="reference", unroll_layers=False, rope_tables_at_trace=False,
                    attn_auto="chunked", loss_chunk_rows=None, loss_chunk_positions=1024),
}

# JAX platform names and the backend that compiles for them (the hardware table's vendors: cuda
# and rocm -> gpu).
_BACKEND_NAMES = {v.jax_platform: v.backend for v in VENDORS.values() if v.jax_platform != v.backend}


def backend_of(devices: Iterable | None = None) -> str:
    """The backend that compiles for ``devices`` (default: JAX's devices): ``cpu``, ``tpu``,
    ``gpu`` (CUDA and ROCm), or another platform's own name. The devices of a topology compiled
    for ahead of time count as that topology's platform."""
    device = next(iter(jax.devices() if devices is None else devices))
    return _BACKEND_NAMES.get(device.platform, device.platform)


def float8_matmuls(devices: Iterable | None = None) -> bool:
    """Whether ``devices`` (default: JAX's) multiply float8 operands in hardware: the hardware
    table's ``float8`` (:mod:`olmax.hardware`: Ada, Hopper and Blackwell GPUs, where XLA runs a dot
    of float8 operands as a cuBLASLt float8 GEMM; TPU7x; earlier TPUs' MXUs take bf16 and int8
    only). An NVIDIA GPU the table does not list: by its compute capability (8.9 and newer)."""
    devices = list(jax.devices() if devices is None else devices)
    if backend_of(devices) not in ("gpu", "tpu"):
        return False
    return all(_float8(d) for d in devices)


def _float8(device) -> bool:
    acc = accelerator_of(device)
    if acc is not None:
        return acc.float8
    return device.platform == "cuda" and float(getattr(device, "compute_capability", 0) or 0) >= 8.9


def auto_profile(devices: Iterable | None = None) -> str:
    """What ``train.profile=auto`` means for ``devices`` (default: JAX's): their vendor's profile
    (:mod:`olmax.hardware`: NVIDIA ``gpu``, AMD ``rocm``, TPUs ``tpu``), else their backend's."""
    device = next(iter(jax.devices() if devices is None else devices))
    vendor = vendor_of_platform(device.platform)
    return vendor.profile if vendor else backend_of([device])


def profile_for(name: str, backend: str) -> Profile:
    """The profile ``name`` (``auto``: that of ``backend``, or of the name
    :func:`auto_profile` gives)."""
    if name not in PROFILE_NAMES:
        raise ConfigError(f"unknown platform profile '{name}' (known: {', '.join(PROFILE_NAMES)})")
    key = backend if name == "auto" else name
    if key not in PROFILES:
        raise ConfigError(f"no platform profile for the '{backend}' backend: set train.profile to "
                          f"one of {', '.join(PROFILES)}")
    return PROFILES[key]


# XLA's CPU backend hands fusions to the YNNPACK library; by default reductions too, which then
# read materialised fp32 inputs kept from the forward pass to the backward (the norms' inputs and
# broadcast weights). Dot products alone keep the GEMMs fast without those buffers
# (benchmarks/notes/2026-11-30-cpu-shapes-a-and-b-before-and-after.md).
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@cache
def _cpu_compiler_options() -> dict[str, str]:
    try:        # one tiny compile: an XLA without the option says "No such compile option"
        x = jax.device_put(jnp.zeros((), jnp.float32), jax.devices("cpu")[0])
        jax.jit(lambda a: a + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(x).compile()
    except Exception:
        return {}
    return dict(CPU_COMPILER_OPTIONS)


def compiler_options(backend: str, devices: Iterable | None = None,
                     run: Mapping[str, str] | None = None) -> dict[str, str | bool] | None:
    """Compiler options for a program compiled by ``backend`` for ``devices``: on CPU
    :data:`CPU_COMPILER_OPTIONS` where this jaxlib knows them (else XLA's defaults); on TPU those
    of the devices' generation (the hardware table's ``compiler_options``, :mod:`olmax.hardware`),
    less any the user sets in ``LIBTPU_INIT_ARGS`` (theirs win); elsewhere none. ``run``: the
    run's own (``train.compiler_options``), over all of those; ``true``/``false`` as booleans
    (XLA reads a boolean option's text only as ``True``/``False``)."""
    options: dict[str, str | bool] = {}
    if backend == "cpu":
        options = dict(_cpu_compiler_options())
    elif backend == "tpu" and devices is not None:
        acc = accelerator_of(next(iter(devices)))
        table = dict(acc.compiler_options) if acc else {}
        user = os.environ.get("LIBTPU_INIT_ARGS", "")
        options = {k: v for k, v in table.items() if f"--{k}=" not in user}
    for name, value in (run or {}).items():
        options[name] = {"true": True, "false": False}.get(value.lower(), value)
    # the CPU's are always a dict ({} where this XLA lacks them); elsewhere none is None
    return options if backend == "cpu" or options else None


def compile_option_error(exc: BaseException, run: Mapping[str, str]) -> ConfigError | None:
    """The compiler's refusal of an option of ``train.compiler_options`` (one it does not know,
    or a value it cannot read) as one line; None for any other error."""
    text = str(exc)
    if m := re.search(r"No such compile option: '([^']+)'", text):
        name, why = m.group(1), "this XLA has no such option"
    elif m := re.search(r"While setting option (\S+?),? (.*?)(?:\n|$)", text):
        name, why = m.group(1), m.group(2).strip().rstrip(".")
    else:
        return None
    if name not in run:
        return None
    return ConfigError(f"train.compiler_options: {name}={run[name]} is refused by the compiler "
                       f"({why})")
