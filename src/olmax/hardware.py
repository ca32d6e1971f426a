"""Every accelerator and every vendor olmax knows: one table at the bottom layer (no JAX import).

A **vendor** row says how its devices are named to JAX, to a cluster and to a scheduler: the JAX
platform (``JAX_PLATFORMS``), the backend that compiles for them and the platform profile they run
by default (:mod:`olmax.platforms`), the Kubernetes resource of one device, the variable a
scheduler sets to the devices a process may use. An **accelerator** row gives one generation's facts: its ``device_kind`` names, dense bf16 peak
and memory per JAX device, JAX devices per chip, its links, the TPU's matrix-unit width, whether it
multiplies float8 operands in hardware, the compiler options olmax compiles its programs with, and
how to compile for it without one (a GPU's ``GpuTargetConfig``; a TPU's name is libtpu's).

Everything else derives from these rows: :func:`olmax.model.flops.peak_flops` (MFU),
:data:`olmax.perf.targets.ACCELERATORS` (``olmax plan --topology``), :mod:`olmax.perf.network`
(collective times), the TPU slices' devices per chip (:mod:`olmax.topology`),
:func:`olmax.platforms.float8_matmuls` and :func:`olmax.platforms.compiler_options`, and the
platform, resource and visible devices of the jobs ``olmax launch`` writes. A new GPU or TPU
generation is one row here; a new vendor one :data:`VENDORS` row (plus a profile row in
:mod:`olmax.platforms` if its devices compute differently).

Sources. Peaks: vendor datasheets (NVIDIA H100/H200/A100/B200/L4/L40S; AMD Instinct
MI300X/MI325X/MI355X; Cloud TPU docs); sparse figures are halved. Memory (``hbm``) is what a
program may use where that is known, else the nominal size (about 1 % above what runtimes report):

- TPUs that ``olmax plan`` compiles for: the limit libtpu's compiler allows one device, which its
  compile-time out-of-memory error prints ("exceeds available HBM (15.75G)" on v5e); the figures
  are the largest buffer a compile for the generation accepts, to 4 KiB (libtpu of jax 0.12.0.1:
  v5e 15.75, v5p 95.73, v6e 31.24, tpu7x 94.74 GiB; nominal 16, 96, 32, 96 GiB).
- GPUs with a compile target: the ``device_memory_size`` of that target, the memory the CUDA
  runtime reports (H100 80GB HBM3 79.1 GiB; H200 140.4 GiB, nvidia-smi's 143,771 MiB).
- Others: nominal.

Links (``link_bw``: one direction of one link; ``dcn_bw``: one direction per chip). Cloud TPU
docs, pages "TPU v5e" (bidirectional ICI 400 GBps per chip over 4 ICI ports: 50 GB/s per link
per direction; 2 x 100 Gbps NICs per host of 8 chips: 25 Gb/s DCN per chip), "TPU v5p" (1,200
GBps over 6 links; DCN 50 Gbps per chip), "TPU v6e" (800 GBps over 4; 100 Gbps), "TPU7x" (1,200
GBps over 6; 100 Gbps). The JAX scaling book's per-link figures are about 10 % lower (4.5e10 and
9e10 B/s one way for v5e and v5p/v6e/TPU7x). GPUs: NVLink 4 at 900 GB/s both ways, one 400 Gb/s
NIC per GPU. A generation without a figure has ``None``: what needs it is not priced.
Sustained matrix rate (``mxu_bf16``, TPUs): the dense bf16 FLOP/s per device at which the matmuls
of a Pallas kernel (splash attention), which XLA's cost model cannot see, are priced. It is the
lower of two figures, neither a fit: the rate XLA's TPU cost model gives a large bf16 dot on the
target (``optimal_seconds`` of an 8192- or 16384-cube product, libtpu 0.0.52: v5e 197, v5p 394,
v6e 918, TPU7x 996 TFLOP/s per device; v5p's and TPU7x's are 86 % of their datasheets), so that
the kernels are on the scale of the compiled parts around them; and a published measurement of the
chip's largest bf16 GEMM, where there is one: TPU7x 956.4 TFLOP/s per device at m = n = k = 32,768
(950.1 at 16,384; AI-Hypercomputer/accelerator-microbenchmarks, ``Ironwood/
Ironwood_Microbenchmarks_readme.md``, "GEMM Results", bf16 ``gemm_multiple_run``). Without a
figure the datasheet peak is used.
HBM bandwidth (``hbm_bw``), datasheets: H100 SXM 3.35 TB/s, H200 4.8 TB/s (the GPU step estimate
scales one GPU's measured memory-bound rates to another's by it, :mod:`olmax.perf.gpu_estimate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GiB = 2 ** 30


@dataclass(frozen=True)
class Vendor:
    name: str
    jax_platform: str               # JAX_PLATFORMS of its devices (and jax.Device.platform)
    backend: str                    # olmax's name for the compiler that builds for them: gpu, tpu
    profile: str                    # the platform profile train.profile=auto gives its devices
    k8s_resource: str               # Kubernetes extended resource of one device (a TPU: one chip)
    visible_devices_env: str | None  # what a scheduler (Slurm) sets to a process's devices


VENDORS: dict[str, Vendor] = {v.name: v for v in (
    Vendor("nvidia", "cuda", "gpu", "gpu", "nvidia.com/gpu", "CUDA_VISIBLE_DEVICES"),
    Vendor("amd", "rocm", "gpu", "rocm", "amd.com/gpu", "ROCR_VISIBLE_DEVICES"),
    Vendor("google", "tpu", "tpu", "tpu", "google.com/tpu", None),
)}
GPU_VENDORS = tuple(name for name, v in VENDORS.items() if v.backend == "gpu")


@dataclass(frozen=True)
class Accelerator:
    """One accelerator generation (see the module docstring). ``None``: not known (a plan does
    not time what needs it; MFU is not reported without a peak)."""

    name: str                       # olmax's name: --topology h100:8, v5p:4x4x4
    vendor: str                     # a key of VENDORS
    kinds: tuple[str, ...] = ()     # lower-case substrings of jax.Device.device_kind
    peak_bf16: float | None = None  # dense bf16 FLOP/s per JAX device
    hbm: int | None = None          # bytes per JAX device a program may use (module docstring)
    hbm_bw: float | None = None     # bytes/s of that memory, the datasheet's figure
    devices_per_chip: int = 1       # JAX devices sharing a chip (and its links)
    link_bw: float | None = None    # bytes/s one direction of one inter-chip link (TPU ICI; GPU
                                    # NVLink to the switch)
    dcn_bw: float | None = None     # bytes/s one direction per chip across slices or nodes
    mxu: int | None = None          # TPU systolic matrix unit: mxu x mxu
    mxu_bf16: float | None = None   # sustained dense bf16 matmul FLOP/s per JAX device that a Pallas
                                    # kernel's matmuls are priced at (module docstring)
    float8: bool = False            # float8 (e4m3fn/e5m2) operands multiplied in hardware
    compiler_options: tuple[tuple[str, str], ...] = ()
    gpu_target: str | None = field(default=None, repr=False)   # GpuTargetConfig text
    rates: str | None = None        # the measured rates table (olmax/perf/gpu_tables/NAME.json) that
                                    # prices its kernels: its own, or (a GPU) one of the same tensor
                                    # cores; a TPU without one is priced by XLA's cost model

    @property
    def platform(self) -> str:
        """The backend that compiles for it: ``gpu`` or ``tpu``."""
        return VENDORS[self.vendor].backend

    @property
    def matmul_rate(self) -> float | None:
        """FLOP/s per device that ``olmax plan`` prices a Pallas kernel's matmuls at: the sustained
        rate where known, else the datasheet peak."""
        return self.mxu_bf16 or self.peak_bf16

    @property
    def plan_target(self) -> bool:
        """Whether ``olmax plan --topology`` compiles for it without one: a TPU generation libtpu
        knows, or a GPU with a compile target."""
        return self.platform == "tpu" or self.gpu_target is not None


# A GPU compile target: the device description a real Hopper GPU reports (132 SMs, 1.98 GHz
# boost, 50 MB L2), with the cuDNN and CUDA versions the jax 0.12.0.1 CUDA 12 wheels install.
_HOPPER = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 28
}}
runtime_version {{
  major: 12
  minor: 9
}}
device_description_str: "{name}"
"""
_NVLINK4, _NIC_400G = 450e9, 400e9 / 8
# Device memory as the CUDA runtime reports it (the compile targets' device_memory_size).
_H100_MEMORY, _H200_MEMORY = 84_929_347_584, 150_754_820_096

