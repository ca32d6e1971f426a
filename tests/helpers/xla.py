"""The XLA flags of a process a test starts: the run's own (``scripts/test`` sets the suite's
compile level in ``XLA_FLAGS``) with the CPU device count the process needs."""

from __future__ import annotations

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def xla_flags(devices: int, base: str | None = None) -> str:
    """``base`` (default: this process's ``XLA_FLAGS``) without its CPU device count, then
    ``devices`` CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "") if base is None else base
    kept = [f for f in flags.split() if not f.startswith(DEVICE_COUNT)]
    return " ".join([*kept, f"{DEVICE_COUNT}={devices}"])
