"""Every ordinary mistake of tests/cli/bad_inputs.py ends in one clean line (non-zero exit, nothing
on stdout, one line on stderr naming the file, key or value; a plan that does not fit: one line on
stdout, exit 1), nothing pickled or tagged is ever executed, no file that existed before a case is
changed or removed, a refused ``olmax train`` leaves nothing in its run directory, and
docs/bad-inputs.md shows what olmax prints today."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import bad_inputs
from helpers.reference import unavailable


HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec(
    "transformers") is not None


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """All cases, run in a fresh process (as a user runs them)."""
    out = tmp_path_factory.mktemp("bad") / "rows.json"
    env = {**__import__("os").environ,
           "PYTHONPATH": __import__("os").pathsep.join(str(bad_inputs.ROOT / d) for d in ("src", "tests"))}
    env.pop("OLMAX_DEBUG", None)
    proc = subprocess.run([sys.executable, str(Path(bad_inputs.__file__)), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_mistake_ends_in_one_clean_line(rows):
    assert len(rows) >= 120
    bad = []
    for r in rows:
        if r["code_executed"]:
            bad.append(f"{r['command']}: EXECUTED CODE {r['code_executed']}")
        elif r["destroyed"]:
            bad.append(f"{r['command']}: CHANGED WHAT EXISTED {r['destroyed']}")
        elif r.get("wrote"):
            bad.append(f"{r['command']}: WROTE INTO ITS RUN DIRECTORY {r['wrote']}")
        elif not r["clean"] and not (r["group"] == "parity" and not HAVE_TORCH):
            bad.append(f"{r['command']} (rc {r['rc']}, {r['lines']} lines):\n{r['stderr'][-800:]}")
    assert not bad, "\n\n".join(bad)


@pytest.mark.slow
@pytest.mark.reference
def test_the_table_in_docs_is_current(rows):
    if not HAVE_TORCH:
        unavailable("the parity rows need torch and transformers")
    doc = bad_inputs.DOC.read_text()
    assert doc == bad_inputs.markdown(rows), (
        "docs/bad-inputs.md is stale: PYTHONPATH=src python tests/cli/bad_inputs.py "
        "--write docs/bad-inputs.md")
