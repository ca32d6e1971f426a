"""The package's error types: the bottom of the import graph (it imports nothing).

Every user-facing failure is one of these; :mod:`olmax.reporting` prints it as one line and exits
with the status the type carries (2 unless a subclass says otherwise).
"""

from __future__ import annotations

# The exit-status policy: every olmax command ends with one of these (olmax.reporting decides
# which), and every launcher acts on it (olmax.launch: restart the whole job, or stop for good).
EXIT_DONE = 0           # finished, or stopped as asked
EXIT_DOES_NOT_FIT = 1   # olmax plan: the step does not fit (a result on stdout, not an error)
EXIT_INPUT = 2          # a configuration or input error: a restart cannot help
EXIT_ATTENTION = 3      # the run cannot go on without a person
EXIT_RESTART = 75       # a restart may cure it (EX_TEMPFAIL): lost peers, hangs, storage
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_STOPPED = 143      # 128 + SIGTERM: stopped after saving, to be started again (a pod's)
NO_RESTART = {EXIT_INPUT: "configuration or input error", EXIT_ATTENTION: "needs a person"}


def no_restart_text() -> str:
    """``2: configuration or input error, 3: needs a person``: what the launchers print."""
    return ", ".join(f"{code}: {why}" for code, why in NO_RESTART.items())


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


class OlmaxError(RuntimeError):
    """A user-facing failure (bad input file, mismatched checkpoint, ...): one line, no traceback.

    ``exit_code`` is the command's exit status when it ends in this error (olmax.reporting): 2, a
    configuration or input error that a restart cannot help, unless a subclass (or the instance)
    says otherwise."""

    exit_code: int = EXIT_INPUT


class RestartableError(OlmaxError):
    """A failure that a restart may cure (storage, the network, a lost peer): exit status 75."""

    exit_code = EXIT_RESTART


class NeedsAttentionError(OlmaxError):
    """The run cannot go on without a person (a non-finite loss): exit status 3."""

    exit_code = EXIT_ATTENTION



__all__ = ["ConfigError", "OlmaxError", "RestartableError", "NeedsAttentionError"]
