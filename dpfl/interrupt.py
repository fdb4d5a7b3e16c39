"""SIGTERM stops dpfl as Ctrl-C does.

Ctrl-C raises :class:`KeyboardInterrupt` in the main thread, and every dpfl command stops on it
in order: a run closes its results folder (``stopped_early``), ``dpfl flower`` stops every
process its launch started, ``dpfl reproduce`` its workers, and ``dpfl`` exits with status 130.
What a scheduler, a CI timeout or ``kill`` sends is SIGTERM, whose default ends the process at
once and leaves what it started running. Inside :func:`sigterm_interrupts`, SIGTERM raises
:class:`Terminated`, a :class:`KeyboardInterrupt`, so that it takes the same path;
:func:`exit_status` gives the shell's status of either (143 for SIGTERM).

A Flower ServerApp is told to stop the other way round: its SuperExec exits, and Flower's parent
monitor raises SIGINT in a thread; :func:`wake_main_thread_when_parent_exits` makes sure the
main thread takes it.
"""

from __future__ import annotations

import os
import signal
import threading
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


def wake_main_thread_when_parent_exits(handled: threading.Event, poll: float = 0.2,
                                       again: float = 1.0) -> None:
    """Once the process that started this one has exited, send SIGINT to the main thread
    itself, every ``again`` seconds until ``handled`` is set (by the handler, or when the work
    is done).

    Flower's parent monitor (``--parent-pid``) raises SIGINT in a thread of its own when the
    SuperExec that started a ServerApp or ClientApp exits. A signal delivered to another thread
    runs its Python handler only when the main thread next executes bytecode; a main thread
    waiting on a lock or a future (Flower pushes and pulls a message's objects in a thread pool,
    whose workers retry a SuperLink that is gone for ever) never does, and the process outlives
    its federation, retrying. Sent to the main thread, the signal interrupts that wait."""
    parent, main = os.getppid(), threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        while os.getppid() == parent:
            if handled.wait(poll):
                return
        while not handled.wait(again):
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=watch, daemon=True, name="dpfl-parent-watch").start()
