"""The one error users see: a bad run-config value, named by its key."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, options: Iterable[object]) -> str:
    """`` (did you mean 'x', 'y'?)`` for the options closest to ``name``; '' when none is."""
    close = difflib.get_close_matches(name, [str(o) for o in options], n=3)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


class ConfigError(ValueError):
    """A run-config value is unknown, of the wrong type, or out of range.

    The message names the offending ``key`` and, where the choice is from a
    set, the ``allowed`` values. The command-line entry points print it on one
    line and exit with status 2, without a traceback.
    """

    def __init__(self, key: str, problem: str, allowed: Iterable[object] | str | None = None):
        self.key = key
        self.problem = problem
        if allowed is not None and not isinstance(allowed, str):
            allowed = ", ".join(str(a) for a in allowed)
        self.allowed = allowed
        text = f"run config key '{key}': {problem}"
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
        # raised in a worker process (dpfl reproduce), it must cross back whole
        return ConfigError, (self.key, self.problem, self.allowed)


class UsageError(ValueError):
    """A bad command-line option outside the run config (e.g. ``dpfl reproduce --only``);
    printed on one line, exit status 2, like :class:`ConfigError`."""


class NonFiniteError(RuntimeError):
    """A value the server controls is not finite (inf or NaN): the model its step made, or the
    broadcast a client received. The run stops there; the command line prints one line and
    exits with status 1. A client's own non-finite values never raise (the error would reach
    the server): they are handled on the node (docs/privacy.md, "Non-finite values")."""
