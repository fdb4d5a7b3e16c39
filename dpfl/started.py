"""Waiting, within a bound, for a federation's processes to start, and saying what failed.

``dpfl wait-for superlink CONNECTION`` and ``dpfl wait-for supernodes CONNECTION --count N``
(docs/deployment.md) poll ``flwr supernode list CONNECTION --format json`` until the
SuperLink answers, or until N SuperNodes are online, for at most ``--timeout`` seconds.
Meanwhile they watch the processes they are given (``--pid PID --log FILE``, one pair per
process, as a shell starts them with ``&`` and ``$!``): one that exits ends the wait at once,
with one line saying why it exited, read from its log (a program not on ``PATH``, a port
another process holds, Flower's exit code and what it means), and where the log is.

A SuperLink counts as up only when the answer came from it: its own log must show the request
(a port held by another server would otherwise answer for it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: what each exit code of a Flower program means, where dpfl knows better words for it
#: than Flower's own help text (``EXIT_CODE_HELP``: :mod:`dpfl.flower_internals`)
CAUSES = {
    305: "Flower exit code 305: it could not connect to the SuperLink",
    302: "Flower exit code 302: its --auth-supernode-private-key file is not an EC private key",
}

#: the SuperLink's log line for the request each poll makes (Flower 1.41)
REQUEST_SEEN = "ListNodes"

ACTIVATE = "activate the environment Flower and dpfl are installed in: source .venv/bin/activate"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z?\s+")  # uvicorn's lines begin with one


class StartFailed(RuntimeError):
    """A watched process exited, or the wait ran out of time; the message says which, why and
    where its log is (one line)."""


@dataclass(frozen=True)
class Watched:
    """A process a wait watches: what it is (``the SuperLink``), its PID and its log."""

    role: str
    pid: int
    log: Path

    def exited(self) -> bool:
        """Whether the process is gone (or a zombie its shell has not reaped yet)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, someone else's: not ours, but not gone either
            return False
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[0] == "Z"

    def text(self) -> str:
        try:
            return _ANSI.sub("", self.log.read_text(errors="replace"))
        except OSError:
            return ""

    def why_exited(self) -> str:
        """The one line for this process having exited."""
        cause, line = log_cause(self.text())
        quoted = f': "{line}"' if line else " (empty)"
        return f"{self.role} (pid {self.pid}) exited: {cause} (its log: {self.log}{quoted})"


def log_cause(text: str) -> tuple[str, str]:
    """What a log says made its process exit, in words, and the line of the log that says it
    (for Flower's exit codes: the code and Flower's own lines about it, its help text aside).
    """
    lines = [_STAMP.sub("", line.strip()) for line in text.splitlines()]
    for line in lines:
        found = re.search(r"([\w.-]+): command not found", line)
        if found:
            return f"{found.group(1)} is not on PATH ({ACTIVATE})", line
    for line in lines:
        if "address already in use" in line.lower():
            port = re.findall(r"""['"],\s*(\d+)\)""", line) or re.findall(r":(\d+)\b", line)
            which = f"port {port[-1]}" if port else "its port"
            return f"{which} is taken by another process", line
    for i, line in enumerate(lines):
        found = re.search(r"Exit Code: (\d+)", line)
        if found:
            code = int(found.group(1))
            block = []
            for more in lines[i + 1:]:
                if not more or more.startswith("For more information"):
                    break
                block.append(more)
            cause = CAUSES.get(code) or f"Flower exit code {code}: {_flower_help(code)}"
            if code == 305 and any("Failed to activate SuperNode" in b for b in block):
                cause = ("the SuperLink refused it: its public key is not registered (`flwr "
                         "supernode register KEY.pub CONNECTION`, then start it again)")
            help_text = _flower_help(code)
            said = [b for b in block if b != help_text]
            return cause, " ".join([f"Exit Code: {code}", *said])
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", line):
            return "it failed", line
    last = next((line for line in reversed(lines) if line), "")
    return "it stopped", last


def _flower_help(code: int) -> str:
    try:
        from dpfl.flower_internals import EXIT_CODE_HELP
    except ImportError:  # another Flower: the code alone
        return "see Flower's exit codes"
    return EXIT_CODE_HELP.get(code, "see Flower's exit codes")


def list_nodes(connection: str, timeout: float,
               give_up: Callable[[], bool] = lambda: False) -> dict:
    """``flwr supernode list CONNECTION --format json``, parsed (``success`` false with the
    reason when it got no answer: flwr itself exits 0 either way). Stopped early, with no
    answer, after ``timeout`` seconds or as soon as ``give_up()`` (checked twice a second)."""
    try:
        proc = subprocess.Popen(["flwr", "supernode", "list", connection, "--format", "json"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except FileNotFoundError:
        raise StartFailed(f"flwr is not on PATH ({ACTIVATE})") from None
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if give_up() or time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            return {"success": False, "error-message": f"no answer within {timeout:.0f} s"}
        time.sleep(0.5)
    out = proc.communicate()[0]
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        said = out.strip().splitlines()
        return {"success": False, "error-message": said[-1] if said else "no output"}


def _last_said(answer: dict) -> str:
    lines = [line.strip() for line in str(answer.get("error-message", "")).splitlines()]
    return next((line for line in reversed(lines) if line), "no answer")


def wait_for(what: str, connection: str, watched: Sequence[Watched], *, count: int = 0,
             timeout: float = 60, poll: Callable[..., dict] = list_nodes,
             interval: float = 1.0) -> str:
    """Wait until the SuperLink behind ``connection`` answers (``what="superlink"``) or
    ``count`` SuperNodes are online there (``what="supernodes"``); returns the line to print.
    Raises :class:`StartFailed` as soon as a ``watched`` process exits, or after ``timeout``
    seconds."""
    start = time.monotonic()
    deadline = start + timeout
    answer: dict = {}
    online = 0
    while True:
        for process in watched:
            if process.exited():
                raise StartFailed(process.why_exited())
        seen = [process.text().count(REQUEST_SEEN) for process in watched]
        answer = poll(connection, min(30.0, max(deadline - time.monotonic(), 1.0)),
                      lambda: any(process.exited() for process in watched))
        for process in watched:  # an answer while ours died was someone else's
            if process.exited():
                raise StartFailed(process.why_exited())
        took = time.monotonic() - start
        if answer.get("success"):
            if what == "superlink":
                if all(process.text().count(REQUEST_SEEN) > before
                       for process, before in zip(watched, seen)):
                    return f"the SuperLink answers at {connection} ({took:.0f} s)"
                answer = {"error-message": f"{connection} answered, but not the SuperLink "
                          f"this wait watches: another process serves its port"}
            else:
                online = sum(node.get("status") == "online" for node in answer.get("nodes", []))
                if online >= count:
                    return f"{online} SuperNodes online at {connection} ({took:.0f} s)"
        if time.monotonic() >= deadline:
            raise StartFailed(_timed_out(what, connection, watched, count, timeout, answer,
                                         online))
        time.sleep(interval)


def _timed_out(what: str, connection: str, watched: Sequence[Watched], count: int,
               timeout: float, answer: dict, online: int) -> str:
    if what == "superlink" or not answer.get("success"):
        head = (f"the SuperLink at {connection} did not answer within {timeout:g} s "
                f"(flwr supernode list: {_last_said(answer)})")
    else:
        head = f"{online} of {count} SuperNodes online at {connection} after {timeout:g} s"
    logs = [f'{p.log}: "{log_cause(p.text())[1]}"' for p in watched]
    if not logs:
        return head
    return f"{head} ({'its log' if len(logs) == 1 else 'their logs'}: {'; '.join(logs)})"
