"""How an ``olmax`` command's process ends when it held a multi-process job's coordination service.

Process 0 of a multi-process job runs JAX's coordination service (a gRPC server the other processes
talk to). At interpreter exit JAX shuts its client down (a barrier every process passes together)
and then destroys the service. That destruction races with the peers' last requests: now and then
gRPC's own check fails inside it (``Check failed: queue.Pop() == nullptr`` in the server's request
matcher) and aborts the process. The run itself has ended well by then (its checkpoint saved, its
last line printed), but process 0 exits by SIGABRT instead of its status, so a scheduler sees a
crash where a preemption (143) or a finished run (0) was.

An ``olmax`` command run as the process's own program therefore leaves the service to the
operating system: once the client is shut down (every process has passed the barrier, so none
needs the service any more), and every other exit handler has run (the data workers stopped, the
logs flushed), the process ends with ``os._exit`` and the status the command returned, and the
service's sockets close with it. Code that calls olmax as a library keeps JAX's own exit.

Before it ends, process 0 waits for its peers to close their connections to the service (at most
:data:`PEER_WAIT_S`): a peer that has passed the barrier still has the service's answer to its
last request in flight, and its client polls the service for errors until it is shut down. A
service that vanished under that poll is "the JAX distributed service detected fatal errors" to the
peer, which then aborts itself: the same SIGABRT, moved to the other process. The connections are
read from ``/proc`` (this process's own sockets on the service's port, less its own client's);
where there is no ``/proc``, process 0 does not wait.

:func:`arm` is called by the command line before JAX is imported, so that its handler runs after
JAX's; :func:`keep_service` after ``jax.distributed.initialize``, so that its handler runs before
JAX's; :func:`record` with the command's status.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from pathlib import Path

_state: dict = {"armed": False, "status": None, "service": None}

# How long process 0 waits for its peers to disconnect from the service before it ends anyway.
PEER_WAIT_S = 10.0


def arm() -> None:
    """Let this process end as the module notes say. Call before JAX is imported (atexit runs the
    handlers last registered first: this one must run after JAX's clean-up). Idempotent."""
    if not _state["armed"]:
        atexit.register(_leave)
        _state["armed"] = True


def record(status: int) -> None:
    """The status the process ends with when it leaves the service to the operating system."""
    _state["status"] = status


def keep_service() -> None:
    """After ``jax.distributed.initialize``: when :func:`arm` was called and this process holds
    the coordination service, JAX's exit handler will shut the client down and leave the service
    alone (taken out of JAX's state just before it runs)."""
    if _state["armed"]:
        atexit.register(_take_service)


def _take_service() -> None:
    from jax._src import distributed

    state = distributed.global_state
    if state.service is not None:
        _state["service"], state.service = state.service, None


def _leave() -> None:
    if "jax._src.distributed" in sys.modules:
        _take_service()    # (already taken when :func:`keep_service`'s handler ran)
    if _state["service"] is None:
        return
    from jax._src import distributed

    if distributed.global_state.client is not None:   # JAX was imported before arm(): its
        try:                                          # clean-up is still to come
            distributed.global_state.shutdown()       # the client only: the service is out
        except Exception as e:  # the exit goes on, as JAX's own would
            print(f"warning: distributed: shutting down: {' '.join(str(e).split())[:200]}",
                  file=sys.stderr)
    wait_for_peers(_service_port(distributed.global_state), PEER_WAIT_S)
    status = _state["status"]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed, or its reader gone
            pass
    logging.shutdown()
    os._exit(1 if status is None else status)


def _service_port(state) -> int | None:
    """The port the service listens on: JAX binds the coordinator's port unless
    ``JAX_COORDINATOR_BIND_ADDRESS`` says otherwise."""
    address = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or getattr(state, "coordinator_address", None) or ""
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def _own_sockets(proc: Path = Path("/proc")) -> set[str]:
    """The inodes of this process's sockets."""
    inodes = set()
    for fd in (proc / "self" / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:    # closed since it was listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def peers_connected(port: int, proc: Path = Path("/proc")) -> set[str] | None:
    """The remote ends (``ADDRESS:PORT`` in ``/proc/net/tcp``'s hex) of this process's established
    connections to ``port`` that its own client did not open; None where ``/proc`` cannot tell."""
    try:
        own = _own_sockets(proc)
        served, ours = set(), set()
        for table in ("tcp", "tcp6"):
            path = proc / "net" / table
            if not path.exists():
                continue
            for line in path.read_text().splitlines()[1:]:
                f = line.split()
                if len(f) < 10 or f[9] not in own or f[3] != "01":    # 01: ESTABLISHED
                    continue
                if int(f[1].rpartition(":")[2], 16) == port:
                    served.add(f[2])       # the service's end: the remote is a client
                elif int(f[2].rpartition(":")[2], 16) == port:
                    ours.add(f[1])         # this process's own client: its local end
        return served - ours
    except (OSError, ValueError):
        return None


def wait_for_peers(port: int | None, timeout: float, poll: float = 0.05) -> None:
    """Until no peer is connected to the service on ``port``, at most ``timeout`` seconds."""
    if port is None:
        return
    deadline = time.monotonic() + timeout
    while peers_connected(port) and time.monotonic() < deadline:
        time.sleep(poll)
