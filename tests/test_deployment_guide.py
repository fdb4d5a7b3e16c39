"""The deployment guide's waits are bounded, and a failed start says on the console what failed
and where its log is (docs/deployment.md, "When a start fails").

The recipe tests run the guide's loopback recipe (:mod:`tests.test_docs`) with one mistake
made each, as a user makes it: Flower's environment not activated, port 9092 taken, a SuperNode
started before its key is registered, a SuperNode given another file as its key. Each stops
early by design; each must end within :data:`BOUND` seconds, non-zero, with the line the guide
quotes. The unit tests check the same lines from Flower's own log text, and the wait's bound
and its watch, with no federation.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from dpfl.started import StartFailed, Watched, log_cause, wait_for
from tests.test_docs import (VENV, needs_the_checkouts_venv, ports_free, recipes, start_recipe,
                             stop_session)

#: seconds a recipe with a mistake may take to fail (its waits give up after 60 s each)
BOUND = 120

# what Flower 1.42's programs write to their logs (colours removed) when each mistake is made
NOT_REGISTERED = """INFO :      Starting Flower SuperNode
INFO:     Uvicorn running on http://127.0.0.1:9096 (Press CTRL+C to quit)
ERROR :     Exit Code: 305
Failed to initialize the connection to the SuperLink.
[code: 2004] Failed to activate SuperNode.
The SuperNode could not establish a connection to the SuperLink.

For more information, visit: <https://flower.ai/docs/framework/1.41/en/ref-exit-codes/305.html>
INFO:     Shutting down
WARNING :   Connection attempt failed, retrying in 0.69 seconds
"""
NOT_A_KEY = """INFO :      Starting Flower SuperNode
ERROR :     Exit Code: 302
Unable to parse the private key file.
Node authentication requires elliptic curve private key. Please ensure that the file path \
points to a valid private key file and try again.

