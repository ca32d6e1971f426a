import os

# Keep XLA from grabbing every core on small CI machines; tests that need several devices run in
# a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# The default tier's time budget: a test not marked slow takes at most this many seconds (its
# setup, call and teardown, module fixtures included) on a 2-core CI machine. The run's summary
# names every default-tier test over it: mark it slow, or make it cheaper.
BUDGET_S = float(os.environ.get("OLMAX_TEST_BUDGET_S", "15"))
_spent: dict[str, float] = {}
_slow: set[str] = set()


def _tpu_toolchain() -> str | None:
    """None when jax >= 0.12 with libtpu is importable here, else why not."""
    import importlib.util
    import sys

    if sys.version_info < (3, 12):
        return f"Python {sys.version_info[0]}.{sys.version_info[1]} (needs >= 3.12)"
    import jax

    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12):
        return f"jax {jax.__version__} (needs >= 0.12)"
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (pip install -e '.[tpu]')"
    return None


def pytest_collection_modifyitems(config, items):
    import pytest

    from helpers import reference

    # The reference tier (tests/helpers/reference.py): every test of a module that required a
    # reference implementation when it was imported.
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ in reference.MODULES:
            item.add_marker(pytest.mark.reference)

    tpu_items = [item for item in items if item.get_closest_marker("tpu")]
    if not tpu_items:
        return
    why = _tpu_toolchain()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"TPU test: {why}; scripts/test runs it in its Python 3.12 environment")
    for item in tpu_items:
        item.add_marker(skip)


def pytest_runtest_logreport(report):
    _spent[report.nodeid] = _spent.get(report.nodeid, 0.0) + report.duration
    if "slow" in report.keywords:
        _slow.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    over = sorted(((s, n) for n, s in _spent.items() if s > BUDGET_S and n not in _slow), reverse=True)
    if over:
        terminalreporter.section(f"default-tier tests over the {BUDGET_S:g} s budget (mark them slow)")
        for s, n in over:
            terminalreporter.write_line(f"{s:7.1f} s  {n}")
