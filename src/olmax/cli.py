"""The ``olmax`` command line: subcommands only; each is a thin layer over a library function.

A subcommand lives in ``olmax/commands/<name>.py`` with ``add_parser(subparsers)`` (which registers
itself and sets ``func``) and is listed in ``COMMANDS``. Every failure, a usage mistake included,
prints one line and exits non-zero, with a traceback only under ``--debug`` or ``OLMAX_DEBUG=1``
(:mod:`olmax.reporting`). ``key=value`` overrides may stand anywhere among a command's options.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

COMMANDS = [
    "quickstart",
    "convert",
    "parity",
    "tokenize",
    "data",
    "train",
    "eval",
    "curves",
    "bench",
    "launch",
    "plan",
]


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported in one line like every other error."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        self.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="olmax", description="OLMo 3 pre-training in JAX.")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (also: OLMAX_DEBUG=1; the flag may "
                             "stand anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"olmax.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"olmax.commands.{name}":
                continue  # not built yet
            raise
        mod.add_parser(sub)
    return parser


def _is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-")


class _StderrHandler(logging.Handler):
    """Messages of the ``olmax`` loggers, one line each, to whatever ``sys.stderr`` is now."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            print(msg if record.levelno < logging.WARNING else f"warning: {msg}", file=sys.stderr,
                  flush=True)
        except Exception:  # noqa: BLE001 - logging must never fail the command
            self.handleError(record)


def log_to_stderr() -> None:
    """The command line's one output channel for status lines and warnings (idempotent)."""
    logger = logging.getLogger("olmax")
    logger.setLevel(logging.INFO)
    logger.propagate = False   # libraries (absl, orbax) may configure the root logger too
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    log_to_stderr()
    from olmax.reporting import DEBUG_FLAG, debug_requested, quiet_libraries, run_reporting

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    quiet_libraries()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # ``key=value`` overrides after options (``bench train R --steps 4 a.b=1``)
        takes = isinstance(getattr(args, "overrides", None), list)
        unknown = [a for a in extra if not (takes and _is_override(a))]
        if unknown:
            print(f"olmax {args.command}: error: unrecognized arguments: {' '.join(unknown)} "
                  f"(see olmax {args.command} --help)", file=sys.stderr)
            return 2
        args.overrides.extend(extra)
    return run_reporting(args.command, lambda: args.func(args), debug=debug)


if __name__ == "__main__":
    sys.exit(main())