For more information, visit: <https://flower.ai/docs/framework/1.41/en/ref-exit-codes/302.html>
"""
PORT_TAKEN = """INFO :      Starting the SuperLink Fleet HTTP API on 127.0.0.1:9092.
2026-12-07T04:29:30.116Z ERROR [uvicorn.error] [Errno 98] error while attempting to bind on \
address ('127.0.0.1', 9092): address already in use
2026-12-07T04:29:30.127Z INFO [uvicorn.error] Application shutdown complete.
"""


def test_a_key_not_registered_is_named_from_the_supernodes_log():
    cause, line = log_cause(NOT_REGISTERED)
    assert cause.startswith("the SuperLink refused it: its public key is not registered")
    assert line == ("Exit Code: 305 Failed to initialize the connection to the SuperLink. "
                    "[code: 2004] Failed to activate SuperNode.")


def test_a_file_that_is_no_key_is_named_from_the_supernodes_log():
    cause, line = log_cause(NOT_A_KEY)
    assert cause.startswith("Flower exit code 302: its --auth-supernode-private-key file")
    assert line == "Exit Code: 302 Unable to parse the private key file."


def test_a_taken_port_is_named_from_the_superlinks_log():
    cause, line = log_cause(PORT_TAKEN)
    assert cause == "port 9092 is taken by another process"
    assert line.startswith("ERROR [uvicorn.error] [Errno 98]") and "address already in use" in line


def test_a_program_not_on_path_is_named_from_the_shells_line():
    cause, _ = log_cause("bash: line 7: flower-superlink: command not found\n")
    assert cause.startswith("flower-superlink is not on PATH (activate")


def test_a_watched_process_that_exits_ends_the_wait_at_once(tmp_path):
    log = tmp_path / "supernode-2.log"
    log.write_text(NOT_REGISTERED)
    gone = Watched("the SuperNode", _a_finished_pid(), log)
    start = time.monotonic()
    with pytest.raises(StartFailed) as failed:
        wait_for("supernodes", "loopback", [gone], count=1, timeout=60,
                 poll=lambda *_: pytest.fail("polled after the process exited"))
    assert time.monotonic() - start < 5
    assert re.fullmatch(r'the SuperNode \(pid \d+\) exited: the SuperLink refused it: .* \(its '
                        rf'log: {re.escape(str(log))}: "Exit Code: 305 .*"\)', str(failed.value))


def test_a_wait_gives_up_after_its_timeout_with_what_it_last_saw():
    answer = {"success": True, "nodes": [{"status": "online"}, {"status": "registered"}]}
    start = time.monotonic()
    with pytest.raises(StartFailed, match=r"^1 of 2 SuperNodes online at loopback after 1 s$"):
        wait_for("supernodes", "loopback", [], count=2, timeout=1, interval=0.1,
                 poll=lambda *_: answer)
    assert time.monotonic() - start < 3
    nothing = {"success": False, "error-message": "Listing all nodes...\n\nConnection to the "
               "SuperLink is unavailable."}
    with pytest.raises(StartFailed, match=r"did not answer within 1 s \(flwr supernode list: "
                       r"Connection to the SuperLink is unavailable\.\)$"):
        wait_for("superlink", "loopback", [], timeout=1, interval=0.1, poll=lambda *_: nothing)


def test_an_answer_the_superlinks_log_does_not_show_is_not_its_answer(tmp_path):
    """Another server on the port answers; the SuperLink the wait watches never saw the
    request."""
    log = tmp_path / "superlink.log"
    log.write_text("INFO :      Starting Flower SuperLink\n")
    alive = Watched("the SuperLink", os.getpid(), log)
    with pytest.raises(StartFailed, match="answered, but not the SuperLink this wait watches"):
        wait_for("superlink", "loopback", [alive], timeout=1, interval=0.1,
                 poll=lambda *_: {"success": True, "nodes": []})

    def seen(*_) -> dict:  # the SuperLink's own log shows the request (Flower 1.42's words)
        log.write_text(log.read_text() + "INFO :      ControlServicer.ListNodes\n")
        return {"success": True, "nodes": []}

    assert wait_for("superlink", "loopback", [alive], timeout=5, poll=seen).startswith(
        "the SuperLink answers at loopback")


def _a_finished_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


# --- the recipe, with each mistake made ----------------------------------------------------

def _ends_within_the_bound(script: str, tmp_path: Path, *,
                           env: dict | None = None) -> tuple[int, str]:
    """Run ``script`` as the recipe tests do; it must end within :data:`BOUND` s; returns its
    exit status and its console output."""
    log = tmp_path / "recipe.log"
    proc = start_recipe(script, log, env)
    start = time.monotonic()
    try:
        code = proc.wait(timeout=BOUND)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {BOUND} s:\n{log.read_text()[-3000:]}")
    finally:
        stop_session(proc)
    output = log.read_text()
    print(f"ended in {time.monotonic() - start:.0f} s, status {code}:",
          output.strip().splitlines()[-1])
    return code, output


def _fails_within_the_bound(script: str, tmp_path: Path, *, env: dict | None = None) -> str:
    """:func:`_ends_within_the_bound`, with a non-zero status; returns the console output."""
    code, output = _ends_within_the_bound(script, tmp_path, env=env)
    assert code != 0, output[-3000:]
    return output


def _with(script: str, old: str, new: str) -> str:
    assert script.count(old) == 1, old
    return script.replace(old, new)


@pytest.mark.flower
@pytest.mark.serial
def test_the_recipe_not_activated_fails_at_once_on_the_console(tmp_path):
    """Without ``source .venv/bin/activate`` and with no dpfl or Flower on ``PATH``: the first
    ``dpfl`` command fails on the console, as the recipe runs (``set -e``), and the whole
    recipe pasted into a shell (no ``set -e``) also ends, every waiting command failing on the
    console instead of looping."""
    needs_the_checkouts_venv()
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).resolve() != VENV.resolve())
    if any(shutil.which(name, path=path) for name in ("dpfl", "flwr", "flower-superlink")):
        pytest.skip("dpfl or Flower is on PATH outside the checkout's environment")
    script = _with(recipes()["loopback"], "source .venv/bin/activate", "true")
    output = _fails_within_the_bound(script, tmp_path, env={"PATH": path})
    assert re.search(r"line \d+: dpfl: command not found$", output, re.M), output
    assert "flwr" not in output.split("dpfl: command not found")[0]
    # pasted, it goes on past each failure: its status is its last command's (`kill`)
    _, pasted = _ends_within_the_bound("set +e\n" + script, tmp_path, env={"PATH": path})
    assert re.search(r"line \d+: dpfl: command not found$", pasted, re.M), pasted
    assert re.search(r"line \d+: flwr: command not found$", pasted, re.M), pasted


@pytest.mark.flower
@pytest.mark.serial
def test_the_recipe_with_its_port_taken_names_the_port_and_the_log(tmp_path):
    needs_the_checkouts_venv()
    ports_free(9092, 9094, 9095, 9096)
    with socket.socket() as holder:  # another program's server on the recipe's port
        holder.bind(("127.0.0.1", 9092))
        holder.listen()
        output = _fails_within_the_bound(recipes()["loopback"], tmp_path)
    assert re.search(r"^dpfl: error: the SuperLink \(pid \d+\) exited: port 9092 is taken by "
                     r"another process \(its log: superlink\.log: \".*address already in "
                     r"use\"\)$", output, re.M), output[-3000:]


@pytest.mark.flower
@pytest.mark.serial
def test_the_recipe_with_a_key_not_registered_names_the_supernode_and_its_log(tmp_path):
    """Node 2's key left out of the registration: its SuperNode is refused (Flower's exit code
    305) while the wait for the three SuperNodes runs."""
    needs_the_checkouts_venv()
    ports_free(9092, 9094, 9095, 9096)
    script = _with(recipes()["loopback"], 'for i in 0 1 2; do flwr supernode register',
                   'for i in 0 1; do flwr supernode register')
    output = _fails_within_the_bound(script, tmp_path)
    assert re.search(r"^dpfl: error: the SuperNode \(pid \d+\) exited: the SuperLink refused "
                     r"it: its public key is not registered .* \(its log: supernode-2\.log: "
                     r"\"Exit Code: 305 .*Failed to activate SuperNode\.\"\)$", output, re.M), \
        output[-3000:]
    assert "the SuperLink answers at loopback" in output


@pytest.mark.flower
@pytest.mark.serial
def test_the_recipe_with_a_wrong_key_file_names_the_supernode_and_its_log(tmp_path):
    needs_the_checkouts_venv()
    ports_free(9092, 9094, 9095, 9096)
    script = _with(recipes()["loopback"], '--auth-supernode-private-key "certs/node-$i.key"',
                   '--auth-supernode-private-key "certs/ca.crt"')
    output = _fails_within_the_bound(script, tmp_path)
    assert re.search(r"^dpfl: error: the SuperNode \(pid \d+\) exited: Flower exit code 302: "
                     r"its --auth-supernode-private-key file is not an EC private key \(its "
                     r"log: supernode-[012]\.log: \"Exit Code: 302 Unable to parse the private "
                     r"key file\.\"\)$", output, re.M), output[-3000:]
