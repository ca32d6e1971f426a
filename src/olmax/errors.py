"""The package's error types: the bottom of the import graph (it imports nothing).

Every user-facing failure is one of these; :mod:`olmax.reporting` prints it as one line and exits
with the status the type carries (2 unless a subclass says otherwise).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


class OlmaxError(RuntimeError):
    """A user-facing failure (bad input file, mismatched checkpoint, ...): one line, no traceback.

    ``exit_code`` is the command's exit status when it ends in this error (olmax.reporting): 2, a
    configuration or input error that a restart cannot help, unless a subclass (or the instance)
    says otherwise."""

    exit_code: int = 2


class RestartableError(OlmaxError):
    """A failure that a restart may cure (storage, the network, a lost peer): exit status 75."""

    exit_code = 75


class NeedsAttentionError(OlmaxError):
    """The run cannot go on without a person (a non-finite loss): exit status 3."""

    exit_code = 3



__all__ = ["ConfigError", "OlmaxError", "RestartableError", "NeedsAttentionError"]
