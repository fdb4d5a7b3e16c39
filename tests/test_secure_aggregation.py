"""Secure aggregation over Flower (in-process grid, the real strategy and ClientApp, Flower's
own SecAgg+ workflow stages and mod): the engine's model bit for bit, cohort nodes included;
what a node sends; a node lost in each stage; a malformed share; a refusal; too few survivors
for distributed noise, refused by the server and by each node on its own."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Error, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from dpfl.engine import run
from dpfl.rounds.transport import ClientRefused
from dpfl.runconfig import RunConfig
from dpfl.strategies import FederationError
from tests.inprocess_grid import InProcessGrid, run_flower_code_path, train_message

BASE = {"algorithm": "clip21-sgd2m", "num-partitions": 5, "num-server-rounds": 3, "seed": 2,
        "secure-aggregation": True, "round-timeout": 1.0}
# cohort nodes: 2, 1 and 2 clients
NODES = [{"partition-ids": "0,1"}, {"partition-ids": "2"}, {"partition-ids": "3,4"}]


def stage(message: Message) -> str | None:
    """The SecAgg+ stage a message to a node is in (None: not a SecAgg+ message)."""
    configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
    return None if configs is None else str(configs.get("stage"))


class Answering(InProcessGrid):
    """An in-process grid whose ClientApp errors come back as error replies, as a SuperNode
    sends them (the in-process grid raises them in the server)."""

    def deliver(self, message: Message) -> Message:
        try:
            return self.app(copy.deepcopy(message), self.contexts[message.metadata.dst_node_id])
        except Exception as error:  # noqa: BLE001 - what Flower's runtime does
            return Message(Error(code=0, reason=f"{type(error).__name__}: {error}"),
                           reply_to=message)

    def send_and_receive(self, messages, *, timeout=None):
        return [self.deliver(m) for m in messages]


def faulty(*, lose: dict[str, int] | None = None,
           tamper: str | None = None) -> type[InProcessGrid]:
    """A grid whose node ``lose[stage]`` never answers that stage in round 2 (its SuperNode
    went away mid-exchange, and came back for round 3), and, with ``tamper`` = 'share', whose
    node 1 sends malformed encrypted shares in round 2's share-keys stage."""
    lose = lose or {}

    class Faulty(Answering):
        def send_and_receive(self, messages, *, timeout=None):
            replies = []
            for message in messages:
                node, now = message.metadata.dst_node_id, stage(message)
                second = now is not None and message.metadata.group_id == "2"  # round 2
                reply = self.deliver(message)
                if second and lose.get(now) == node:
                    continue
                if second and tamper == "share" and now == "share_keys" and node == 1:
                    configs = reply.content.config_records[RECORD_KEY_CONFIGS]
                    reply.content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(
                        {**configs, "ctxts": [b"not a ciphertext" for _ in configs["ctxts"]]})
                replies.append(reply)
            return replies

    return Faulty


def _summary(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / name / "summary.json").read_text())


def _rounds(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in
            (tmp_path / name / "rounds.jsonl").read_text().splitlines()]


def _models_equal(tmp_path: Path, a: str, b: str) -> bool:
    one, two = (torch.load(tmp_path / n / "model.pt") for n in (a, b))
    return all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.parametrize("distributed", [False, True])
def test_secagg_plus_over_cohort_nodes_equals_the_engine_bitwise(tmp_path, distributed):
    """Flower's four stages for every exchange; the nodes' masked integer sums unmasked to the
    engine's secure sums: the same model and rounds, bit for bit (with distributed noise, at
    the n_s a node can count: its own clients and one a node)."""
    values = {**BASE, "results-dir": str(tmp_path)}
    if distributed:
        values.update({"distributed-noise": True, "min-survivors": 3})
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"}, NODES)
    assert _models_equal(tmp_path, "engine", "flower")
    for e, f in zip(_rounds(tmp_path, "engine"), _rounds(tmp_path, "flower"), strict=True):
        e.pop("seconds"), f.pop("seconds")
        assert e == f
    summary = _summary(tmp_path, "flower")["secure_aggregation"]
    assert summary["sum"].startswith("Flower's SecAgg+")
    assert ("distributed_noise" in summary) is distributed


