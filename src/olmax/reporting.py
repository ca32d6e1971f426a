"""How the command line reports failures: one line per error, a traceback only on request.

Every failure of an ``olmax`` command ends in one line on stderr, ``olmax COMMAND: error: ...``,
and a non-zero exit status that says whether running the command again can help (schedulers and
the generated jobs of ``olmax launch`` act on it; :func:`exit_code` decides it):

====  ===================================================================================
0     finished, or stopped as asked (a SIGTERM stop; ``olmax train --exit-code-on-stop``
      may choose another code for that)
2     a configuration or input error: a restart cannot help (a bad key or value, a missing or
      malformed input file, a run directory another trainer holds, a program that does not fit
      the device's memory)
3     the run cannot go on without a person (:class:`~olmax.errors.NeedsAttentionError`: a
      non-finite loss)
75    a failure that a restart may cure (:class:`~olmax.errors.RestartableError`, and
      everything that is not one of the above: peers that did not come or were lost, a hang
      caught by the watchdog, storage errors, remote reads that ran out of retries, errors of
      the runtime)
130   interrupted (Ctrl-C)
====  ===================================================================================

The lines:

- olmax's own errors (:class:`~olmax.errors.ConfigError`, :class:`~olmax.errors.OlmaxError`) print
  their message, which names the key or file;
- any ``OSError`` prints its reason and the file it concerns (``cannot read FILE: Permission
  denied``);
- an out-of-memory error of XLA or a device runtime (``RESOURCE_EXHAUSTED``, at compile or run
  time, on any platform: :mod:`olmax.device_memory`) is a configuration error: the program does
  not fit the device (exit status 2, never a restart); the commands that run a step name the step
  and the settings that lower its memory themselves;
- any other ``ValueError`` (a malformed input a library rejected) prints its first line;
- anything else is a bug: one line saying so, with the exception's first line.

``--debug`` anywhere on the command line, or ``OLMAX_DEBUG=1``, prints the full traceback as well.

Library noise that used to bury these lines is filtered (:func:`quiet_libraries`): tracebacks of
``RuntimeError('Event loop is closed')`` that TensorStore callbacks raise into an event loop Orbax
has already closed (after a failed read of a corrupt checkpoint; harmless, and the fallback to the
previous checkpoint goes on); Orbax's warnings that a checkpoint item (the optimizer state, when
only parameters are read) "could not be restored" and that a directory opened for reading is read
only; and the tracebacks Orbax logs from its writer threads for an olmax error raised there (a
tensor found NaN while converting) or for a storage failure (a full disk, a bucket that stopped
answering: one traceback per thread and item), which the command reports itself, or for a save
that a newer attempt ended (it removed the save's temporary directory; the writer thread then
meets the process's exit: "cannot schedule new futures after [interpreter] shutdown"); and gcsfs's
traceback when a request of a library's (Orbax's directory operations) runs out of its retries,
which reaches olmax as that request's error; and asyncio's "Task exception was never retrieved"
traceback for a task a lost store ended: an HTTP client's writer task whose connection dropped,
or an Orbax serialization task whose write ran out of retries after a sibling's had already
failed the save (the save is reported as well)."""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
import warnings
from typing import Callable, Sequence

from olmax.device_memory import as_does_not_fit
from olmax.errors import (EXIT_ATTENTION, EXIT_DONE, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_RESTART,
                          ConfigError, OlmaxError)
from olmax.io import input_error, storage_errno

DEBUG_ENV = "OLMAX_DEBUG"
DEBUG_FLAG = "--debug"



def debug_requested(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "False")


def _first_line(text: str) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def _device_memory(e: BaseException) -> BaseException:
    """An out-of-memory error of XLA or a device runtime that no command explained in its own
    words, as :class:`~olmax.device_memory.DoesNotFit` (a configuration error: the program does not
    fit the device, and running it again cannot help); any other error unchanged."""
    return as_does_not_fit(e, "the program") or e


def describe_error(e: BaseException) -> str:
    """The one line an exception becomes (see the module docstring)."""
    e = _device_memory(e)
    if isinstance(e, (ConfigError, OlmaxError)):
        return " ".join(str(e).split("\n"))
    if isinstance(e, OSError):
        reason = e.strerror or _first_line(str(e)) or type(e).__name__
        names = [n for n in (e.filename, e.filename2) if n is not None]
        if isinstance(e, FileNotFoundError) and names:
            return f"file not found: {names[0]}"
        if names:
            return f"{reason}: {' -> '.join(map(str, names))}"
        return f"{type(e).__name__}: {reason}" if not e.strerror else reason
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text ({e.reason} at byte {e.start})"
    if isinstance(e, ValueError):
        return _first_line(str(e)) or type(e).__name__
    return (f"internal error: {type(e).__name__}: {_first_line(str(e))} (a bug in olmax; rerun "
            f"with {DEBUG_FLAG} for the traceback)")


