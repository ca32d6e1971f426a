"""The reference tier (tests/helpers/reference.py): a test whose reference is missing skips, and
fails under OLMAX_REQUIRE_REFERENCE=1 (as CI runs); modules that require a reference are selected
by ``-m reference``."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(tmp_path, source: str, *args: str, require: bool = False):
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    (tests / "test_probe.py").write_text(source)
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    reference: the reference tier\n    tpu: TPU\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    env.pop("OLMAX_REQUIRE_REFERENCE", None)
    if require:
        env["OLMAX_REQUIRE_REFERENCE"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


MISSING = """
from helpers.reference import require
require("no_such_reference_module_for_olmax")

def test_needs_it():
    assert True
"""

PRESENT = """
import pytest
from helpers.reference import require, unavailable
json = require("json")

def test_uses_it():
    assert json.loads("1") == 1

def test_wheel():
    unavailable("the wheel cannot be downloaded")
"""


def test_missing_reference_skips_and_fails_when_required(tmp_path):
    quiet = _pytest(tmp_path, MISSING)
    assert quiet.returncode in (0, 5) and "1 skipped" in quiet.stdout, quiet.stdout   # 5: nothing ran
    strict = _pytest(tmp_path, MISSING, require=True)
    assert strict.returncode != 0 and "OLMAX_REQUIRE_REFERENCE=1" in strict.stdout, strict.stdout
    strict = _pytest(tmp_path, PRESENT, require=True)
    assert strict.returncode != 0 and "1 failed, 1 passed" in strict.stdout, strict.stdout


def test_modules_that_require_a_reference_are_the_reference_tier(tmp_path):
    selected = _pytest(tmp_path, PRESENT, "-m", "reference")
    assert "1 passed, 1 skipped" in selected.stdout, selected.stdout
    rest = _pytest(tmp_path, PRESENT, "-m", "not reference")
    assert "2 deselected" in rest.stdout, rest.stdout
