"""SIGTERM stops dpfl as Ctrl-C does.

Ctrl-C raises :class:`KeyboardInterrupt` in the main thread, and every dpfl command stops on it
in order: a run closes its results folder (``stopped_early``), ``dpfl flower`` stops every
process its launch started, ``dpfl reproduce`` its workers, and ``dpfl`` exits with status 130.
What a scheduler, a CI timeout or ``kill`` sends is SIGTERM, whose default ends the process at
once and leaves what it started running. Inside :func:`sigterm_interrupts`, SIGTERM raises
:class:`Terminated`, a :class:`KeyboardInterrupt`, so that it takes the same path;
:func:`exit_status` gives the shell's status of either (143 for SIGTERM).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises :class:`KeyboardInterrupt`: whatever stops on Ctrl-C
    stops on it the same way."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside, SIGTERM raises :class:`Terminated` in the main thread; the handler before is
    restored after."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """The shell's status of a process ended by the signal behind ``interrupt``: 143 for SIGTERM
    (:class:`Terminated`), 130 for SIGINT (Ctrl-C)."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)