def exit_code(e: BaseException) -> int:
    """The exit status a command that failed with ``e`` ends with (see the module docstring)."""
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    e = _device_memory(e)
    if isinstance(e, ConfigError):
        return EXIT_INPUT
    if isinstance(e, OlmaxError):
        return int(e.exit_code)
    if isinstance(e, OSError):
        return EXIT_INPUT if input_error(e) else EXIT_RESTART
    if isinstance(e, ValueError):     # a malformed input a library rejected (UnicodeDecodeError too)
        return EXIT_INPUT
    return EXIT_RESTART


def run_reporting(command: str, func: Callable[[], int | None], *, debug: bool) -> int:
    """Run ``func``; turn any exception into one line on stderr and :func:`exit_code`."""
    try:
        return int(func() or 0)
    except KeyboardInterrupt as e:
        print(f"olmax {command}: interrupted", file=sys.stderr)
        return exit_code(e)
    except Exception as e:  # the last resort: every failure becomes one line
        if debug:
            traceback.print_exc()
        print(error_line(command, e), file=sys.stderr, flush=True)
        return exit_code(e)


def error_line(command: str, e: BaseException) -> str:
    """The one line a command's failure ``e`` is reported in."""
    return f"olmax {command}: error: {describe_error(e)}"


# ----------------------------------------------------------------------------------------------
# Library noise


_ORBAX_NOISE = ("was found in the checkpoint, but could not",   # an item not asked for
                "Given directory is read only",                  # a checkpoint opened to read
                "CheckpointManagerOptions.read_only=True")


