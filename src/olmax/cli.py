"""The ``olmax`` command line: subcommands only; each is a thin layer over a library function.

A subcommand lives in ``olmax/commands/<name>.py`` (``add_parser(subparsers)`` registers it and sets
``func``) and is listed in :data:`olmax.commands.HELP`. Only the command being run is imported (the
others are listed with their one-line help), so ``olmax COMMAND`` pays for its own libraries only:
this is where olmax defers imports for start-up time (see the README's layout section).
Every failure, a usage mistake included, prints one line and exits non-zero, with a traceback only
under ``--debug`` or ``OLMAX_DEBUG=1`` (:mod:`olmax.reporting`). ``key=value`` overrides may stand
anywhere among a command's options. Status lines and warnings of the ``olmax`` loggers go to stderr;
JAX's and libtpu's start-up warnings (transparent hugepages and the like) do not: they go to the
start-up log (:func:`olmax.reporting.route_startup_noise`), which ``--debug`` prints.
Run as a program with ``OLMAX_HOST_MALLOC=keep``, a CPU process first keeps its large host blocks
mapped between steps (:mod:`olmax.host_memory`, opt-in: faster steps, growing memory).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Sequence

import olmax
from olmax import process_exit
from olmax.commands import HELP
from olmax.host_memory import keep_host_memory_mapped
from olmax.reporting import (DEBUG_FLAG, debug_requested, quiet_libraries, route_startup_noise,
                             run_reporting)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported in one line like every other error."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        self.exit(2)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser, with the command ``argv`` names (its first word) fully built."""
    parser = Parser(prog="olmax", description="OLMo 3 pre-training in JAX.")
    parser.add_argument("--version", action="version", version=f"olmax {olmax.__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (also: OLMAX_DEBUG=1; the flag may "
                             "stand anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, text in HELP.items():
        if name == chosen:
            importlib.import_module(f"olmax.commands.{name}").add_parser(sub)
        else:
            sub.add_parser(name, help=text)
    return parser


class _StderrHandler(logging.Handler):
    """Messages of the ``olmax`` loggers, one line each, to whatever ``sys.stderr`` is now."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            print(msg if record.levelno < logging.WARNING else f"warning: {msg}", file=sys.stderr,
                  flush=True)
        except Exception:  # logging must never fail the command
            self.handleError(record)


def log_to_stderr() -> None:
    """The command line's one output channel: the ``olmax`` loggers' status lines and warnings
    go to stderr, one line each, unless the program running the command configured logging
    itself (handlers on the root logger), whose handlers then receive them. Idempotent."""
    logger = logging.getLogger("olmax")
    if logging.getLogger().handlers or any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    logger.setLevel(logging.INFO)
    logger.propagate = False   # libraries (absl, orbax) may configure the root logger later
    logger.addHandler(_StderrHandler())


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if argv is None:   # the process's own command line: OLMAX_HOST_MALLOC=keep, before any thread
        keep_host_memory_mapped()
        process_exit.arm()    # before JAX is imported (olmax.process_exit)
    log_to_stderr()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    route_startup_noise(echo=debug)     # before the command's module imports JAX
    quiet_libraries()
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:   # ``key=value`` overrides after options (``bench train R --steps 4 a.b=1``)
        takes = isinstance(getattr(args, "overrides", None), list)
        # what is not an option is an override (a malformed one is reported as such)
        unknown = [a for a in extra if not (takes and not a.startswith("-"))]
        if unknown:
            command = " ".join(filter(None, (args.command, getattr(args, "target", None))))
            option = next((a for a in unknown if a.startswith("-")), None)
            what = f"unknown option '{option}'" if option else f"unrecognized arguments: {' '.join(unknown)}"
            print(f"olmax {command}: error: {what} (see olmax {command} --help)", file=sys.stderr)
            return 2
        args.overrides.extend(extra)
    status = run_reporting(args.command, lambda: args.func(args), debug=debug)
    process_exit.record(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
