"""The suite's shared settings: its tiers, how two workers share it, its time budgets.

``scripts/test`` runs each tier as a pytest process of its own and holds each to a time budget:

- **default**: every test not marked ``slow``, ``mesh`` or ``tpu``, on 2 workers (pytest-xdist);
- **slow** (``--all``): the tests marked ``slow``, on 2 workers;
- **mesh**: the tests marked ``mesh``, in one process with :data:`MESH_DEVICES` CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), in process as JAX's own tests do it:
  a test starts a process of its own only where the process is the point (a kill, a restart,
  several hosts);
- **tpu**: the tests marked ``tpu``, in the Python 3.12 environment with libtpu.

The ``reference`` marker (set below) cuts across them: see ``helpers/reference.py``.

On 2 workers a test file is one unit of work (its module fixtures, e.g. a reference run, are
computed once; the fault tests' reference run is made once for both workers), a test marked
``own_unit`` a unit by itself (a long test that shares nothing with its file), and the
units start longest first (:data:`DURATIONS`, measured), so that the longest ones do not start
last. The run's JAX compilation cache is shared by the workers and every process they start
(``JAX_COMPILATION_CACHE_DIR``, set by ``scripts/test``).
"""

import json
import os
import signal
from pathlib import Path

import pytest

# Keep XLA from grabbing every core on small CI machines.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MESH_DEVICES = 8

# tests/device/ runs on a real accelerator (scripts/test --tpu-device), against references made
# on a CPU beforehand: collected only when asked for.
collect_ignore = [] if os.environ.get("OLMAX_DEVICE_TESTS") == "1" else ["device"]

# The default tier's per-test budget: a test not marked slow takes at most this many seconds (its
# setup, call and teardown, module fixtures included) on a 2-core CI machine. The run's summary
# names every default-tier test over it: mark it slow, or make it cheaper. (Each tier's total
# budget is scripts/test's.)
BUDGET_S = float(os.environ.get("OLMAX_TEST_BUDGET_S", "15"))
_spent: dict[str, float] = {}
_slow: set[str] = set()
_own: set[str] = set()        # tests marked own_unit (seen in the reports, as in the workers)

# Seconds per unit of work (a test file, or tests/fault), measured on 2 cores: refreshed when the
# suite changes shape by `OLMAX_TEST_DURATIONS_OUT=tests/durations.json scripts/test --all` (each
# tier writes the units it ran). It only orders the units, longest first: a unit missing here
# starts after the listed ones.
DURATIONS_FILE = Path(__file__).parent / "durations.json"
DURATIONS: dict[str, float] = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}


