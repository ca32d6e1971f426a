"""The run directory's lock as the trainer holds it (olmax.train.callbacks.run_lock) and the run
directory's creation (olmax.train.trainer.create_run_dir); the protocol itself is
tests/test_lockfile.py, trainers racing as real processes tests/fault/test_run_lock_train.py."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from olmax.errors import OlmaxError
from olmax.reporting import exit_code
from olmax.train.callbacks.run_lock import (LOCK_NAME, NoLock, RunDirInUse, RunDirLockLost, RunLock,
                                            lock_run_dir)
from olmax.train.trainer import create_run_dir


def _record(**fields) -> str:
    """The lock file of a trainer on another host (judged by its heartbeat: the file's mtime)."""
    return json.dumps({"pid": 12345, "host": "other-host.example", "token": "t" * 32, **fields})


def test_a_second_trainer_is_refused_with_one_line_and_exit_2(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lock = lock_run_dir(run)
    try:
        with pytest.raises(RunDirInUse) as e:
            lock_run_dir(run)
        msg = str(e.value)
        assert msg.startswith(f"run directory {run} is in use by olmax train pid {os.getpid()} on "
                              f"host {socket.gethostname()} since ")
        assert msg.endswith("; use another --run-dir or stop that run") and "\n" not in msg
        assert exit_code(e.value) == 2
        assert isinstance(lock_run_dir(run, is_main=False), NoLock)   # other processes hold nothing
    finally:
        lock.release()
    assert not (run / LOCK_NAME).exists()


def test_a_lost_lock_stops_the_run_at_the_next_step_with_exit_75(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock(run, heartbeat=60).acquire()
    try:
        lock.on_step_end(None, 1, {})
        (run / LOCK_NAME).write_text(_record(token="u" * 32, attempt="9.1"))   # a later attempt
        with pytest.raises(RunDirLockLost) as e:     # checked at the step, not at the next beat
            lock.on_step_end(None, 2, {})
        assert "taken over by pid 12345 on host other-host.example (attempt 9.1)" in str(e.value)
        assert exit_code(e.value) == 75
    finally:
        lock.close()
    assert (run / LOCK_NAME).exists()      # not ours any more: left alone


def test_an_attempt_replaced_by_a_later_one_exits_75_and_a_foreign_fresh_lock_is_waited_out(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(_record(attempt="9.2"))
    with pytest.raises(RunDirInUse) as e:
        RunLock(run, attempt="9.1").acquire()          # a later attempt of its own job holds it
    assert exit_code(e.value) == 75 and "held by attempt 9.2 of this job" in str(e.value)
    (run / LOCK_NAME).write_text(_record(attempt="other.0"))
    beating = threading.Event()

    def heartbeat():             # another job's live holder, on another host
        while not beating.wait(0.1):
            os.utime(run / LOCK_NAME)

    beater = threading.Thread(target=heartbeat)
    beater.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RunDirInUse) as e:      # waited out (stale time + 2 beats), then refused
            RunLock(run, attempt="9.3", stale_after=1.0, heartbeat=0.2).acquire()
    finally:
        beating.set()
        beater.join()
    assert exit_code(e.value) == 2
    assert 1.4 <= time.monotonic() - t0 < 10 and "in use by olmax train pid 12345" in str(e.value)
    with RunLock(run, attempt="9.4", stale_after=1.0, heartbeat=0.2) as lock:   # its beat stopped
        assert "no heartbeat for" in lock.took_over


def test_the_run_directory_is_created_or_named_in_one_line(tmp_path):
    run = tmp_path / "a" / "run"
    assert create_run_dir(run) is True and run.is_dir()
    assert create_run_dir(run) is False
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OlmaxError, match="exists and is not a directory"):
        create_run_dir(f)
    with pytest.raises(OlmaxError, match="parent path is a file"):
        create_run_dir(f / "run")
