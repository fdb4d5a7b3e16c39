"""Everything a launch started, found through the process tree as well as through its mark.

A launch marks the processes it starts through their environment
(:data:`dpfl.launch.LAUNCH_ENV`), which every descendant inherits, but a process can lose the
mark where ``/proc`` shows it: Ray starts its agents with an environment of its own making, and
a process title written over the environment's memory (``setproctitle``, Ray's ``ray::…``
titles) hides part of it. A :class:`Family` follows the launch's first process and samples the
process tree while the launch runs: every process once seen below it stays in the family,
whatever becomes of its parent (a SuperLink whose ``flwr run`` exited, an agent whose raylet
was killed first) and of its mark. Two launches in one process each follow their own.
"""

from __future__ import annotations

import threading
from pathlib import Path


def _table() -> dict[int, tuple[int, int]]:
    """Every live process's PID -> (its parent's PID, its start time in clock ticks since boot);
    zombies, which have exited, are not listed."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


class Family:
    """The processes below the roots it is given to :meth:`follow`, found by sampling the
    process tree every ``interval`` seconds while it is open (a ``with`` block): a process once
    seen below a member stays a member, re-parented or not, until it exits (a PID is a member
    with its start time, so a reused PID is not). A process that starts and loses its parent
    between two samples is missed (a launch's mark still finds it)."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.members: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="dpfl-family")

    def __enter__(self) -> Family:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._closed.wait(self.interval):
            self.living()

    def follow(self, pid: int) -> None:
        """Count ``pid`` and, from the next sample on, everything below it."""
        with self._lock:
            if (row := _table().get(pid)) is not None:
                self.members[pid] = row[1]

    def living(self) -> list[int]:
        """The members alive now, after a sample of the process tree."""
        table = _table()
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in table.items():
            children.setdefault(parent, []).append(pid)
        with self._lock:
            alive = [p for p, start in self.members.items() if table.get(p, (0, -1))[1] == start]
            todo = list(alive)
            while todo:
                for child in children.get(todo.pop(), []):
                    if child not in self.members or self.members[child] != table[child][1]:
                        self.members[child] = table[child][1]
                        alive.append(child)
                        todo.append(child)
        return alive
