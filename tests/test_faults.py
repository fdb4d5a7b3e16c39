"""Lost clients on a real federation, over the real strategy and ClientApp (in-process grid):
``min-clients`` lets the run go on without a failed node's clients or stops it with one line;
a client sent an exchange is charged whether or not its reply arrives; an offline node is not
sent anything (nor charged) and rejoins with fresh state when it comes back; a node that lost
its state is flagged; a failed exchange closes the results folder; a stalled node is given up
at round-timeout."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Error, Message, RecordDict

from dpfl.client.app import app as client_app
from dpfl.engine import run
from dpfl.runconfig import RunConfig
from dpfl.strategies import FederationError
from tests.inprocess_grid import InProcessGrid, run_flower_code_path

# a reply that never comes is given up after a second
BASE = {"algorithm": "dpsgd-gc", "num-partitions": 3, "num-server-rounds": 3, "seed": 7,
        "noise-multiplier": 1.0, "batch-size": 16, "round-timeout": 1.0}
NODES = [{"partition-id": i} for i in range(3)]


def faulty_grid(*, fail: dict[int, set[int]] | None = None,
                drop: dict[int, set[int]] | None = None,
                offline: dict[int, set[int]] | None = None) -> type[InProcessGrid]:
    """A grid whose node ``n`` fails (an error reply), computes but loses its reply (the
    ClientApp runs, the reply never arrives), or is offline, in the rounds given; an offline
    node comes back as a new node with a fresh Context (a restarted SuperNode)."""
    fail, drop, offline = fail or {}, drop or {}, offline or {}

    class Faulty(InProcessGrid):
        server_round = 0

        def get_node_ids(self):
            upcoming = self.server_round + 1  # asked before the round's messages go out
            ids = []
            for node, context in list(self.contexts.items()):
                home = context.node_config["partition-id"] + 1
                rounds = offline.get(home, set())
                if upcoming in rounds:
                    continue
                if rounds and upcoming > max(rounds) and node == home:
                    # back after being offline: a new SuperNode, with an empty Context.state
                    node = 100 + home
                    self.contexts[node] = Context(run_id=1, node_id=node,
                                                  node_config=context.node_config,
                                                  state=RecordDict(),
                                                  run_config=context.run_config)
                    del self.contexts[home]
                ids.append(node)
            return ids

        def send_and_receive(self, messages, *, timeout=None):
            replies = []
            for message in messages:
                node = message.metadata.dst_node_id
                if message.metadata.message_type == "train":
                    self.server_round = int(message.content["config"]["round"])
                home = self.contexts[node].node_config["partition-id"] + 1
                if message.metadata.message_type == "train" \
                        and self.server_round in fail.get(home, set()):
                    replies.append(Message(error=Error(code=0, reason="ClientApp crashed"),
                                           reply_to=message))
                    continue
                reply = self.app(message, self.contexts[node])
                if message.metadata.message_type == "train" \
                        and self.server_round in drop.get(home, set()):
                    continue
                replies.append(reply)
            return replies

    return Faulty


def _rounds(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in
            (tmp_path / name / "rounds.jsonl").read_text().splitlines()]


def _summary(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / name / "summary.json").read_text())


def test_a_lost_reply_stops_the_run_by_default_and_keeps_the_last_complete_round(tmp_path):
    values = {**BASE, "results-dir": str(tmp_path)}
    with pytest.raises(FederationError) as stopped:
        run_flower_code_path({**values, "run-name": "flower"}, NODES,
                             grid_class=faulty_grid(fail={3: {2}}))
    message = str(stopped.value)
    assert "\n" not in message
    assert "round 2, exchange 'train': 2 of 3 participants replied and min-clients=0 needs 3" \
        in message and "clients [2]: node 3: ClientApp crashed" in message
    summary = _summary(tmp_path, "flower")
    assert summary["rounds_completed"] == 1 and summary["stopped_early"].startswith("min-clients")
    # the model is round 1's, as the engine gives it
    run(RunConfig({**values, "num-server-rounds": 1, "run-name": "engine"}), echo=False)
    flower = torch.load(tmp_path / "flower" / "model.pt")
    engine = torch.load(tmp_path / "engine" / "model.pt")
    assert all(torch.equal(flower[k], engine[k]) for k in engine)
    # every client was sent round 2: every ledger holds two rounds
    assert len(set(summary["epsilon"].values())) == 1
    assert summary["epsilon"]["0"] > _summary(tmp_path, "engine")["epsilon"]["0"]


def test_min_clients_goes_on_without_a_lost_reply_and_charges_it(tmp_path):
    values = {**BASE, "results-dir": str(tmp_path), "min-clients": 2}
    run_flower_code_path({**values, "run-name": "flower"}, NODES,
                         grid_class=faulty_grid(drop={3: {2, 3}}))
    rounds = _rounds(tmp_path, "flower")
    assert [r["participants"] for r in rounds] == [3, 2, 2]
    assert [r.get("lost_clients") for r in rounds] == [None, [2], [2]]
    assert rounds[1]["uplink_bytes"] * 3 == rounds[0]["uplink_bytes"] * 2
    assert rounds[1]["downlink_bytes"] == rounds[0]["downlink_bytes"]
    # client 2 computed, noised and sent rounds 2 and 3: charged like the others
    assert len(set(_summary(tmp_path, "flower")["epsilon"].values())) == 1
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    flower = torch.load(tmp_path / "flower" / "model.pt")
    engine = torch.load(tmp_path / "engine" / "model.pt")
    assert not all(torch.equal(flower[k], engine[k]) for k in engine)
    assert _rounds(tmp_path, "engine")[0]["test_loss"] == rounds[0]["test_loss"]


def test_an_offline_node_is_not_charged_and_rejoins_with_fresh_state(tmp_path):
    values = {**BASE, "results-dir": str(tmp_path), "min-clients": 2, "num-server-rounds": 4,
              "algorithm": "clip21-sgd2m"}
    grid_class = faulty_grid(offline={2: {2, 3}})
    grid, _ = run_flower_code_path({**values, "run-name": "flower"}, NODES,
                                   grid_class=grid_class)
    rounds = _rounds(tmp_path, "flower")
    assert [r["participants"] for r in rounds] == [3, 2, 2, 3]
    assert [r.get("lost_clients") for r in rounds] == [None, [1], [1], None]
    assert rounds[1]["downlink_bytes"] * 3 == rounds[0]["downlink_bytes"] * 2
    epsilon = _summary(tmp_path, "flower")["epsilon"]
    assert epsilon["1"] < epsilon["0"] == epsilon["2"]  # two rounds fewer
    # the node that came back is a new SuperNode: its client's ledger starts again there,
    # while the server's (the reported ε) kept all of its rounds
    assert 102 in grid.contexts and 2 not in grid.contexts
    ledger = json.loads(str(grid.contexts[102].state["dpfl.node.1"]["json"]))
    assert ledger["events"] != json.loads(str(grid.contexts[1].state["dpfl.node.0"]["json"]))[
        "events"]


def test_too_few_clients_online_stops_with_the_reason(tmp_path):
    values = {**BASE, "results-dir": str(tmp_path), "min-clients": 3}
    with pytest.raises(FederationError, match=r"round 2, exchange 'train': 2 of 3 participants "
                       r"replied and min-clients=3 needs 3 \(clients \[1\]: node 2 offline\)"):
        run_flower_code_path({**values, "run-name": "flower"}, NODES,
                             grid_class=faulty_grid(offline={2: {2}}))
    summary = _summary(tmp_path, "flower")
    # client 1 was never sent round 2: one round fewer in its ledger
    assert summary["epsilon"]["1"] < summary["epsilon"]["0"]


def test_a_client_whose_state_is_wiped_mid_run_is_flagged_once(tmp_path):
    """Node 2's Context.state wiped before round 3 (a node that lost its state under the same
    id): its client's own ledger restarts, the server's keeps every round and stays the
    reported ε, and the run warns once about that client."""

    class Wiping(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if messages and messages[0].metadata.message_type == "train" \
                    and int(messages[0].content["config"]["round"]) == 3:
                self.contexts[2].state = RecordDict()
            return super().send_and_receive(messages)

    values = {**BASE, "results-dir": str(tmp_path), "run-name": "flower",
              "num-server-rounds": 4}
    run_flower_code_path(values, NODES, grid_class=Wiping)
    summary = _summary(tmp_path, "flower")
    assert len(set(summary["epsilon"].values())) == 1
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    assert summary["epsilon"] == _summary(tmp_path, "engine")["epsilon"]
    flagged = [w for w in summary["warnings"] if w.startswith("client ")]
    assert len(flagged) == 1, flagged
    assert flagged[0].startswith("client 1's node reports fewer releases at round 3 than the "
                                 "server's ledger holds")


def cut_in_round_2(error: Exception | None) -> type[InProcessGrid]:
    """A grid whose exchange of round 2 is cut after two of three nodes replied: it raises
    ``error`` (a Ray actor killed), or with None, the process gets SIGINT (Flower's exit)."""

    class Cut(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if messages and messages[0].metadata.message_type == "train" \
                    and int(messages[0].content["config"]["round"]) == 2:
                super().send_and_receive(messages[:2])
                if error is not None:
                    raise error
                signal.raise_signal(signal.SIGINT)
            return super().send_and_receive(messages)

    return Cut


def test_a_transport_failure_mid_exchange_closes_the_results_and_charges_the_round(tmp_path):
    """The exchange of round 2 fails after two of three nodes replied (a Ray actor killed
    mid-run): the results folder is closed with round 1's model and the reason, and every
    client the exchange was addressed to is charged for it."""

    values = {**BASE, "results-dir": str(tmp_path)}
    with pytest.raises(RuntimeError, match="the actor died"):
        run_flower_code_path({**values, "run-name": "flower"}, NODES,
                             grid_class=cut_in_round_2(RuntimeError("the actor died")))
    summary = _summary(tmp_path, "flower")
    assert summary["rounds_completed"] == 1
    assert summary["stopped_early"] == "failed in round 2: RuntimeError: the actor died"
    assert len(_rounds(tmp_path, "flower")) == 1
    run(RunConfig({**values, "num-server-rounds": 1, "run-name": "one"}), echo=False)
    flower = torch.load(tmp_path / "flower" / "model.pt")
    engine = torch.load(tmp_path / "one" / "model.pt")
    assert all(torch.equal(flower[k], engine[k]) for k in engine)
    run(RunConfig({**values, "num-server-rounds": 2, "run-name": "two"}), echo=False)
    assert summary["epsilon"] == _summary(tmp_path, "two")["epsilon"]


def test_flowers_exit_signal_waits_until_the_results_folder_is_closed(tmp_path):
    """Flower ends a ServerApp whose SuperLink went away with SIGINT, and its handler kills the
    process 5 s after it starts: the dpfl ServerApp takes the signal first (mid-exchange of
    round 2 here), closes the results folder with round 1, and only then calls Flower's handler,
    whose SystemExit goes on; the handlers are Flower's again afterwards."""
    from dpfl.server.app import main

    closed_when_flower_exited = []

    def flowers_exit(signum, _frame):
        closed_when_flower_exited.append((tmp_path / "flower" / "summary.json").exists())
        raise SystemExit(0)

    values = RunConfig({**BASE, "results-dir": str(tmp_path), "run-name": "flower"}).as_dict()
    grid = cut_in_round_2(None)(client_app, values, NODES)
    before = signal.signal(signal.SIGINT, flowers_exit)
    try:
        with pytest.raises(SystemExit):
            main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                               run_config=values))
        assert signal.getsignal(signal.SIGINT) is flowers_exit
    finally:
        signal.signal(signal.SIGINT, before)
    assert closed_when_flower_exited == [True]
    summary = _summary(tmp_path, "flower")
    assert summary["rounds_completed"] == 1 and len(_rounds(tmp_path, "flower")) == 1
    assert summary["stopped_early"] == (
        "failed in round 2: Flower ended the ServerApp (SIGINT): the SuperLink was lost or "
        "restarted, or the run was stopped")


