"""The TPU-device suite (``scripts/test --device-references``, then ``scripts/test --tpu-device`` on
the chip) proven here on the CPU: the references are made with the reference implementations, and
the device tests run against them on the CPU backend (``OLMAX_DEVICE_ALLOW_CPU=1``: the forced
``tpu`` profile, splash in Pallas interpret mode), which must pass as the chip must. Without that
variable a CPU is refused in one line: the suite is meant for the chip."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers.reference import require

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_device_suite_passes_against_references_made_here(tmp_path):
    require("torch")
    require("olmo_core")
    refs = tmp_path / "refs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMAX_DEVICE")}
    made = subprocess.run(["scripts/test", "--device-references", str(refs)], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=900)
    assert made.returncode == 0, made.stderr[-3000:]
    assert (refs / "manifest.json").is_file() and (refs / "olmo_core.npz").is_file()

    def device_suite(**extra):
        return subprocess.run(["scripts/test", "--tpu-device", "-q"], cwd=ROOT, text=True,
                              capture_output=True, timeout=1200,
                              env={**env, "OLMAX_DEVICE_REFERENCES": str(refs), **extra})

    ran = device_suite(OLMAX_DEVICE_ALLOW_CPU="1")
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "9 passed, 1 skipped" in ran.stdout, ran.stdout[-2000:]   # the trajectory with both backwards
    refused = device_suite()
    assert refused.returncode != 0
    assert "the device tests need a TPU; JAX's default backend here is cpu" in refused.stdout