@pytest.fixture
def ctrl_c_reaches_children():
    """For a test that sends SIGINT to a process it starts: the process starts with SIGINT's
    default action, as from a terminal. A suite started in the background of a
    non-interactive shell (``scripts/test &``, ``nohup``) inherits SIGINT ignored, Python keeps it
    ignored, and so would every ``olmax`` it starts: Ctrl-C would never reach it."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)   # (a child starts with the default)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def unit_of(nodeid: str, own: bool = False) -> str:
    """The unit of work a test belongs to on 2 workers: its file; itself when ``own`` (marked
    ``own_unit``: a long test whose file shares no module fixture with it)."""
    return nodeid if own else nodeid.split("::", 1)[0]


def _unit(item) -> str:
    return unit_of(item.nodeid, item.get_closest_marker("own_unit") is not None)


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


def _mesh_devices() -> str | None:
    """None when this process has :data:`MESH_DEVICES` CPU devices (set before JAX starts), else
    why not."""
    from olmax.host_memory import forced_cpu_devices

    n = forced_cpu_devices(os.environ)
    if n >= MESH_DEVICES:
        return None
    return (f"needs {MESH_DEVICES} CPU devices (this process has {n}); scripts/test runs it in "
            f"its {MESH_DEVICES}-device process (XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{MESH_DEVICES} pytest -m mesh)")


# tryfirst: before pytest-xdist's own hook (a plugin registered after this file, so otherwise
# called first), which turns each item's ``xdist_group`` marker into its group; the markers set
# here must be there by then, or every test is a unit of its own and a module's fixtures are made
# again on each worker that runs one of its tests.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):

    from helpers import reference

    # The reference tier (tests/helpers/reference.py): every test of a module that required a
    # reference implementation when it was imported.
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ in reference.MODULES:
            item.add_marker(pytest.mark.reference)

    # Units of work for 2 workers, longest first (the module docstring). The order is the same
    # in every worker, as pytest-xdist requires.
    order = {unit: i for i, unit in enumerate(dict.fromkeys(_unit(item) for item in items))}
    items.sort(key=lambda item: (-DURATIONS.get(_unit(item), 0.0), order[_unit(item)]))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))

    for marker, why in (("tpu", _tpu_toolchain), ("mesh", _mesh_devices)):
        marked = [item for item in items if item.get_closest_marker(marker)]
        reason = why() if marked else None
        if reason is None:
            continue
        skip = pytest.mark.skip(reason=f"{marker} test: {reason}" if marker == "mesh" else
                                f"TPU test: {reason}; scripts/test runs it in its Python 3.12 environment")
        for item in marked:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """On a pytest-xdist worker of ``--dist loadgroup``: every test must carry its unit's group
    in its id by now (xdist's suffix ``@UNIT``), else the units of the module docstring did not
    take (a pytest that xdist cannot rename, a hook order changed) and each test would be a unit
    of its own, its module's fixtures made again on every worker that runs one of its tests."""
    if not (os.environ.get("PYTEST_XDIST_WORKER") and getattr(session.config.option, "loadgroup", False)):
        return
    lost = []
    for item in session.items:
        group = item.get_closest_marker("xdist_group")
        if group is not None and not item.nodeid.endswith(f"@{group.args[0]}"):
            lost.append(item.nodeid)
    if lost:
        raise pytest.UsageError(f"pytest-xdist did not group {len(lost)} test(s) into their units "
                                f"(e.g. {lost[0]}): check the pytest and pytest-xdist versions "
                                f"against constraints.txt")


def _plain(nodeid: str) -> str:
    """A test's id without pytest-xdist's ``@UNIT`` suffix (a unit is a path under tests/)."""
    return nodeid.split("@tests/", 1)[0]


def pytest_runtest_logreport(report):
    nodeid = _plain(report.nodeid)
    _spent[nodeid] = _spent.get(nodeid, 0.0) + report.duration
    if "slow" in report.keywords:
        _slow.add(nodeid)
    if "own_unit" in report.keywords:
        _own.add(nodeid)


def pytest_terminal_summary(terminalreporter):
    over = sorted(((s, n) for n, s in _spent.items() if s > BUDGET_S and n not in _slow), reverse=True)
    if over:
        terminalreporter.section(f"default-tier tests over the {BUDGET_S:g} s budget (mark them slow)")
        for s, n in over:
            terminalreporter.write_line(f"{s:7.1f} s  {n}")


def pytest_sessionfinish(session):
    """With ``OLMAX_TEST_DURATIONS_OUT``: this run's seconds per unit of work merged into that file
    (by the controlling process only, after its workers)."""
    out = os.environ.get("OLMAX_TEST_DURATIONS_OUT")
    if not out or hasattr(session.config, "workerinput"):
        return
    per_unit: dict[str, float] = {}
    for nodeid, seconds in _spent.items():
        unit = unit_of(nodeid, nodeid in _own)
        per_unit[unit] = per_unit.get(unit, 0.0) + seconds
    path = Path(out)
    merged = {**(json.loads(path.read_text()) if path.exists() else {}),
              **{unit: round(s, 1) for unit, s in per_unit.items()}}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
    tmp.replace(path)
