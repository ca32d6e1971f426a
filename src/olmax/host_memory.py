"""The host allocator of a CPU training process: large blocks kept mapped between steps.

XLA's CPU runtime allocates a compiled program's temporaries (at a 35M-parameter, batch 8 x 512
step: 2.4 GiB) anew on every execution and frees them at its end. glibc serves a block that large
from a fresh ``mmap`` and gives it back with ``munmap`` when it is freed -- always, from a worker
thread's arena, whatever ``M_MMAP_THRESHOLD`` says. Every step then faults every page of its
temporaries in again (the kernel zeroes each 4 KiB page): measured on a 2-core AMD EPYC, one
fifth of the CPU time of a step went to the kernel, and the attention of one layer ran 136 ms
instead of 100 ms.

:func:`keep_host_memory_mapped` tells glibc (``mallopt``) to serve every thread from the main
arena (``M_ARENA_MAX`` 1), never with a private ``mmap`` (``M_MMAP_MAX`` 0) and to keep freed
memory at the top of the heap (``M_TRIM_THRESHOLD`` -1: never trim): the second step reuses the first
step's pages. The process's peak resident memory is the same peak, and memory freed after it
stays resident (reused by the next step). Numbers are unchanged; only where the bytes live.
Transparent huge pages (``glibc.malloc.hugetlb``) would cut the faults too, but direct
compaction made a step slower (measured: 4.20 -> 5.32 s at shape B).

Applied by the ``olmax`` command at start-up (before any thread exists), only where JAX computes
on the CPU: no accelerator plugin is installed, or ``JAX_PLATFORMS`` names ``cpu`` first. On an
accelerator host the temporaries live in device memory and the host keeps glibc's defaults. So
does a process that splits its CPU into several devices (``XLA_FLAGS=
--xla_force_host_platform_device_count=N``, a test set-up): their executors allocate at once and
one arena fragments (``olmax train olmo3_tiny train.max_steps=5`` on 8 devices peaked at 3.62 GB
resident instead of 2.39 GB). ``OLMAX_HOST_MALLOC=system`` keeps glibc's defaults anywhere; a
non-glibc C library is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import re
import sys

ENV = "OLMAX_HOST_MALLOC"
# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
NEVER = -1           # M_TRIM_THRESHOLD -1: never trim (mallopt(3))

# The same settings for a process olmax does not start itself (e.g. a peer framework in a
# benchmark), read by glibc at that process's start.
GLIBC_TUNABLES = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                  "glibc.malloc.trim_threshold=4611686018427387904")

_ACCELERATOR_MODULES = ("libtpu", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13",
                        "jax_plugins.xla_rocm6", "jax_plugins.xla_rocm7")
_applied: bool | None = None


def forced_cpu_devices(environ=os.environ) -> int:
    """The CPU device count ``XLA_FLAGS`` asks for (``--xla_force_host_platform_device_count``), 1
    if it asks for none."""
    found = re.findall(r"--xla_force_host_platform_device_count[= ](\d+)", environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 1


def cpu_backend_expected(environ=os.environ) -> bool:
    """Whether JAX will compute on the CPU: ``JAX_PLATFORMS`` names ``cpu`` first, or it names
    nothing and no accelerator plugin (libtpu, CUDA, ROCm) is installed. Decided without
    importing JAX (which would start its threads)."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms[0] == "cpu"
    for name in _ACCELERATOR_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return False
        except (ImportError, ValueError):
            continue
    return True


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        return libc
    except (OSError, AttributeError):
        return None


def keep_host_memory_mapped(environ=os.environ) -> bool:
    """Configure glibc as the module docstring says, where it applies; True if it was applied.
    Call before any other thread allocates (at process start). Idempotent."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if (environ.get(ENV, "").lower() == "system" or not cpu_backend_expected(environ)
            or forced_cpu_devices(environ) > 1):
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER)))
    _applied = ok
    return ok
