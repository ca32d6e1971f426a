"""Exit status by cause: one real ``olmax`` process per row of the table in docs/bad-inputs.md
(``bad_inputs.exit_statuses``) that can be triggered cheaply, each ending with the row's status.

Rows not triggered here, and where each is proven instead:

- 3, a non-finite loss: only a training step makes one (tests/fault/test_train_faults.py,
  ``test_nan_loss_stops_and_keeps_last_good``).
- 75, peers that did not start: two ``olmax train`` processes and a start-up timeout, about 10 s
  (tests/fault/test_startup.py).
- 75, an internal error: a real one is a bug, which olmax has none of on purpose; the mapping of an
  unexpected exception to 75 is checked in process (tests/cli/test_reporting.py).
- 143 from ``olmax train``'s own stop (checkpoint, then ``--exit-code-on-stop 143``): needs the
  training loop (tests/launch/test_launch.py ``test_train_exit_code_on_stop`` with the trainer
  replaced; tests/fault/test_train_faults.py for a real SIGTERM stop). Here: SIGTERM to another
  command waiting on the network, which ends by the signal, 128 + 15.
- 1, a plan that does not fit: ``olmax plan`` compiles the step (about 10 s); the bad-inputs case
  "a step larger than the local devices' memory" runs it in process.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import bad_inputs
from olmax import errors

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu"}
ENV.pop("OLMAX_DEBUG", None)
NOT_TRIGGERED = {("the run cannot go on", 3), ("peers that did not", 75), ("an internal error", 75),
                 ("`olmax plan`", 1)}


def olmax(*argv: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "olmax.cli", *argv], cwd=cwd, env=kw.pop("env", ENV),
                          capture_output=True, text=True, timeout=60, **kw)


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    return tmp_path


def _row(prefix: str) -> bad_inputs.ExitStatus:
    (row,) = [x for x in bad_inputs.exit_statuses() if x.cause.startswith(prefix)]
    return row


def test_every_row_is_a_constant_of_the_policy_and_is_triggered_or_named():
    rows = bad_inputs.exit_statuses()
    for x in rows:
        assert getattr(errors, x.name) == x.status, x
    assert {x.status for x in rows} >= {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    triggered = {("finished", 0), ("a configuration", 2), ("storage", 75), ("preempted", 143),
                 ("interrupted", 130)}
    for prefix, status in triggered | NOT_TRIGGERED:   # each names exactly one row
        assert [x.status for x in rows if x.cause.startswith(prefix)] == [status], prefix
    assert len(rows) == len(triggered | NOT_TRIGGERED), "a new row needs its trigger here"

def test_finished_exits_0(run_dir):
    out = olmax("curves", "run", cwd=run_dir)
    assert out.returncode == _row("finished").status == 0, out.stderr


def test_a_bad_key_exits_2(run_dir):
    out = olmax("curves", "run", "--metric", "no_such_metric", cwd=run_dir)
    assert out.returncode == _row("a configuration").status == 2, out.stderr
    assert out.stderr.startswith("olmax curves: error: run: no 'no_such_metric' values")


def test_a_not_permitted_output_directory_exits_2(run_dir):
    """A directory the user may not write (chmod) is the path's fault, not the storage's: 2."""
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    (run_dir / "ro").mkdir(mode=0o555)
    out = olmax("curves", "run", "--json", "ro/summary.json", cwd=run_dir)
    assert out.returncode == 2, out.stderr


def _full_disk():   # in the child: writes past 0 bytes fail with EFBIG, as on a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_storage_that_cannot_take_a_write_exits_75(run_dir):
    out = olmax("curves", "run", "--json", "summary.json", cwd=run_dir, preexec_fn=_full_disk)
    assert out.returncode == _row("storage").status == 75, out.stderr
    assert out.stderr == "olmax curves: error: cannot write summary.json: File too large\n"
    assert not (run_dir / "summary.json").exists()


@pytest.mark.parametrize("sig, row", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "preempted")])
def test_a_signal_while_waiting_for_the_network(run_dir, sig, row, ctrl_c_reaches_children):
    """``olmax curves gs://...`` against a server that accepts the connection and never answers:
    the signal comes while the command waits for it."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        server.settimeout(30)
        env = {**ENV, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{server.getsockname()[1]}"}
        p = subprocess.Popen([sys.executable, "-m", "olmax.cli", "curves", "gs://bkt/run/metrics.jsonl"],
                             cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        conn, _ = server.accept()     # the command is waiting for an answer
        with conn:
            p.send_signal(sig)
            stdout, stderr = p.communicate(timeout=30)
    status = p.returncode if p.returncode >= 0 else 128 - p.returncode   # as a shell reports it
    assert status == _row(row).status, stderr
    if sig == signal.SIGINT:
        assert stderr == "olmax curves: interrupted\n"
