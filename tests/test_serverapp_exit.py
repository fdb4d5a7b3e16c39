"""A ServerApp whose SuperExec exits stops, whatever its main thread is waiting on.

Flower's parent monitor raises SIGINT in a thread of its own; a main thread blocked on a future
(Flower's object pushes and pulls, whose workers retry a SuperLink that is gone for ever) never
ran the handler, and the ServerApp outlived its federation, retrying."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from dpfl.launch import running
from tests.conftest import ROOT

# The ServerApp's process as Flower runs it in deployment: Flower's signal handlers and parent
# monitor, dpfl's results_closed_first, and a main thread waiting on a transfer that never ends
SERVERAPP = textwrap.dedent("""
    import concurrent.futures, os, sys
    from flwr.supercore.app_utils import start_parent_process_monitor
    from flwr.supercore.exit import register_signal_handlers
    from flwr.supercore.telemetry import EventType
    from dpfl.server.app import results_closed_first

    register_signal_handlers(event_type=EventType.FLWR_SERVERAPP_RUN_LEAVE,
                             exit_message="Task stopped by user.")
    start_parent_process_monitor(os.getppid())
    never = concurrent.futures.Future()
    with results_closed_first(strategy=None):
        print("waiting", flush=True)
        for _ in concurrent.futures.as_completed([never]):
            pass
""")

# Its SuperExec: starts it, says its PID, and exits once it waits
SUPEREXEC = textwrap.dedent("""
    import subprocess, sys
    app = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                           stderr=open(sys.argv[2], "w"), text=True)
    print(app.pid, flush=True)
    assert app.stdout.readline() == "waiting\\n"
""")


def test_a_serverapp_waiting_on_a_transfer_stops_when_its_superexec_exits(tmp_path):
    log = tmp_path / "serverapp.log"
    superexec = subprocess.run([sys.executable, "-c", SUPEREXEC, SERVERAPP, str(log)], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
    assert superexec.returncode == 0, superexec.stderr
    pid = int(superexec.stdout.split()[0])
    deadline = time.monotonic() + 15  # the monitor's 0.2 s, the watch's 1 s, Flower's 5 s exit
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = running(pid)
    if left:
        subprocess.run(["kill", "-9", str(pid)], check=False)
    assert not left, f"the ServerApp outlived its SuperExec: {log.read_text()[-2000:]}"