# Rows whose ``kinds`` overlap go most specific first ("h100 pcie" before "h100", "gh200" before
# "h200", "tpu v5 lite" before "tpu v5"): a device is the first row one of whose kinds it contains.
ACCELERATORS: tuple[Accelerator, ...] = (
    # NVIDIA
    Accelerator("h100-pcie", "nvidia", ("h100 pcie",), 756e12, float8=True),
    Accelerator("h100-nvl", "nvidia", ("h100 nvl",), 835e12, float8=True),
    Accelerator("gh200", "nvidia", ("gh200",), 989e12, float8=True),
    Accelerator("h200", "nvidia", ("h200",), 989e12, _H200_MEMORY, 4.8e12, link_bw=_NVLINK4,
                dcn_bw=_NIC_400G, float8=True, rates="h200",
                gpu_target=_HOPPER.format(bandwidth=4800000000000, memory=_H200_MEMORY,
                                                       name="NVIDIA H200")),
    Accelerator("h100", "nvidia", ("h100",), 989e12, _H100_MEMORY, 3.35232e12, link_bw=_NVLINK4,  # SXM
                dcn_bw=_NIC_400G, float8=True, rates="h200",   # the H200's SMs and clocks
                gpu_target=_HOPPER.format(bandwidth=3352320000000, memory=_H100_MEMORY,
                                                       name="NVIDIA H100 80GB HBM3")),
    Accelerator("b200", "nvidia", ("b200",), 2250e12, float8=True),
    Accelerator("b300", "nvidia", ("b300",), 2250e12, float8=True),
    Accelerator("a100", "nvidia", ("a100",), 312e12),
    Accelerator("l40s", "nvidia", ("l40s",), 362e12, float8=True),
    Accelerator("l4", "nvidia", ("l4",), 121e12, float8=True),
    # AMD. MI300X and MI325X multiply float8 in the "fnuz" encodings only, not the e4m3fn/e5m2
    # olmax trains with; MI355X (CDNA 4) takes those.
    Accelerator("mi355x", "amd", ("mi355x",), 2516.6e12, 288 * GiB, float8=True),
    Accelerator("mi325x", "amd", ("mi325x",), 1307.4e12, 256 * GiB),
    Accelerator("mi300x", "amd", ("mi300x",), 1307.4e12, 192 * GiB),
    # Google
    Accelerator("v2", "google"),
    Accelerator("v3", "google"),
    # v4: nominal 32 GiB per chip as one megacore device (libtpu's compile target lists a v4 chip
    # as 2 devices of 15.25 GiB each)
    Accelerator("v4", "google", ("tpu v4",), 275e12, 32 * GiB, mxu=128),
    # TPU memory: libtpu's compile-time limit per device (module docstring)
    # v5e's step is priced from the rates measured on a chip (olmax bench matmul --table,
    # benchmarks/notes/2026-12-06-one-v5e-chip-round-four.md). It is compiled with 32 MiB of
    # scoped VMEM, twice libtpu's default: measured side by side on the chip, the 7B slice's step
    # takes 0.939 of the time, the 600m's 0.966, the 190m's 0.971 and the 370m's 0.994, and no
    # program measured was slower (96 MiB: the 370m 1.111;
    # benchmarks/notes/2026-12-07-one-v5e-chip-round-six.md).
    Accelerator("v5e", "google", ("tpu v5 lite", "tpu v5e"), 197e12, 16_908_218_368,
                link_bw=400e9 / 2 / 4, dcn_bw=2 * 100e9 / 8 / 8, mxu=128, mxu_bf16=197e12, rates="v5e",
                compiler_options=(("xla_tpu_scoped_vmem_limit_kib", "32768"),)),
    Accelerator("v5p", "google", ("tpu v5p", "tpu v5"), 459e12, 102_784_475_136,   # v5p reports "TPU v5"
                link_bw=1200e9 / 2 / 6, dcn_bw=50e9 / 8, mxu=128, mxu_bf16=394e12),
    Accelerator("v6e", "google", ("tpu v6 lite", "tpu v6e"), 918e12, 33_544_916_992,
                link_bw=800e9 / 2 / 4, dcn_bw=100e9 / 8, mxu=256, mxu_bf16=918e12),
    # Ironwood: 2,307 TFLOP/s and 192 GiB per chip, whose 2 TensorCores are 2 JAX devices. Its
    # step is compiled with 64 MiB of scoped VMEM, the limit MaxText's OLMo 3 launcher sets on
    # Ironwood: at libtpu's default the 7B step's MLP weight gradients do not fit as reduce-scatter
    # fusions, and the compiler reduces each at full size with an all-reduce over all devices,
    # blocking the layer loop (128 and 512 devices;
    # benchmarks/notes/2026-12-01-the-original-run-s-scale-with-collectives-timed.md). On v5p (checked on v5p 4x4x8 with the stage-2 step) 96 MiB changes nothing, so v5p
    # keeps libtpu's default.
    Accelerator("tpu7x", "google", ("tpu7x",), 2307e12 / 2, 101_723_287_552, devices_per_chip=2,
                link_bw=1200e9 / 2 / 6, dcn_bw=100e9 / 8, mxu=256, mxu_bf16=956.38e12, float8=True,
                compiler_options=(("xla_tpu_scoped_vmem_limit_kib", "65536"),)),
)
BY_NAME: dict[str, Accelerator] = {a.name: a for a in ACCELERATORS}


def device_kind(device: Any) -> str:
    """The lower-case ``device_kind`` of a ``jax.Device`` (or the string itself)."""
    return str(device if isinstance(device, str) else getattr(device, "device_kind", "")).lower()


def accelerator_of(device: Any) -> Accelerator | None:
    """The row of a device (a ``jax.Device`` or its ``device_kind``), else None (CPUs, unlisted
    accelerators)."""
    if not isinstance(device, str) and getattr(device, "platform", "") == "cpu":
        return None
    kind = device_kind(device)
    return next((a for a in ACCELERATORS if any(k in kind for k in a.kinds)), None)


def vendor_of_platform(jax_platform: str) -> Vendor | None:
    """The vendor whose devices JAX names ``jax_platform`` (``cuda``, ``rocm``, ``tpu``)."""
    return next((v for v in VENDORS.values() if v.jax_platform == jax_platform), None)