def test_a_stalled_client_is_given_up_at_round_timeout_with_progress_lines(tmp_path,
                                                                          monkeypatch, caplog):
    """Node 3 never answers round 2: the exchange says how many replies it waits for, gives
    up after round-timeout and, with min-clients=2, goes on without client 2."""
    import logging

    from dpfl.strategies import algorithm

    monkeypatch.setattr(algorithm, "PROGRESS_EVERY", 0.3)
    caplog.set_level(logging.INFO, logger="dpfl")
    values = {**BASE, "results-dir": str(tmp_path), "run-name": "flower", "min-clients": 2,
              "round-timeout": 1.5, "num-server-rounds": 2}
    start = time.monotonic()
    run_flower_code_path(values, NODES, grid_class=faulty_grid(drop={3: {2}}))
    assert time.monotonic() - start >= 1.5
    waiting = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert waiting and waiting[0].startswith(
        "round 2, exchange 'train': waiting for 1 of 3 replies (")
    assert waiting[0].endswith("s; round-timeout=1.5 s an exchange)")
    assert [r.get("lost_clients") for r in _rounds(tmp_path, "flower")] == [None, [2]]
    assert any("clients [2]: node 3: no reply within round-timeout=1.5 s" in m
               for m in caplog.messages)


def test_a_staged_exchange_counts_its_wait_from_the_exchange_start(monkeypatch):
    """A secure-aggregation exchange waits in several SecAgg+ stages: each line names its
    stage and counts the seconds from the exchange's start (it used to say "30 s" at every
    stage)."""
    from types import SimpleNamespace

    from dpfl.strategies import algorithm
    from dpfl.strategies.algorithm import FlowerTransport

    monkeypatch.setattr(algorithm, "PROGRESS_EVERY", 0.1)
    said: list[str] = []
    strategy = SimpleNamespace(round_timeout=0.25, stopping=None, say=said.append)
    silent = SimpleNamespace(push_messages=lambda messages: ["m1"],
                             pull_messages=lambda ids: [])
    transport = FlowerTransport(strategy, silent)
    began = time.monotonic() - 60  # the exchange's earlier stages took a minute
    assert transport.wait(["request"], "round 2, exchange 'train', SecAgg+ stage 3",
                          since=began) == []
    assert said and said[0].startswith("round 2, exchange 'train', SecAgg+ stage 3: waiting "
                                       "for 1 of 1 replies (60 s; round-timeout=0.25 s a stage)")