def test_secagg_plus_with_client_sampling_equals_the_engine_bitwise(tmp_path):
    """3 of 5 single-client nodes sampled a round: each exchange's key exchange among the
    sampled nodes only, n_s = the 3 participants; the engine's model, bit for bit."""
    values = {**BASE, "results-dir": str(tmp_path), "fraction-train": 0.6,
              "distributed-noise": True}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": i} for i in range(5)])
    assert _models_equal(tmp_path, "engine", "flower")
    assert [r["participants"] for r in _rounds(tmp_path, "flower")] == [3, 3, 3]
    assert _summary(tmp_path, "flower")["secure_aggregation"]["distributed_noise"][
        "min_survivors"] == 3


def test_a_node_sends_only_its_masked_sum_and_its_counts(tmp_path):
    """The reply to the collect stage: the fit result's arrays cleared by Flower's mod, the
    masked vector, the node's counts and noise source; nothing per client (no upload, no
    record count: the fit result's example count is the constant 1)."""
    seen: list[Message] = []

    class Recording(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            replies = super().send_and_receive(messages, timeout=timeout)
            seen.extend(r for m, r in zip(messages, replies, strict=True)
                        if stage(m) == "collect_masked_vectors")
            return replies

    run_flower_code_path({**BASE, "num-server-rounds": 1, "results-dir": str(tmp_path)},
                         NODES, grid_class=Recording)
    assert len(seen) == 3
    for reply in seen:
        content = reply.content
        assert set(content.array_records) == {"fitres.parameters"}
        assert not content.array_records["fitres.parameters"]  # cleared by the mod
        assert dict(content.metric_records["fitres.num_examples"]) == {"num_examples": 1}
        counts = set(content.config_records) - {"fitres.metrics", "fitres.status", "node",
                                                RECORD_KEY_CONFIGS}
        assert counts and all(k.startswith("charged.") for k in counts)  # in clear
        assert set(content.config_records[RECORD_KEY_CONFIGS]) == {"masked_params"}


@pytest.mark.parametrize("where", ["setup", "share_keys"])
def test_a_node_lost_in_the_key_exchange_starts_it_again_without_it(tmp_path, where):
    """Nothing of a node's data has left it before the collect stage: the exchange starts over
    with the nodes that answered, and the lost node's clients are unreached (not charged)."""
    values = {**BASE, "results-dir": str(tmp_path), "min-clients": 3, "run-name": "flower"}
    run_flower_code_path(values, NODES, grid_class=faulty(lose={where: 3}))
    rounds = _rounds(tmp_path, "flower")
    assert [r.get("lost_clients") for r in rounds] == [None, [3, 4], None]
    assert [r["participants"] for r in rounds] == [5, 3, 5]
    epsilon = _summary(tmp_path, "flower")["epsilon"]
    assert epsilon["3"] < epsilon["0"] == epsilon["2"]


@pytest.mark.parametrize("where,lost", [("collect_masked_vectors", [3, 4]),
                                        ("unmask", None)])
def test_a_node_lost_after_the_key_exchange_is_unmasked_by_flower(tmp_path, where, lost):
    """Lost at collect: its masks are removed with the others' shares (Flower's dropout path)
    and the sum holds the other nodes' clients; lost at unmask: its masked vector is in the
    sum, its masks reconstructed from a majority of shares: nothing lost."""
    values = {**BASE, "results-dir": str(tmp_path), "min-clients": 3}
    run_flower_code_path({**values, "run-name": "flower"}, NODES,
                         grid_class=faulty(lose={where: 3}))
    rounds = _rounds(tmp_path, "flower")
    assert [r.get("lost_clients") for r in rounds] == [None, lost, None]
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    assert _models_equal(tmp_path, "engine", "flower") is (lost is None)


def test_a_malformed_share_loses_the_node_that_cannot_decrypt_it(tmp_path):
    """Node 1's encrypted shares are garbage in round 2: each node that receives one fails to
    decrypt it at the collect stage, so only node 1's vector arrives; with fewer than two nodes
    (SecAgg+'s threshold) nothing is unmasked and the run stops in one line."""
    values = {**BASE, "results-dir": str(tmp_path), "min-clients": 1, "run-name": "flower"}
    with pytest.raises(FederationError) as stopped:
        run_flower_code_path(values, NODES, grid_class=faulty(tamper="share"))
    assert "nothing was unmasked" in str(stopped.value) and "\n" not in str(stopped.value)
    summary = _summary(tmp_path, "flower")
    assert summary["rounds_completed"] == 1
    # every client was sent round 2 and node 1's masked sum left it: every client is charged
    # two rounds (the ledger never undercounts what may have left a node)
    run(RunConfig({**values, "num-server-rounds": 1, "calibration-rounds": 3, "run-name": "one"}),
        echo=False)
    assert len(set(summary["epsilon"].values())) == 1
    assert summary["epsilon"]["0"] > _summary(tmp_path, "one")["epsilon"]["0"]


def test_too_few_survivors_for_the_noise_stops_before_anything_is_unmasked(tmp_path):
    """min-survivors above what a node can count (its own clients and one a node) is refused
    by the server before the key exchange; a node asked to unmask such a sum refuses on its own
    (the server is not trusted to check)."""
    values = {**BASE, "results-dir": str(tmp_path), "distributed-noise": True,
              "run-name": "flower"}  # n_s = 5, a node with 1 client counts 1 + 2
    with pytest.raises(FederationError, match=r"min-survivors=5.*count only 3"):
        run_flower_code_path(values, NODES)


def test_a_node_refuses_to_unmask_a_sum_with_too_few_shares(tmp_path, monkeypatch):
    """The rule of a node that does not trust the server, with the server's check switched
    off: no node sends its shares, SecAgg+ cannot unmask, nothing is released."""
    import dpfl.strategies.algorithm as algorithm
    import dpfl.strategies.secure as secure

    real = secure.secure_exchange
    monkeypatch.setattr(algorithm, "secure_exchange", lambda problem, grid, wait, requests,
                        survivors, **_: real(problem, grid, wait, requests, 0))
    own = [{**n, "trust-server": False, "noise": "seeded", "distributed-noise": True,
            "max-epsilon": "inf", "state-dir": str(tmp_path / f"state-{i}")}
           for i, n in enumerate(NODES)]
    values = {**BASE, "results-dir": str(tmp_path), "distributed-noise": True,
              "run-name": "flower"}
    with pytest.raises(FederationError, match="could not unmask"):
        run_flower_code_path(values, own, grid_class=Answering)


def test_in_a_simulation_the_server_counts_the_survivors_for_trusting_nodes(tmp_path):
    """Flower's simulation (its grid) and nodes that trust the server: cohort nodes with the
    default n_s (every participant) run, the server's exact count standing for theirs; the
    engine's model bit for bit."""

    class InMemoryGrid(InProcessGrid):  # the name Flower's simulation grid has
        pass

    values = {**BASE, "results-dir": str(tmp_path), "distributed-noise": True}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"}, NODES, grid_class=InMemoryGrid)
    assert _models_equal(tmp_path, "engine", "flower")
    assert _summary(tmp_path, "flower")["secure_aggregation"]["distributed_noise"][
        "min_survivors"] == 5


def test_a_refusing_node_stops_the_exchange_before_the_unmasking(tmp_path):
    """A node whose cap refuses the round answers the collect stage with its reason (in the fit
    shape the mod needs): the server stops with it and unmasks nothing."""
    nodes = [{**n, "trust-server": False, "noise": "seeded", "max-epsilon": 0.01,
              "state-dir": str(tmp_path / f"state-{i}")} if i == 1 else n
             for i, n in enumerate(NODES)]
    run_flower_code_path({**BASE, "results-dir": str(tmp_path), "run-name": "flower"}, nodes)
    summary = _summary(tmp_path, "flower")
    assert summary["rounds_completed"] == 0
    assert "refused round 1" in summary["stopped_early"] and "max-epsilon" in \
        summary["stopped_early"]
    # the other nodes' masked sums reached the server: their clients are charged
    assert set(summary["epsilon"]) == {"0", "1", "3", "4"}


def test_a_node_adds_a_noise_share_only_under_secagg_plus(tmp_path):
    """Distributed noise asked in a plain train request (a server that skips SecAgg+ would read
    the uploads): the node refuses."""
    from dpfl.client.app import app as client_app
    from dpfl.problem import cached_problem
    from dpfl.wire import TrainReply

    config = RunConfig({**BASE, "distributed-noise": True, "results-dir": str(tmp_path)})
    grid = InProcessGrid(client_app, config.as_dict(), NODES)
    problem = cached_problem(tuple(sorted(config.as_dict().items())))
    algorithm = problem.algorithm
    message = train_message(algorithm.broadcast("train", algorithm.init_server_state(
        problem.x0), 1), "train", 1, [2], node=2)
    reply = grid.send_and_receive([message])[0]
    refused = TrainReply.decode(reply.content)
    assert isinstance(refused, ClientRefused) and "distributed-noise" in refused.reason
