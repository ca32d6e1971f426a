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

:func:`arm` is called by the command line before JAX is imported, so that its handler runs after
JAX's; :func:`keep_service` after ``jax.distributed.initialize``, so that its handler runs before
JAX's; :func:`record` with the command's status.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

_state: dict = {"armed": False, "status": None, "service": None}


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
    status = _state["status"]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed, or its reader gone
            pass
    logging.shutdown()
    os._exit(1 if status is None else status)
