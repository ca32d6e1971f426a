"""The command line's last resort (olmax.reporting): any failure is one line, a traceback only on
request; ``key=value`` overrides anywhere; library noise filtered."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import types
from pathlib import Path

import pytest

from olmax.cli import main
from olmax.errors import ConfigError, NeedsAttentionError, OlmaxError, RestartableError
from olmax.reporting import describe_error, exit_code, quiet_libraries, run_reporting


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@pytest.mark.parametrize("exc, line, code", [
    (PermissionError(13, "Permission denied", "/data/run/x"), "Permission denied: /data/run/x", 2),
    (IsADirectoryError(21, "Is a directory", "tokens"), "Is a directory: tokens", 2),
    (FileNotFoundError(2, "No such file or directory", "a.yaml"), "file not found: a.yaml", 2),
    (OSError(30, "Read-only file system", "/ro/x"), "Read-only file system: /ro/x", 75),  # storage
    (OSError(28, "No space left on device"), "No space left on device", 75),   # the storage's
    (OSError(5, "Input/output error", "/nfs/run/x"), "Input/output error: /nfs/run/x", 75),
    (ConnectionResetError(104, "Connection reset by peer"), "Connection reset by peer", 75),
    (ValueError("could not convert string to float: 'x'\nmore detail"),
     "could not convert string to float: 'x'", 2),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
     "not UTF-8 text (invalid start byte at byte 0)", 2),
])
def test_library_errors_become_one_line(capsys, exc, line, code):
    def fail():
        raise exc

    assert run_reporting("eval", fail, debug=False) == code
    err = capsys.readouterr().err
    assert _lines(err) == [f"olmax eval: error: {line}"]
    assert describe_error(exc) == line


@pytest.mark.parametrize("exc, code", [
    (ConfigError("train.max_steps must be positive (got 0)"), 2),
    (OlmaxError("tokens.npy: not a token file"), 2),
    (NeedsAttentionError("loss nan at step 7"), 3),
    (RestartableError("s3://b/x: read failed after 6 attempts"), 75),
    (RuntimeError("DEADLINE_EXCEEDED: Barrier timed out"), 75),    # the runtime's: everything else
    (KeyboardInterrupt(), 130),
])
def test_the_exit_status_says_whether_a_restart_can_help(exc, code):
    def fail():
        raise exc

    assert exit_code(exc) == code and run_reporting("train", fail, debug=False) == code


def test_the_exit_codes_are_documented_where_users_look(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    for doc in (text, readme):
        for code, words in ((0, "finished, or stopped as asked"), (2, "configuration or input error"),
                            (3, "cannot go on without a person"), (75, "a restart may cure")):
            assert re.search(rf"\b{code}\b.{{0,40}}{words}", doc), (code, doc[:200])


def test_a_bug_is_one_line_that_says_so_and_debug_adds_the_traceback(capsys, monkeypatch):
    def bug():
        return {}["missing"]

    assert run_reporting("train", bug, debug=False) == 75     # not one of ours: may pass
    err = capsys.readouterr().err
    assert _lines(err) == ["olmax train: error: internal error: KeyError: 'missing' (a bug in olmax; "
                           "rerun with --debug for the traceback)"]
    assert run_reporting("train", bug, debug=True) == 75
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().endswith("for the traceback)")


def test_debug_flag_anywhere_and_environment(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("OLMAX_DEBUG", raising=False)
    assert main(["curves", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(_lines(err)) == 1
    assert main(["curves", str(tmp_path / "nothing"), "--debug"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    monkeypatch.setenv("OLMAX_DEBUG", "1")
    assert main(["curves", str(tmp_path / "nothing")]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_usage_mistakes_are_one_line(capsys):
    for argv in (["eval"], ["convert", "hf-to-jax", "a", "b"], ["nosuchcommand"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        lines = _lines(capsys.readouterr().err)
        assert len(lines) == 1 and ": error: " in lines[0] and "--help" in lines[0], lines


def test_overrides_anywhere_in_every_command(monkeypatch, capsys):
    import olmax.commands.bench as bench
    import olmax.commands.launch as launch
    import olmax.commands.train as train

    seen = {}
    monkeypatch.setattr(bench, "run_train", lambda args: seen.setdefault("bench", args) and 0)
    argv = ["bench", "train", "olmo3_tiny", "a.b=1", "--steps", "4", "c.d=2", "--no-ceiling", "e.f=3"]
    assert main(argv) == 0
    args = seen["bench"]
    assert args.overrides == ["a.b=1", "c.d=2", "e.f=3"] and args.steps == 4 and args.no_ceiling

    def record(args):
        seen["train"] = args
        return 0

    monkeypatch.setattr(train, "run", record)
    assert main(["train", "olmo3_tiny", "a.b=1", "--run-dir", "r", "c.d=2", "--quiet", "e.f=3",
                 "--attempt", "77.1"]) == 0
    got = seen["train"]
    assert got.overrides == ["a.b=1", "c.d=2", "e.f=3"] and got.run_dir == "r" and got.quiet
    assert got.attempt == "77.1"

    def record_launch(args):
        seen["launch"] = args
        return 0

    monkeypatch.setattr(launch, "run", record_launch)
    assert main(["launch", "slurm", "olmo3_tiny", "a.b=1", "--nodes", "2", "c.d=2", "--out", "j.sh"]) == 0
    assert seen["launch"].overrides == ["a.b=1", "c.d=2"] and seen["launch"].nodes == 2

    for argv, command in ((["bench", "train", "olmo3_tiny", "--steps", "4", "a.b=1", "--bogus"], "bench"),
                          (["train", "olmo3_tiny", "a.b=1", "--bogus"], "train"),
                          (["launch", "k8s", "olmo3_tiny", "a.b=1", "--bogus", "--nodes", "1"],
                           "launch k8s")):
        assert main(argv) == 2
        assert _lines(capsys.readouterr().err) == [
            f"olmax {command}: error: unknown option '--bogus' (see olmax {command} --help)"]


def test_orbax_notes_and_closed_loop_tracebacks_are_filtered(caplog, monkeypatch):
    from olmax.errors import OlmaxError

    quiet_libraries()
    absl = logging.getLogger("absl")
    with caplog.at_level(logging.WARNING, logger="absl"):
        absl.warning('Item "%s" was found in the checkpoint, but could not be restored. Please ...',
                     "opt_state")
        absl.warning("Given directory is read only=%s", "/x")
        try:
            raise OlmaxError("x.safetensors: non-finite weights in 1 tensor(s)")
        except OlmaxError:   # orbax's writer thread logs what it raised; the command reports it
            absl.error("_SignalingThread.run() raised an exception", exc_info=True)
        absl.warning("a real warning stays")
    assert [r.getMessage() for r in caplog.records] == ["a real warning stays"]

    passed_on = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: passed_on.append(u.exc_value))
    quiet_libraries()
    loop = asyncio.new_event_loop()
    loop.close()
    try:   # what a TensorStore callback meets after Orbax closed its loop
        loop.call_soon_threadsafe(lambda: None)
    except RuntimeError as e:
        closed = e
    other = RuntimeError("Event loop is closed")   # the same text from elsewhere is not hidden
    for exc in (closed, other):
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(exc), exc_value=exc,
                                                 exc_traceback=exc.__traceback__, err_msg=None,
                                                 object=None))
    assert passed_on == [other]


def test_a_save_ended_by_a_takeover_is_filtered_and_other_errors_stay(caplog, tmp_path, monkeypatch):
    """A superseded attempt's save: its temporary directory removed by the newer attempt, then its
    writer thread still running at exit, where Python's thread pools refuse new work (a pool shut
    down, or any pool once the interpreter is shutting down). The run's one line is the
    takeover's; the same kinds of error from elsewhere are logged."""
    import concurrent.futures.thread
    from concurrent.futures import ThreadPoolExecutor

    quiet_libraries()
    absl = logging.getLogger("absl")
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    live = ThreadPoolExecutor(1)

    def at_interpreter_exit():
        monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)
        try:
            live.submit(print)
        finally:
            monkeypatch.undo()
    with caplog.at_level(logging.ERROR, logger="absl"):
        for path in (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-5a0e3c1f" / "_CHECKPOINT_METADATA",
                     tmp_path / "checkpoints" / "6" / "_CHECKPOINT_METADATA"):
            try:
                open(path)
            except FileNotFoundError:
                absl.error("Failed to write metadata path=%s", path, exc_info=True)
        # the commit of a superseded save onto the step the newer attempt committed meanwhile
        # (etils' words), and the same error of another rename
        for src in ("6.orbax-checkpoint-tmp-5a0e3c1f", "6.orbax-checkpoint-tmp", "6.elsewhere"):
            try:
                raise FileExistsError(f"Cannot rename {tmp_path}/checkpoints/{src}. Destination "
                                      f"{tmp_path}/checkpoints/6 already exists.")
            except FileExistsError:
                absl.error("Failed to finalize checkpoint", exc_info=True)
        def elsewhere():
            raise RuntimeError("cannot schedule new futures after shutdown")

        for raise_it in (lambda: pool.submit(print), at_interpreter_exit, elsewhere):
            try:
                raise_it()
            except RuntimeError:
                absl.error("_SignalingThread.run() raised an exception", exc_info=True)
    kept = [(r.getMessage(), r.exc_info[1]) for r in caplog.records]
    assert [m for m, _ in kept] == [f"Failed to write metadata path={tmp_path}/checkpoints/6/"
                                    "_CHECKPOINT_METADATA", "Failed to finalize checkpoint",
                                    "_SignalingThread.run() raised an exception"]
    assert "6.elsewhere" in str(kept[1][1])
    assert str(kept[2][1]) == "cannot schedule new futures after shutdown"   # not from a pool


