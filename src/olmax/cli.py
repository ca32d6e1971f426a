"""The ``olmax`` command line: subcommands only; each is a thin layer over a library function.

A subcommand lives in ``olmax/commands/<name>.py`` with ``add_parser(subparsers)`` (which registers
itself and sets ``func``) and is listed in ``COMMANDS``. User errors (``ConfigError``,
``OlmaxError``, missing files) print one line and exit non-zero; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="olmax", description="OLMo 3 pre-training in JAX.")
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


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from olmax.config import ConfigError, OlmaxError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # ``key=value`` overrides may also follow the options (``RECIPE --topology X key=value``).
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
            "=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        rc = args.func(args)
    except (ConfigError, OlmaxError) as e:
        print(f"olmax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"olmax {args.command}: error: file not found: {e.filename or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"olmax {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
