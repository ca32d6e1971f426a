"""Opt-in host allocator set-up for CPU training: large blocks kept mapped between steps.

XLA's CPU runtime allocates a compiled program's temporaries (gigabytes for a training step) anew
on every execution and frees them at its end. glibc
serves a block that large from a fresh ``mmap`` and gives it back with ``munmap`` when it is
freed -- always, from a worker thread's arena, whatever ``M_MMAP_THRESHOLD`` says. Every step then
faults every page of its temporaries in again (the kernel zeroes each 4 KiB page).

With ``OLMAX_HOST_MALLOC=keep``, :func:`keep_host_memory_mapped` tells glibc (``mallopt``) to serve
every thread from the main arena (``M_ARENA_MAX`` 1), never with a private ``mmap``
(``M_MMAP_MAX`` 0), and to keep freed memory (``M_TRIM_THRESHOLD`` -1: never trim), so that a step
reuses the pages of the step before: faster steps, the same losses. The price is memory: a small
allocation that glibc carves out of the freed temporaries leaves a hole too small for the next
step's, so the heap grows by a whole block and never shrinks. Hence opt-in, for short CPU runs with
memory to spare; the default is glibc's own behaviour. Transparent huge pages
(``glibc.malloc.hugetlb``) cut the faults too, but direct compaction made the step slower.
Measurements: benchmarks/notes/2026-11-30-cpu-shape-b-continued-attention-layout-rope-tables.md.

Read by the ``olmax`` command at start-up (before any thread exists), and applied only where JAX
computes on one CPU device: no accelerator plugin is installed or ``JAX_PLATFORMS`` names ``cpu``
first, and ``XLA_FLAGS`` does not split the CPU into several devices (their executors allocate at
once and one arena fragments, growing the resident memory by half). A non-glibc C library is left
alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import re
import sys

ENV = "OLMAX_HOST_MALLOC"
KEEP = "keep"
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
    """With ``OLMAX_HOST_MALLOC=keep``, configure glibc as the module docstring says, where it
    applies; True if it was applied. Call before any other thread allocates (at process start).
    Decided once per process."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if (environ.get(ENV, "").lower() != KEEP or not cpu_backend_expected(environ)
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