def test_a_lost_connections_orphaned_task_is_filtered_and_other_task_errors_stay(caplog):
    """asyncio logs "Task exception was never retrieved" when a task that failed is collected
    unawaited (aiohttp's request-body writer, when the store drops the connection; Orbax's
    serialization tasks, when a sibling's write failed the save first): dropped for a lost
    connection, a write out of TensorStore's retries or out of disk space (each fails the save,
    which says so in one line), kept for anything else."""
    import gc

    quiet_libraries()

    async def fail(exc):
        raise exc

    async def orphan(exc):
        task = asyncio.get_running_loop().create_task(fail(exc))
        await asyncio.sleep(0)
        del task

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for exc in (ConnectionResetError("Cannot write to closing transport"),
                    ValueError('ABORTED: Error opening "zarr" driver: Error writing "w/.zarray" '
                               "in OCDBT database at gs://b/run/checkpoints/4/: All 5 retry "
                               "attempts failed: CURL error Failure when receiving data from "
                               "the peer [curl_code='56']"),
                    ValueError('RESOURCE_EXHAUSTED: Error writing "layers.gate_proj/0.0.0" in '
                               'OCDBT database at local file "run/checkpoints/1.orbax-checkpoint-'
                               'tmp-10c7d064/params/ocdbt.process_0/": Failed writing: "run/'
                               'checkpoints/1/d/1871": Failed to write 23306240 bytes to file 12: '
                               "No space left on device [os_error_code='28']"),
                    ValueError("a bug in a task")):
            asyncio.run(orphan(exc))
            gc.collect()
    logged = [r.exc_info[1] for r in caplog.records
              if r.getMessage().startswith("Task exception was never retrieved")]
    assert [type(e).__name__ for e in logged] == ["ValueError"]


