"""The XLA flags of a process a test starts: the run's own (``scripts/test`` sets the suite's
compile flags in ``XLA_FLAGS`` and names them in ``OLMAX_TEST_COMPILE_FLAGS``) with the CPU
device count the process needs."""

from __future__ import annotations

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def _flags(base: str | None) -> list[str]:
    return (os.environ.get("XLA_FLAGS", "") if base is None else base).split()


def xla_flags(devices: int, base: str | None = None) -> str:
    """``base`` (default: this process's ``XLA_FLAGS``) without its CPU device count, then
    ``devices`` CPU devices."""
    kept = [f for f in _flags(base) if not f.startswith(DEVICE_COUNT)]
    return " ".join([*kept, f"{DEVICE_COUNT}={devices}"])


def users_xla_flags(base: str | None = None) -> str:
    """``base`` (default: this process's ``XLA_FLAGS``) without the suite's compile flags: for a
    process whose time is its run rather than its compiles, which then also runs as a user's
    does (XLA's own optimisation level and code emitters)."""
    suite = set(os.environ.get("OLMAX_TEST_COMPILE_FLAGS", "").split())
    return " ".join(f for f in _flags(base) if f not in suite)
