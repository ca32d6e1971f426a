"""An install with no package index: ``scripts/wheelhouse`` collects the wheels of the pinned
versions for a target, ``scripts/bootstrap --offline`` installs olmax from that folder alone, and
the result runs. pip's index here is a closed port and no pip configuration is read, so a wheel the
folder lacks fails the install instead of being fetched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_INDEX = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
            "PIP_NO_CACHE_DIR": "1"}


def _run(cmd, env=None, timeout=600):
    out = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.slow
def test_have_leaves_out_what_the_target_has(tmp_path):
    """A TPU host's own JAX (``pip freeze`` of it) is not collected again: only what it lacks."""
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("jax==0.10.2\njaxlib==0.10.2\nnumpy==1.0.0\n")   # numpy at another version
    out = _run([sys.executable, "scripts/wheelhouse", str(tmp_path / "wh"), "--python", "3.11",
                "--have", str(freeze), "--dry-run"])
    head, *listed = out.strip().splitlines()
    names = {line.split("==")[0].lower() for line in listed}
    assert "2 already on the target: jax==0.10.2, jaxlib==0.10.2" in head
    assert "jax" not in names and "jaxlib" not in names and "numpy" in names
    assert {"optax", "orbax-checkpoint", "setuptools", "wheel"} <= names
    assert not (tmp_path / "wh").exists()      # a dry run writes nothing


@pytest.mark.slow
def test_an_offline_install_from_the_wheelhouse_runs(tmp_path):
    wh, venv = tmp_path / "wheels", tmp_path / "venv"
    _run([sys.executable, "scripts/wheelhouse", str(wh), "--python", "3.11"])
    record = json.loads((wh / "wheelhouse.json").read_text())
    assert record["constraints"] == "constraints.txt" and record["left_out"] == []
    assert sorted(record["files"]) == sorted(p.name for p in wh.glob("*.whl"))
    pins = (wh / "requirements.txt").read_text().splitlines()
    assert "jax==0.10.2" in pins and any(p.startswith("optax==") for p in pins)
    _run(["scripts/bootstrap", "--offline", str(wh)],
         env={**NO_INDEX, "OLMAX_VENV": str(venv), "OLMAX_PIP_NO_COMPILE": "1",
              # a plain interpreter (this one's base): no JAX of its own to use
              "PYTHON": getattr(sys, "_base_executable", sys.executable)})
    assert _run([str(venv / "bin" / "olmax"), "--version"]).startswith("olmax ")
    out = _run([str(venv / "bin" / "olmax"), "bench", "matmul", "--size", "64", "--iters", "1"])
    assert "TFLOP/s" in out
    # every distribution the environment holds came from the folder (or is pip's own)
    frozen = _run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--local",
                   "--exclude-editable"],
                  env=NO_INDEX).splitlines()
    assert sorted(frozen, key=str.lower) == sorted((p for p in pins if not p.startswith(
        ("setuptools==", "wheel=="))), key=str.lower)