def test_version_names_the_release(capsys):
    """``olmax --version``: the package's version, the one pip installed (pyproject reads it)."""
    from importlib.metadata import version

    import olmax
    from olmax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"olmax {olmax.__version__}" == f"olmax {version('olmax')}"


_STARTUP_PROBE = r"""
import json, sys
from olmax.reporting import route_startup_noise, startup_messages
if sys.argv[1] == "routed":
    route_startup_noise()
import jax._src.cloud_tpu_init as tpu_init
import jax._src.hardware_utils as hw
# JAX's own start-up code as on a TPU v5e VM without transparent hugepages
hw.num_available_tpu_chips_and_device_id = lambda: (1, hw.TpuVersion.v5e)
hw.transparent_hugepages_enabled = lambda: False
tpu_init.cloud_tpu_init()
print(json.dumps(startup_messages()))
"""


def test_jax_start_up_warnings_go_to_the_start_up_log_not_the_terminal():
    """What a TPU v5e host printed on every command (JAX's Cloud TPU set-up warning about
    transparent hugepages) is kept from the terminal once olmax routes start-up noise (as
    ``olmax`` does before importing JAX), and kept in the start-up log instead."""
    import subprocess
    import sys

    def run(mode):
        out = subprocess.run([sys.executable, "-c", _STARTUP_PROBE, mode], text=True,
                             capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stderr, json.loads(out.stdout.strip().splitlines()[-1])

    err, logged = run("plain")
    assert "Transparent hugepages are not enabled" in err and logged == []   # the probe warns
    err, logged = run("routed")
    assert "Transparent hugepages" not in err and err.strip() == "", err
    assert len(logged) == 1 and logged[0].startswith("UserWarning: Transparent hugepages are not enabled")
