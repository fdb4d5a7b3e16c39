"""What a launch started is stopped even where it lost the launch's mark and its parent (Ray
starts its agents with an environment of its own making; a daemon forks twice), and only what
it started: two launches in one process each stop their own."""

from __future__ import annotations

import subprocess
import time

from dpfl.launch import running, stop_launched
from dpfl.process_family import Family

# a daemon without the mark: its parent starts it with an empty environment, says its PID and
# exits a second later, leaving it an orphan
DAEMON = "env -i sleep 300 >/dev/null 2>&1 & echo $!; sleep 1"


def _start(family: Family) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen(["sh", "-c", DAEMON], stdout=subprocess.PIPE, text=True)
    family.follow(parent.pid)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


def test_an_orphan_without_the_mark_is_still_stopped_with_its_launch():
    with Family() as family:
        parent, daemon = _start(family)
        try:
            parent.wait()
            time.sleep(0.5)
            assert daemon in family.living()  # its parent is gone, and it has no mark
            stop_launched("no-process-has-this-mark", family, settle=0.5)
            assert not running(daemon)
        finally:
            subprocess.run(["kill", "-9", str(daemon)], check=False, capture_output=True)


def test_a_launch_stops_its_own_and_leaves_another_launchs_and_earlier_processes():
    earlier = subprocess.Popen(["sleep", "300"])
    with Family() as mine, Family() as theirs:
        (_, own), (their_parent, their_daemon) = _start(mine), _start(theirs)
        try:
            their_parent.wait()
            time.sleep(0.5)
            stop_launched("no-process-has-this-mark", mine, settle=0.5)
            assert not running(own)
            assert running(their_daemon) and running(earlier.pid)
        finally:
            for pid in (own, their_daemon, earlier.pid):
                subprocess.run(["kill", "-9", str(pid)], check=False, capture_output=True)
            earlier.wait()
