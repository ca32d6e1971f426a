"""The lock-file protocol (olmax.lockfile): one holder, stale locks taken over, lost locks noticed,
earlier attempts of a job replaced at once, live holders waited for.

The run directory's lock built on it: tests/train/test_run_lock.py; trainers racing on one
directory as real processes: tests/fault/test_run_lock_train.py.
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

from olmax.errors import OlmaxError
from olmax.lockfile import LockFile, LockHeld, identity, parse_attempt

LOCK_NAME = ".olmax-lock"


def RunDirLock(run, **kw):   # the run directory's lock file, as olmax train words it
    return LockFile(run / LOCK_NAME, subject=f"run directory {run}", user="olmax train",
                    hint="use another --run-dir or stop that run", **kw)


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
    run.mkdir()
    with RunDirLock(run) as lock:
        rec = json.loads((run / LOCK_NAME).read_text())
        assert rec["pid"] == os.getpid() and rec["host"] == socket.gethostname()
        assert rec["token"] == lock.token
        with pytest.raises(LockHeld) as e:
            RunDirLock(run).acquire()
        msg = str(e.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg and "\n" not in msg
        assert (run / LOCK_NAME).read_text() == json.dumps(rec) + "\n"   # untouched
    assert sorted(p.name for p in run.iterdir()) == []    # released: nothing left behind


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


@pytest.mark.parametrize("pid", [0, -1, 2**40, 2**63, True, "12"])
def test_a_lock_naming_a_pid_no_process_can_have_is_taken_over(tmp_path, pid):
    """pid 0 or -1 would ask kill() about a process group (always "alive"); one beyond the
    platform's range overflowed it (an internal error)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(_record(**{**identity(), "pid": pid, "proc_start": None}))
    lock = RunDirLock(run, stale_after=3600).acquire(wait_s=5)
    try:
        assert "which no process can have" in lock.took_over
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
    with pytest.raises(LockHeld, match="pid 12345 on host other-host.example"):
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
    with pytest.raises(LockHeld) as e:
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
    run.mkdir()
    lock = RunDirLock(run, heartbeat=0.05, stale_after=60).acquire()
    try:
        old = time.time() - 30
        os.utime(run / LOCK_NAME, (old, old))
        deadline = time.time() + 10
        while os.stat(run / LOCK_NAME).st_mtime < time.time() - 20 and time.time() < deadline:
            time.sleep(0.02)
        assert os.stat(run / LOCK_NAME).st_mtime > time.time() - 20, "no heartbeat"
        assert lock.verify()
        (run / LOCK_NAME).write_text(_record(token="u" * 32))   # somebody took it over
        while lock.lost is None and time.time() < deadline:
            time.sleep(0.02)
        assert "pid 12345 on host other-host.example" in lock.lost and not lock.verify()
    finally:
        lock.release()
    assert (run / LOCK_NAME).exists()    # not ours any more: left alone


def test_a_takeover_in_flight_is_read_until_its_record_is_written(tmp_path):
    """A taker moves the lock aside, then creates its own and writes its record; a taker that
    judged wrongly puts ours back. Between the two the holder's check finds no record: it reads
    again, names the new holder once its record is there, and keeps a lock that was put back."""
    import threading

    run = tmp_path / "run"
    run.mkdir()
    lock = RunDirLock(run, heartbeat=60, stale_after=600).acquire()
    path, aside = run / LOCK_NAME, run / f"{LOCK_NAME}.stale-test"
    try:
        def take_over():
            time.sleep(0.3)
            path.write_text("")                       # created, not written yet
            time.sleep(0.3)
            path.write_text(_record(token="t" * 32))

        def put_back():
            time.sleep(0.5)
            os.rename(aside, path)

        os.rename(path, aside)
        back = threading.Thread(target=put_back)
        back.start()
        assert lock.verify() and lock.lost is None     # ours again: not lost
        back.join()
        os.rename(path, aside)
        taker = threading.Thread(target=take_over)
        taker.start()
        assert not lock.verify()
        taker.join()
        assert "pid 12345 on host other-host.example" in lock.lost
    finally:
        lock.release()


