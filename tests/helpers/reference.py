"""The reference tier: tests that need an independent reference implementation (torch,
transformers, ai2-olmo-core, HF tokenizers) or a reference file downloaded from a package index
(AI2's wheels).

Such a test calls :func:`require` for a module (at module level, or in the test) and
:func:`unavailable` where a reference file cannot be had. Without the reference they skip, so
that the suite runs where the ``test`` extra is not installed; with ``OLMAX_REQUIRE_REFERENCE=1``
(which ``.ci/run`` sets) they fail instead, so that CI never turns green by skipping the
references. A module that calls :func:`require` at import gets the ``reference`` marker on every
test it holds (the root ``conftest.py``), so ``-m reference`` selects the tier.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest

ENV = "OLMAX_REQUIRE_REFERENCE"
# Test modules that called require() while they were imported.
MODULES: set[str] = set()


def required() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def unavailable(reason: str) -> None:
    """A reference cannot be had: skip, or fail under ``OLMAX_REQUIRE_REFERENCE=1``."""
    if required():
        pytest.fail(f"reference unavailable ({ENV}=1): {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(name: str) -> ModuleType:
    """Import the reference module ``name``, or skip (fail under ``OLMAX_REQUIRE_REFERENCE=1``)."""
    caller = sys._getframe(1).f_globals.get("__name__", "")
    MODULES.add(caller)
    try:
        return importlib.import_module(name)
    except ImportError as e:
        unavailable(f"reference module {name} cannot be imported: {e}")
