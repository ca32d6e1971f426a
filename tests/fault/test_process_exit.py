"""Process 0 of a multi-process ``olmax train`` ends with the command's status even when tearing
down JAX's coordination service would abort it.

Destroying the service (a gRPC server) at interpreter exit races with the peers' last requests, and
gRPC's own check can then fail inside it and abort the process (``Check failed: queue.Pop() ==
nullptr``, SIGABRT) after a run that ended well. The race is rare; here it is made certain: each
process starts with a ``sitecustomize`` that, once JAX's distributed state is initialised, puts a
stand-in before the service whose ``shutdown()`` aborts the process as that check does. A program
that ends through JAX's own exit dies by SIGABRT under it (the first test: the stand-in works);
``olmax train`` leaves the service to the operating system (:mod:`olmax.process_exit`) and both of
its processes exit 0 (the second). Before it ends, process 0 waits for its peers to disconnect from
the service (the third): a service gone while a peer's client still polls it aborts the peer, as
the first test's peer may be.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from helpers.trainrun import command, env_for, free_port, metrics

pytestmark = pytest.mark.slow

_SITECUSTOMIZE = '''
import importlib.abc
import importlib.util
import os
import sys


class _AbortingService:
    """JAX's coordination service, whose teardown aborts the process."""

    def __init__(self, real):
        self.real = real

    def shutdown(self):
        sys.stderr.write("test: the coordination service is being torn down\\n")
        sys.stderr.flush()
        os.abort()


def _patch(module):
    initialize = module.State.initialize

    def patched(self, *args, **kwargs):
        initialize(self, *args, **kwargs)
        if self.service is not None:
            self.service = _AbortingService(self.service)

    module.State.initialize = patched


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "jax._src.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
'''

_LIBRARY_USE = textwrap.dedent("""
    import sys
    from olmax.config import DistributedConfig
    from olmax.parallel.distributed import maybe_initialize
    coordinator, pid = sys.argv[1], int(sys.argv[2])
    assert maybe_initialize(DistributedConfig(coordinator=coordinator, num_processes=2,
                                              process_id=pid))
    print("initialised", pid, flush=True)
""")


def _env(tmp_path, devices: int) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = env_for(devices)
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(site)
    return env


def _pair(args_for, env, timeout: float) -> list[tuple[int, str]]:
    procs = [subprocess.Popen(args_for(i), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def test_the_stand_in_aborts_a_program_that_ends_through_jaxs_own_exit(tmp_path):
    coordinator = f"127.0.0.1:{free_port()}"
    (rc0, out0), (rc1, out1) = _pair(
        lambda i: [sys.executable, "-c", _LIBRARY_USE, coordinator, str(i)],
        _env(tmp_path, 1), timeout=300)
    assert "initialised 0" in out0 and "initialised 1" in out1, (out0, out1)
    assert "the coordination service is being torn down" in out0, out0
    assert rc0 == -signal.SIGABRT, (out0, out1)
    # the peer may go down with it: a service that vanishes under its client's error poll is a
    # fatal error to the client (why olmax's process 0 waits for its peers, the test below)
    assert rc1 in (0, -signal.SIGABRT), (out0, out1)


def test_olmax_train_leaves_the_service_to_the_os_and_exits_with_its_status(tmp_path):
    coordinator, run_dir = f"127.0.0.1:{free_port()}", tmp_path / "run"
    (rc0, out0), (rc1, out1) = _pair(
        lambda i: command(run_dir, ["train.max_steps=2", f"distributed.coordinator={coordinator}",
                                    "distributed.num_processes=2", f"distributed.process_id={i}"]),
        _env(tmp_path, 4), timeout=600)
    assert (rc0, rc1) == (0, 0), (out0[-3000:], out1[-3000:])
    assert "torn down" not in out0
    assert "olmax train: done: steps 1..2" in out0, out0[-3000:]
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]


def test_process_0_waits_for_its_peers_to_disconnect(tmp_path):
    """What process 0 waits for before it ends: its peers' connections to the service's port (a
    peer in another process holds one for 1.5 s), not its own client's, and no longer than told."""
    from olmax.process_exit import peers_connected, wait_for_peers

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as own, server.accept()[0]:
            assert peers_connected(port) == set()       # this process's own client is no peer
            t0 = time.monotonic()
            wait_for_peers(port, 10)
            assert time.monotonic() - t0 < 1
            peer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
                import socket, sys, time
                c = socket.create_connection(("127.0.0.1", {port}))
                print("connected", flush=True)
                time.sleep(1.5)
            """)], stdout=subprocess.PIPE, text=True)
            assert peer.stdout.readline().strip() == "connected"
            with server.accept()[0]:
                assert len(peers_connected(port)) == 1
                t0 = time.monotonic()
                wait_for_peers(port, 0.3)                  # bounded
                assert 0.3 <= time.monotonic() - t0 < 1.2 and peer.poll() is None
                wait_for_peers(port, 10)                   # until the peer has gone
                assert peer.wait(timeout=5) == 0 and peers_connected(port) == set()
                assert time.monotonic() - t0 < 5
            own.close()