def test_takers_queue_on_a_guard_and_a_dead_takers_guard_is_broken(tmp_path, monkeypatch):
    """A stale lock is taken over only under its takeover guard. A live taker's guard (another
    host, fresh) is waited for and the stale lock left alone; the guard of a taker that died (on
    this host: at once; elsewhere: once it is old) is broken, and nothing is left behind."""
    import olmax.lockfile as lockfile
    run = tmp_path / "run"
    run.mkdir()
    lock_file, guard = run / LOCK_NAME, run / (LOCK_NAME + ".takeover")
    old = time.time() - 600
    lock_file.write_text(_record())
    os.utime(lock_file, (old, old))
    guard.write_text(_record(token="g" * 32))               # a live taker elsewhere
    monkeypatch.setattr(lockfile, "GUARD_WAIT_S", 0.05)
    with pytest.raises(LockHeld, match="is contended: could not take its lock"):
        RunDirLock(run, stale_after=60).acquire()
    assert json.loads(lock_file.read_text())["token"] == "t" * 32 and guard.exists()
    for dead, age in ((_record(**{**identity(), "pid": _dead_pid(), "proc_start": None}), 0),
                      (_record(token="g" * 32), 600)):           # this host (fresh); elsewhere
        guard.write_text(dead)
        os.utime(guard, (time.time() - age,) * 2)
        lock_file.write_text(_record())
        os.utime(lock_file, (old, old))
        with RunDirLock(run, stale_after=60) as lock:
            assert "no heartbeat for" in lock.took_over
            assert json.loads(lock_file.read_text())["token"] == lock.token
        assert sorted(p.name for p in run.iterdir()) == []


def test_an_unwritable_place_is_one_clear_error(tmp_path, monkeypatch):
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
    except LockHeld:
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
    real_holder = LockFile.holder
    reads = []

    def holder(self):
        reads.append(1)
        return {} if len(reads) == 1 else real_holder(self)   # the first read: the file is aside

    monkeypatch.setattr(LockFile, "holder", holder)
    lock.acquire()
    try:
        assert lock.token and json.loads((run / LOCK_NAME).read_text())["token"] == lock.token
    finally:
        lock.release()


def test_a_later_attempt_of_the_same_job_takes_over_at_once_wherever_the_holder_ran(tmp_path):
    """Attempt 3 of job 4242 replaces attempt 2 (a live-looking holder on another host, fresh
    heartbeat); attempt 2 then finds the lock gone. Another job's fresh lock is not taken."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(_record(attempt="4242.2"))      # fresh, on another host
    with pytest.raises(LockHeld, match="pid 12345 on host other-host.example"):
        RunDirLock(run, stale_after=60, attempt="4243.7").acquire()
    t0 = time.monotonic()
    with RunDirLock(run, stale_after=60, attempt="4242.3") as lock:
        assert time.monotonic() - t0 < 5
        assert lock.took_over.endswith("(attempt 4242.3 replaces attempt 4242.2)")
        assert json.loads((run / LOCK_NAME).read_text())["attempt"] == "4242.3"
        older = RunDirLock(run, stale_after=60, attempt="4242.2")
        t0 = time.monotonic()
        with pytest.raises(LockHeld) as e:
            older.acquire(wait_s=30)          # a later attempt holds it: no waiting
        assert "held by attempt 4242.3 of this job" in str(e.value) and time.monotonic() - t0 < 5
        same = RunDirLock(run, stale_after=60, attempt="4242.3")   # a replaced pod of 4242.3
        with pytest.raises(LockHeld) as e:
            same.acquire(wait_s=0.5)          # waited for, as any live holder, then refused
        assert "is in use by olmax train" in str(e.value)


def test_a_live_holder_is_waited_for_until_it_releases(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    first = RunDirLock(run).acquire()
    said = []
    releaser = __import__("threading").Timer(1.0, first.release)
    releaser.start()
    t0 = time.monotonic()
    with RunDirLock(run, heartbeat=0.2, attempt="77.0").acquire(wait_s=20, on_wait=said.append):
        took = time.monotonic() - t0
    assert 0.9 < took < 10 and len(said) == 1 and "waiting up to 20 s" in said[0]


@pytest.mark.parametrize("bad", ["4242", "a.b", "job.1.x", ".3", "x y.1", "4242.-1"])
def test_an_attempt_is_job_dot_restart_count(bad):
    with pytest.raises(OlmaxError, match="expected JOB.N"):
        parse_attempt(bad)
    assert parse_attempt("c0ffee-12_ab.7") == ("c0ffee-12_ab", 7)
