"""GPU compile targets for ``olmax plan --topology h100:N`` / ``h200:N`` on a host without GPUs.

XLA's GPU compiler can compile for a device it is only told about (a ``GpuTargetConfig``: the
device description a real GPU would report) through the CUDA PJRT plugin's topology
(``get_topology_desc(platform="cuda", target_config=..., topology="1x1xN")``). That needs the
plugin (``pip install "jax[cuda12]"`` at the jax pin) but no GPU and no driver. The figures below
are the SXM parts' published properties (132 SMs, 1.98 GHz boost, 50 MB L2; H100 80 GB HBM3 at
3.35 TB/s, H200 141 GB HBM3e at 4.8 TB/s) with the memory sizes the CUDA runtime reports; the
cuDNN and CUDA versions are those the jax 0.12.0.1 CUDA 12 wheels install.
"""

from __future__ import annotations

import os
from typing import Mapping

from olmax.errors import OlmaxError

# The share of a GPU's memory JAX's allocator takes (``XLA_PYTHON_CLIENT_MEM_FRACTION``; JAX's own
# default is 0.75): ``olmax launch`` exports this value in GPU jobs and ``olmax plan`` judges a GPU
# step against it, so that "fits" means what the job will have. The rest is left to the CUDA
# context, NCCL's buffers and cuDNN's workspaces, which live outside JAX's allocator.
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
MEM_FRACTION = 0.90

_COMMON = """gpu_device_info {{
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

TARGETS = {
    "h100": _COMMON.format(bandwidth=3352320000000, memory=84929347584, name="NVIDIA H100 80GB HBM3"),
    "h200": _COMMON.format(bandwidth=4800000000000, memory=150754820096, name="NVIDIA H200"),
}


def parse(name: str) -> tuple[str, int] | None:
    """``h100:8`` -> ("h100", 8); ``h200`` -> ("h200", 1); None for names of no GPU here. A GPU
    name with a count that is not a positive whole number (``h100:eight``, ``h100:0``) is an
    OlmaxError."""
    kind, _, count = name.lower().partition(":")
    if kind not in TARGETS:
        return None
    if count and not (count.isdigit() and int(count) > 0):
        raise OlmaxError(f"--topology {name}: the GPU count must be a positive whole number "
                         f"(e.g. {kind}:8)")
    return kind, int(count or 1)


def mem_fraction(environ: Mapping[str, str] = os.environ) -> float:
    """The allocator's share of GPU memory: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` when set (what the
    job will export), else :data:`MEM_FRACTION` (what ``olmax launch`` exports)."""
    raw = environ.get(MEM_FRACTION_ENV)
    if raw is None or raw == "":
        return MEM_FRACTION
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise OlmaxError(f"{MEM_FRACTION_ENV}={raw!r}: expected a fraction in (0, 1]")
    return value
