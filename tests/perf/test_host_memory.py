"""The opt-in host allocator set-up of a CPU process (olmax.host_memory, OLMAX_HOST_MALLOC=keep):
large blocks freed by one step are served to the next without faulting their pages in again;
where it applies; off by default."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from olmax import host_memory

# A block of 256 MiB allocated (glibc's malloc, as XLA's runtime does), written and freed four times, by the main thread and by a worker
# thread (XLA's executor threads allocate a step's temporaries): the minor page faults of the last
# three rounds, per round, as a fraction of the block's pages.
CHILD = textwrap.dedent("""
    import ctypes, json, resource, sys, threading
    from olmax.host_memory import _glibc, keep_host_memory_mapped
    applied = keep_host_memory_mapped({"JAX_PLATFORMS": "cpu", "OLMAX_HOST_MALLOC": sys.argv[1]})
    N = 256 << 20
    libc = _glibc()
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def rounds(out):
        faults = []
        for _ in range(4):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            a = libc.malloc(N)
            ctypes.memset(a, 1, N)
            libc.free(a)
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        out.append(max(faults[1:]) / (N / 4096))

    main, worker = [], []
    rounds(main)
    t = threading.Thread(target=rounds, args=(worker,))
    t.start(); t.join()
    print(json.dumps({"applied": applied, "main": main[0], "worker": worker[0]}))
""")


def _child(choice: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, choice], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc only")
def test_freed_blocks_stay_mapped_for_the_next_step():
    kept, system, default = _child("keep"), _child("system"), _child("")
    assert kept["applied"] and not system["applied"] and not default["applied"]
    # glibc's defaults: every round maps the block afresh and faults in all of its pages.
    assert system["main"] > 0.9 and system["worker"] > 0.9
    assert default["main"] > 0.9 and default["worker"] > 0.9
    # Kept mapped: later rounds reuse the pages (a few faults for bookkeeping at most).
    assert kept["main"] < 0.01 and kept["worker"] < 0.01


def test_applies_only_where_jax_computes_on_the_cpu(monkeypatch):
    assert host_memory.cpu_backend_expected({"JAX_PLATFORMS": "cpu"})
    assert host_memory.cpu_backend_expected({"JAX_PLATFORMS": "cpu,tpu"})
    assert not host_memory.cpu_backend_expected({"JAX_PLATFORMS": "tpu"})
    assert not host_memory.cpu_backend_expected({"JAX_PLATFORMS": "cuda,cpu"})
    found = {"libtpu"}
    monkeypatch.setattr(host_memory.importlib.util, "find_spec", lambda name: object() if name in found else None)
    assert not host_memory.cpu_backend_expected({})
    found.clear()
    assert host_memory.cpu_backend_expected({})


def test_several_cpu_devices_keep_glibc_defaults(monkeypatch):
    flags = "--xla_cpu_use_onednn=false --xla_force_host_platform_device_count=8"
    assert host_memory.forced_cpu_devices({"XLA_FLAGS": flags}) == 8
    assert host_memory.forced_cpu_devices({"XLA_FLAGS": "--xla_force_host_platform_device_count 1"}) == 1
    assert host_memory.forced_cpu_devices({}) == 1
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(host_memory, "_glibc", lambda: pytest.fail("must not configure glibc"))
    assert host_memory.keep_host_memory_mapped(
        {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, host_memory.ENV: "keep"}) is False


def test_off_by_default_and_decided_once(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    calls = []
    monkeypatch.setattr(host_memory, "_glibc", lambda: calls.append(1))
    assert host_memory.keep_host_memory_mapped({"JAX_PLATFORMS": "cpu"}) is False   # opt-in
    assert host_memory.keep_host_memory_mapped({"JAX_PLATFORMS": "cpu", host_memory.ENV: "keep"}) is False  # decided once
    assert calls == []