class _DropOrbaxNoise(logging.Filter):
    """Orbax's notes about reading only part of a checkpoint, and the traceback it logs from its
    writer thread for an error olmax raised there (the same error reaches the command, which
    reports it in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if any(text in msg for text in _ORBAX_NOISE):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and storage_errno(exc) is not None:
            return False      # a full disk in the writer thread: the save reports it in one line
        if exc is not None and _store_lost(exc):
            return False      # a bucket that stopped answering: so does the save
        if exc is not None and (_save_dir_removed(exc) or _after_exit(exc)):
            return False      # a save that a newer attempt ended: its run reports the takeover
        return not isinstance(exc, (ConfigError, OlmaxError))


def _save_dir_removed(exc: BaseException) -> bool:
    """A file of a save in progress whose temporary directory is gone: a newer attempt that
    took the run over removed the incomplete checkpoint (the save fails, and the run stops with
    the takeover's one line); or the save's commit, renaming that directory onto a step the newer
    attempt has committed meanwhile (refused: nothing is overwritten)."""
    if isinstance(exc, FileNotFoundError):
        return ".orbax-checkpoint-tmp" in str(exc.filename)
    return (isinstance(exc, FileExistsError) and str(exc).startswith("Cannot rename ")
            and re.search(r"\.orbax-checkpoint-tmp(-[0-9a-f]+)?\. Destination ", str(exc)) is not None)


def _after_exit(exc: BaseException) -> bool:
    """What an Orbax writer thread still running at interpreter exit meets: Python's thread
    pools take no new work once the process is exiting (after the run's one line), in the words
    of a pool already shut down or of one that meets the interpreter's own shutdown."""
    return any(_runtime_error_from(exc, exc.__traceback__, text, "submit", "concurrent")
               for text in ("cannot schedule new futures after shutdown",
                            "cannot schedule new futures after interpreter shutdown"))


def _store_lost(exc: BaseException) -> bool:
    """A bucket's requests that ran out of retries (TensorStore's words) or lost their
    connection, in Orbax's writer thread."""
    from olmax import transport

    return (any("retry attempts failed" in str(x) for x in transport.chain(exc))
            or transport.connection_trouble(exc))


class _DropLostConnectionTasks(logging.Filter):
    """asyncio's "Task exception was never retrieved" for a task that a lost store or a full disk
    ended: an HTTP client's writer task whose connection went away (aiohttp writing a request's
    body), or one of Orbax's serialization tasks left unawaited when a sibling's write failed the
    save first (out of TensorStore's retries, or out of space: ``storage_errno``). The save
    itself failed and is reported by olmax in one line; the orphaned task is not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        exc = record.exc_info[1] if record.exc_info else None
        return not (msg.startswith("Task exception was never retrieved") and exc is not None
                    and (_store_lost(exc) or storage_errno(exc) is not None))


class _DropGcsfsRetryTraceback(logging.Filter):
    """gcsfs's ``_request out of retries on exception`` traceback (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return not (record.exc_info and "out of retries on exception" in msg)


def _runtime_error_from(exc: BaseException | None, tb, text: str, function: str, library: str) -> bool:
    """Whether ``exc`` is a ``RuntimeError(text)`` raised in ``function`` of ``library`` (the
    innermost frame of ``tb``): the same words from elsewhere are not hidden."""
    if not (isinstance(exc, RuntimeError) and str(exc) == text):
        return False
    frames = traceback.extract_tb(tb) if tb is not None else []
    return bool(frames) and frames[-1].name == function and library in frames[-1].filename


def _is_closed_loop_noise(exc: BaseException | None, tb) -> bool:
    return _runtime_error_from(exc, tb, "Event loop is closed", "_check_closed", "asyncio")


# Where JAX says what it found while starting: its Cloud TPU set-up (transparent hugepages, a
# TPU_LIBRARY_PATH that does not exist) and its backends' discovery (a GPU without a CUDA jaxlib,
# a platform that failed to start). Warnings raised there, and its loggers' records below ERROR,
# are start-up noise: they go to olmax's start-up log (``startup_messages``; ``olmax train`` keeps
# it in run_info.json; ``--debug`` prints it), not to the terminal.
STARTUP_SOURCES = ("jax/_src/cloud_tpu_init.py", "jax/_src/xla_bridge.py", "jax/__init__.py")
STARTUP_LOGGERS = ("jax._src.xla_bridge", "jax._src.cloud_tpu_init")
_startup: list[str] = []
_startup_echo = False


def startup_messages() -> list[str]:
    """What JAX and libtpu said while starting in this process (see :func:`route_startup_noise`)."""
    return list(_startup)


def _startup_record(text: str) -> None:
    text = " ".join(text.split())
    if text not in _startup:
        _startup.append(text)
    if _startup_echo:
        print(f"debug: start-up: {text}", file=sys.stderr, flush=True)


class _StartupLog(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        _startup_record(f"{record.name}: {record.getMessage()}")
        return False


def route_startup_noise(echo: bool = False) -> None:
    """Send JAX's and libtpu's start-up warnings to the start-up log instead of the terminal
    (idempotent); ``echo``: print them too, marked as debug lines (``--debug``). Installed before
    JAX is imported: its Cloud TPU set-up warns at import."""
    global _startup_echo
    _startup_echo = _startup_echo or echo
    for name in STARTUP_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _StartupLog) for f in log.filters):
            log.addFilter(_StartupLog())
    previous = warnings.showwarning
    if getattr(previous, "_olmax_startup", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        where = str(filename).replace(os.sep, "/")
        if any(where.endswith(src) for src in STARTUP_SOURCES) or "/libtpu/" in where:
            _startup_record(f"{category.__name__}: {message}")
            return
        previous(message, category, filename, lineno, file, line)

    show._olmax_startup = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def quiet_libraries() -> None:
    """Install the noise filters of the module docstring (idempotent)."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _DropOrbaxNoise) for f in absl.filters):
        absl.addFilter(_DropOrbaxNoise())
    gcsfs = logging.getLogger("gcsfs")
    if not any(isinstance(f, _DropGcsfsRetryTraceback) for f in gcsfs.filters):
        gcsfs.addFilter(_DropGcsfsRetryTraceback())
    aio = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropLostConnectionTasks) for f in aio.filters):
        aio.addFilter(_DropLostConnectionTasks())
    previous = sys.unraisablehook
    if getattr(previous, "_olmax_quiet", False):
        return

    def hook(unraisable) -> None:
        if _is_closed_loop_noise(unraisable.exc_value, unraisable.exc_traceback):
            return
        previous(unraisable)

    hook._olmax_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


__all__ = ["describe_error", "run_reporting", "exit_code", "EXIT_DONE", "EXIT_INPUT",
           "EXIT_ATTENTION", "EXIT_RESTART", "quiet_libraries", "debug_requested", "DEBUG_FLAG",
           "route_startup_noise", "startup_messages"]
