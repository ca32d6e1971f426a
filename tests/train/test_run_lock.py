"""The run-directory lock (olmax.train.run_lock): one holder, stale locks taken over, lost locks noticed.

Trainers racing on one directory as real processes: tests/fault/test_run_lock_train.py.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest

from olmax.config import OlmaxError
from olmax.train.run_lock import LOCK_NAME, RunDirInUse, RunDirLock, RunDirLockLost, identity


def _record(**fields) -> str:
    base = {"pid": 12345, "host": "other-host.example", "boot_id": "x", "pid_ns": "pid:[1]",
            "proc_start": "1", "token": "t" * 32, "started": "2025-01-01T00:00:00Z",
            "command": ["olmax", "train"]}
    base.update(fields)
    return json.dumps(base) + "\n"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_one_holder_and_a_clear_refusal(tmp_path):
    run = tmp_path / "run"
    with RunDirLock(run) as lock:
        rec = json.loads((run / LOCK_NAME).read_text())
        assert rec["pid"] == os.getpid() and rec["host"] == socket.gethostname()
        assert rec["token"] == lock.token
        with pytest.raises(RunDirInUse) as e:
            RunDirLock(run).acquire()
        msg = str(e.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg and "\n" not in msg
        assert (run / LOCK_NAME).read_text() == json.dumps(rec) + "\n"   # untouched
    assert not (run / LOCK_NAME).exists()
    assert not run.exists()          # created by the lock, nothing else written: removed again


def test_release_keeps_a_directory_with_contents(tmp_path):
    run = tmp_path / "run"
    with RunDirLock(run):
        (run / "metrics.jsonl").write_text("{}\n")
    assert run.is_dir() and not (run / LOCK_NAME).exists()


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    me = identity()
    (run / LOCK_NAME).write_text(_record(**{**me, "pid": _dead_pid(), "proc_start": None}))
    lock = RunDirLock(run, stale_after=3600).acquire()
    try:
        assert "is gone" in lock.took_over
        assert json.loads((run / LOCK_NAME).read_text())["token"] == lock.token
    finally:
        lock.release()


def test_a_reused_pid_is_not_mistaken_for_the_holder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    me = identity()   # our own pid, but "started" at another time: the holder is gone
    (run / LOCK_NAME).write_text(_record(**{**me, "proc_start": "1"}))
    with RunDirLock(run, stale_after=3600) as lock:
        assert "another process" in lock.took_over


def test_a_live_holder_on_another_host_is_respected_until_its_heartbeat_stops(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(_record())
    with pytest.raises(RunDirInUse, match="pid 12345 on host other-host.example"):
        RunDirLock(run, stale_after=60).acquire()
    old = time.time() - 120
    os.utime(run / LOCK_NAME, (old, old))
    with RunDirLock(run, stale_after=60) as lock:
        assert "no heartbeat for" in lock.took_over


def test_an_unreadable_lock_file_is_named_and_taken_over_once_stale(tmp_path):
    """A lock file that is not olmax's JSON (here: not even UTF-8) is named while it is fresh and
    taken over once it has not changed for the stale time, like a holder that stopped beating."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_bytes(b"\xff\xfe\x00garbage\xe9")
    with pytest.raises(RunDirInUse) as e:
        RunDirLock(run, stale_after=60).acquire()
    assert str(e.value).startswith(f"run directory {run} holds a lock file olmax cannot read, "
                                   f"{run / LOCK_NAME} (not the JSON olmax train writes; changed ")
    assert "taken over 60 s after its last change" in str(e.value)
    assert (run / LOCK_NAME).read_bytes() == b"\xff\xfe\x00garbage\xe9"
    old = time.time() - 120
    os.utime(run / LOCK_NAME, (old, old))
    with RunDirLock(run, stale_after=60) as lock:
        assert lock.took_over.startswith("took over a stale lock of an unknown holder (an "
                                         "unreadable lock file for 1")
        assert json.loads((run / LOCK_NAME).read_text())["token"] == lock.token


def test_heartbeat_keeps_the_lock_fresh_and_notices_a_takeover(tmp_path):
    run = tmp_path / "run"
    lock = RunDirLock(run, heartbeat=0.05, stale_after=60).acquire()
    try:
        old = time.time() - 30
        os.utime(run / LOCK_NAME, (old, old))
        deadline = time.time() + 10
        while os.stat(run / LOCK_NAME).st_mtime < time.time() - 20 and time.time() < deadline:
            time.sleep(0.02)
        assert os.stat(run / LOCK_NAME).st_mtime > time.time() - 20, "no heartbeat"
        lock.check()
        (run / LOCK_NAME).write_text(_record(token="u" * 32))   # somebody took it over
        while lock.lost is None and time.time() < deadline:
            time.sleep(0.02)
        with pytest.raises(RunDirLockLost, match="pid 12345 on host other-host.example"):
            lock.on_step_end(None, 1, {})
    finally:
        lock.release()
    assert (run / LOCK_NAME).exists()    # not ours any more: left alone


def test_a_file_or_unwritable_place_is_one_clear_error(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OlmaxError, match="exists and is not a directory"):
        RunDirLock(f).acquire()
    with pytest.raises(OlmaxError, match="parent path is a file"):
        RunDirLock(f / "run").acquire()
    d = tmp_path / "ro"
    d.mkdir()
    real_open = os.open

    def refuse(path, flags, *a):
        if str(path).endswith(LOCK_NAME):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(OlmaxError, match="is not writable: Permission denied"):
        RunDirLock(d).acquire()


def _race(run, barrier, results, stale_after):
    barrier.wait()
    try:
        lock = RunDirLock(run, stale_after=stale_after).acquire()
        results.put(("won", lock.took_over))
        time.sleep(1.0)     # hold it while the others try
        lock.release()
    except RunDirInUse:
        results.put(("lost", None))


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale-takeover"])
def test_exactly_one_of_many_racing_processes_wins(tmp_path, stale):
    run = tmp_path / "run"
    run.mkdir()
    if stale:                       # everyone sees a dead foreign lock and tries to take it over
        (run / LOCK_NAME).write_text(_record())
        old = time.time() - 600
        os.utime(run / LOCK_NAME, (old, old))
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(run, barrier, results, 60)) for _ in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    got = [results.get(timeout=5) for _ in procs]
    assert sum(1 for r, _ in got if r == "won") == 1, got


def test_own_lock_put_back_by_a_racing_taker_is_still_ours(tmp_path, monkeypatch):
    """A racing taker that moved our freshly written lock aside (it had judged the previous, stale
    one) puts it back; our read in between found no file. The record that is back is ours: we
    hold the lock, instead of reporting the directory in use by ourselves."""
    run = tmp_path / "run"
    run.mkdir()
    lock = RunDirLock(run)
    real_holder = RunDirLock._holder
    reads = []

    def holder(self):
        reads.append(1)
        return {} if len(reads) == 1 else real_holder(self)   # the first read: the file is aside

    monkeypatch.setattr(RunDirLock, "_holder", holder)
    lock.acquire()
    try:
        assert lock.token and json.loads((run / LOCK_NAME).read_text())["token"] == lock.token
    finally:
        lock.release()
