"""A ``dpfl`` command stopped from outside, as a user, a scheduler or a CI timeout stops it:
Ctrl-C (SIGINT to the terminal's process group) or ``kill`` (SIGTERM). Every process the
command starts carries a mark in its environment, so that what it leaves running is seen (and
then killed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import pytest

from dpfl.launch import _cmdlines, marked, send
from tests.conftest import ROOT

#: How a command is stopped, and the exit status it then gives: Ctrl-C, and SIGTERM to dpfl's
#: process alone (``kill PID``; what a scheduler or a CI timeout sends): (signal, to the
#: process group, status)
STOPS = [pytest.param(signal.SIGINT, True, 130, id="ctrl-c"),
         pytest.param(signal.SIGTERM, False, 143, id="sigterm")]
#: SIGTERM to the whole process group (``kill -TERM -PGID``, a CI runner ending a job)
SIGTERM_TO_GROUP = pytest.param(signal.SIGTERM, True, 143, id="sigterm-group")

MARK = "DPFL_TEST_MARK"


@dataclass
class StoppedCommand:
    """An interrupted command: its exit status, its output, the seconds from the signal to its
    exit, and the processes it started (itself included) that were still running 30 s after
    it exited."""

    code: int
    out: str
    err: str
    seconds: float
    left: list[str]

    def check(self, status: int) -> None:
        """It exited with ``status`` after one line, without a traceback, and left nothing
        running."""
        assert self.code == status, self.err[-3000:]
        assert "Traceback" not in self.out + self.err, self.err[-3000:]
        assert self.err.strip().splitlines()[-1] == "dpfl: interrupted"
        assert self.left == [], self.left


def round_done(n: int) -> Callable[[str], bool]:
    """Whether a run's output shows round ``n`` done."""
    return lambda out: re.search(rf"^round +{n}/", out, re.M) is not None


def lingering(token: str, wait: float = 30.0) -> list[str]:
    """The processes marked with ``token`` still running ``wait`` seconds on (at most), as
    ``PID COMMAND``; they are killed."""
    deadline = time.monotonic() + wait
    while (left := marked(MARK, token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    commands = _cmdlines()
    send(left, signal.SIGKILL)
    return [f"{pid} {commands.get(pid, '?')}" for pid in left]


def _collect(pipe: IO[str], lines: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: lines.extend(iter(pipe.readline, "")))
    thread.start()
    return thread


def interrupted(command: list[str], ready: Callable[[str], bool], signum: int,
                group: bool) -> StoppedCommand:
    """Start ``python -m dpfl COMMAND`` in a session of its own and send it ``signum`` (to its
    process group where ``group``, as a terminal's Ctrl-C does; else to its process alone) once
    ``ready(what it printed so far)``."""
    token = uuid.uuid4().hex
    # as from a terminal: SIGINT handled by default, even where the suite itself was started in
    # the background of a script (which starts it, and what it starts, with SIGINT ignored)
    proc = subprocess.Popen([sys.executable, "-m", "dpfl", *command], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, MARK: token},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None and proc.stderr is not None
    out: list[str] = []
    err: list[str] = []
    readers = [_collect(proc.stdout, out), _collect(proc.stderr, err)]
    try:
        deadline = time.monotonic() + 300
        while not ready("".join(out)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(out + err)
            time.sleep(0.2)
        (os.killpg if group else os.kill)(proc.pid, signum)
        sent = time.monotonic()
        proc.wait(timeout=300)
        seconds = time.monotonic() - sent
    finally:
        left = lingering(token)
        for reader in readers:
            reader.join()
    return StoppedCommand(proc.returncode, "".join(out), "".join(err), seconds, left)
