"""The epoch order is built once per cache (olmax.data.instances.epoch_indices over
olmax.io.build_once): by one thread of one process, whatever the threads and processes that ask for
it at the same time; the others wait and read the same file; a builder that dies is replaced."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import numpy as np

import olmax.data.instances as instances
from olmax.data.instances import epoch_indices, shuffled_indices

N, SEED, EPOCH = 5000, 17, 1


def _counting_build(marks: Path, delay: float):
    """shuffled_indices that leaves a mark per build and takes ``delay`` seconds."""
    real = shuffled_indices

    def build(n, seed, epoch):
        marks.mkdir(exist_ok=True)
        (marks / f"{os.getpid()}-{threading.get_ident()}").touch()
        time.sleep(delay)
        return real(n, seed, epoch)

    return build


def test_threads_of_one_process_build_it_once(tmp_path, monkeypatch):
    monkeypatch.setattr(instances, "shuffled_indices", _counting_build(tmp_path / "marks", 0.5))
    barrier, got = threading.Barrier(4), []

    def ask():
        barrier.wait()
        got.append(epoch_indices(N, SEED, EPOCH, cache_dir=tmp_path / "cache", disk_cache_min=100)[:])

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(list((tmp_path / "marks").iterdir())) == 1
    want = shuffled_indices(N, SEED, EPOCH)
    assert len(got) == 4 and all(np.array_equal(g, want) for g in got)


def _ask(cache: Path, marks: Path, barrier, delay: float, results) -> None:
    instances.shuffled_indices = _counting_build(marks, delay)
    barrier.wait()
    rows = epoch_indices(N, SEED, EPOCH, cache_dir=cache, disk_cache_min=100)
    results.put(bytes(np.asarray(rows[:], dtype="<u4").tobytes()))


def test_processes_sharing_a_cache_build_it_once_and_all_read_it(tmp_path):
    ctx = mp.get_context("spawn")   # the parent may run JAX threads: no fork
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(tmp_path / "cache", tmp_path / "marks", barrier, 1.0,
                                            results)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(list((tmp_path / "marks").iterdir())) == 1            # one build in all
    want = shuffled_indices(N, SEED, EPOCH).astype("<u4").tobytes()
    assert got == [want] * 4
    assert sorted(p.name for p in (tmp_path / "cache" / "indices").iterdir()) == [
        f"global_indices_seed{SEED}_epoch{EPOCH}_size{N}_v2.npy"]     # no lock or temporary left


def _die_while_building(cache: Path, started) -> None:
    def build(n, seed, epoch):
        started.set()
        time.sleep(60)            # killed here

    instances.shuffled_indices = build
    epoch_indices(N, SEED, EPOCH, cache_dir=cache, disk_cache_min=100)


def test_a_builder_that_dies_is_replaced_by_a_waiter(tmp_path):
    ctx = mp.get_context("spawn")   # the parent may run JAX threads: no fork
    started = ctx.Event()
    builder = ctx.Process(target=_die_while_building, args=(tmp_path / "cache", started))
    builder.start()
    assert started.wait(30)
    killer = threading.Timer(1.0, lambda: os.kill(builder.pid, 9))
    killer.start()
    t0 = time.monotonic()
    rows = epoch_indices(N, SEED, EPOCH, cache_dir=tmp_path / "cache", disk_cache_min=100)
    builder.join(10)
    assert builder.exitcode == -9 and time.monotonic() - t0 < 30     # same host: taken over at once
    assert np.array_equal(rows[:], shuffled_indices(N, SEED, EPOCH))
