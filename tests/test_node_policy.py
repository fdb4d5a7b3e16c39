"""Privacy against the server, enforced by the node: what a server that controls the run config,
the seed and the messages can and cannot do to a client (the real strategy and ClientApp over an
in-process grid; the nodes are real ones, with their default policy, unless a test says
``trust-server``).

Each defect an outside review reproduced has its test here, and each test fails on the code
before the fix: a server that regenerates a client's noise from the seed and removes it; a
replayed round answered with the same noise; a server asking for no noise, for exact
diagnostics, for a relation or an algorithm the node does not accept; a reply that reveals a
client's record count; a refused round whose other replies went uncharged."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Message, MessageType, RecordDict
from opacus.accountants import RDPAccountant

from dpfl.algorithms import ServerContext
from dpfl.checkpoint import Lineage
from dpfl.client.app import app as client_app
from dpfl.client.node_ledger import NodeLedger, stream_context
from dpfl.client.policy import NodeConfigError, NodePolicy, simulated
from dpfl.engine import run
from dpfl.privacy import Randomness, Release, add_noise, stds
from dpfl.problem import build_problem
from dpfl.runconfig import RunConfig
from dpfl.strategies import FederationError
from tests.inprocess_grid import as_the_server, run_flower_code_path, train_message

# a batch of a client's whole data is drawn by no randomness: the clean upload is the same
# whatever a node's noise source
BASE = {"algorithm": "dpsgd-gc", "num-partitions": 3, "num-server-rounds": 3, "seed": 11,
        "batch-size": 479, "noise-multiplier": 20.0}
TRUSTING = {"trust-server": True}  # what the grid's nodes are unless a test says otherwise


def real(tmp_path: Path, **policy) -> dict:
    """A real node's config: its default policy, its state in its own folder of the test."""
    return {"trust-server": False, "state-dir": str(tmp_path / "state"), **policy}


def nodes(tmp_path: Path, count: int, **policy) -> list[dict]:
    return [{"partition-id": i, **real(tmp_path, **policy)} for i in range(count)]


def summary_of(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


class Node:
    """One node (hosting client 0) answering the messages a test sends it, as a server would."""

    def __init__(self, values: dict, **node_config) -> None:
        as_the_server()
        self.config = RunConfig(values)
        self.problem = build_problem(self.config)
        self.context = Context(run_id=1, node_id=1,
                               node_config={"partition-id": 0, **node_config},
                               state=RecordDict(), run_config=self.config.as_dict())
        self.lineage = Lineage.fresh()  # each node serves a run of its own

    def send(self, server_round: int, x: torch.Tensor | None = None, exchange: str = "train"
             ) -> RecordDict:
        algorithm = self.problem.algorithm
        state = algorithm.init_server_state(self.problem.x0 if x is None else x)
        state = algorithm.begin_round(state, ServerContext(server_round, Randomness(0), [0], 3))
        message = train_message(algorithm.broadcast(exchange, state, server_round), exchange,
                                server_round, [0], self.lineage)
        return client_app(message, self.context).content

    def attack(self, server_round: int, exchange: str) -> RecordDict:
        """Exchange ``exchange`` labelled round ``server_round``, with the broadcast of a round
        that runs it (what a server that skips or reorders exchanges can send)."""
        algorithm = self.problem.algorithm
        legit = next(r for r in (1, 2) if exchange in
                     {e.name for e in algorithm.round_exchanges(r)})
        state = algorithm.begin_round(algorithm.init_server_state(self.problem.x0),
                                      ServerContext(legit, Randomness(0), [0], 3))
        message = train_message(algorithm.broadcast(exchange, state, legit), exchange,
                                server_round, [0], self.lineage)
        return client_app(message, self.context).content

    def upload(self, reply: RecordDict) -> torch.Tensor:
        return torch.from_numpy(reply["client.0"]["c"].numpy()).double()

    def seeded_noise(self, server_round: int, rng: Randomness) -> torch.Tensor:
        """The noise ``rng`` draws for client 0's upload of ``round``: what a server that knows
        the randomness regenerates."""
        (release,) = self.problem.releases(0)
        zeros = torch.zeros(1, self.problem.model.d)
        return add_noise(zeros, [0], stds([release]), rng=rng, server_round=server_round,
                         stream=release.stream)[0].double()

    def clean(self, server_round: int) -> torch.Tensor:
        """Client 0's un-noised upload of ``round`` at the initial model."""
        quiet = Node({**self.config.as_dict(), "noise-multiplier": 0.0}, **TRUSTING)
        return quiet.upload(quiet.send(server_round))


# ---- item 6: the server cannot strip a real node's noise ---------------------------------------

def test_a_server_that_knows_the_seed_strips_seeded_noise_but_not_a_real_nodes(tmp_path):
    """The review's attack: regenerate a client's noise from the run's seed and subtract it. On
    a node that trusts the server (simulation, seeded) it recovers the clean value; a real
    node's default (secure) noise and a keyed node's noise survive it; the keyed node's owner,
    who holds the key, can regenerate its noise."""
    values = {**BASE, "results-dir": str(tmp_path)}
    seeded = Node(values, **TRUSTING)
    clean = seeded.clean(1)
    server = Randomness(int(values["seed"]))

    def stripped(node: Node, upload: torch.Tensor, rng: Randomness) -> float:
        noise = node.seeded_noise(1, rng)
        return float((upload - noise - clean).norm() / noise.norm())

    assert stripped(seeded, seeded.upload(seeded.send(1)), server) < 1e-6
    secure = Node(values, **real(tmp_path))
    assert stripped(secure, secure.upload(secure.send(1)), server) > 0.5
    key = tmp_path / "node.key"
    keyed = Node(values, **real(tmp_path, noise="keyed", **{"noise-key": str(key)}))
    upload = keyed.upload(keyed.send(1))
    assert stripped(keyed, upload, server) > 0.5
    owner = Randomness(int(values["seed"]), key=key.read_bytes(),
                       context=stream_context(keyed.config))
    assert stripped(keyed, upload, owner) < 1e-6
    assert key.stat().st_mode & 0o777 == 0o600


def test_the_summary_says_whether_the_guarantee_holds_against_the_server(tmp_path):
    """Real nodes draw secret noise whatever the run config says (secure-noise=false): the
    run's ε holds against the server. Nodes that trust the server draw seeded noise, and the
    summary says the guarantee does not hold against it."""
    values = {**BASE, "results-dir": str(tmp_path)}
    run_flower_code_path({**values, "run-name": "real"}, nodes(tmp_path, 3))
    run_flower_code_path({**values, "run-name": "trusting"},
                         [{"partition-id": i} for i in range(3)])
    real, trusting = summary_of(tmp_path / "real"), summary_of(tmp_path / "trusting")
    assert real["privacy"]["guarantee_against_server"] is True
    assert real["privacy"]["noise"] == {"secure": 3}
    assert trusting["privacy"]["guarantee_against_server"] is False
    assert trusting["privacy"]["noise"] == {"seeded": 3}
    assert "the server knows" in trusting["privacy"]["note"]
    engine = run(RunConfig({**values, "run-name": "engine"}), echo=False)
    assert engine["privacy"] == trusting["privacy"]


def test_this_process_is_no_simulation_and_a_node_config_is_checked():
    assert not simulated()
    config = RunConfig(BASE)
    policy = NodePolicy.of({"partition-id": 0}, config)
    assert (policy.noise, policy.max_epsilon, policy.diagnostics) == ("secure", 10.0, False)
    assert "dp-fedavg-quantile" not in policy.algorithms  # central DP trusts the server
    trusting = NodePolicy.of({"trust-server": True}, config)
    assert (trusting.noise, trusting.max_epsilon, trusting.diagnostics) == ("seeded", math.inf,
                                                                            True)
    assert policy.cap_relation == "replace-one" and trusting.cap_relation is None  # the run's
    assert NodePolicy.of({"trust-server": True}, RunConfig({**BASE, "secure-noise": True})
                         ).noise == "secure"  # a run may ask for more, never for less
    for bad, key in (({"secure-noise": True}, "secure-noise"), ({"noise": "weak"}, "noise"),
                     ({"max-epsilon": -1}, "max-epsilon"), ({"relations": "swap"}, "relations"),
                     ({"algorithms": "dpsgd"}, "algorithms"), ({"diagnostics": "yes"},
                                                               "diagnostics")):
        with pytest.raises(NodeConfigError, match=f"^node config key '{key}'"):
            NodePolicy.of(bad, config)


# ---- item 7: a replayed round --------------------------------------------------------------

def test_a_node_refuses_a_replayed_round_it_would_answer_with_the_same_noise(tmp_path):
    """A server asks round 1 again, with the same model or another: a node answers each
    exchange of a run once, whatever its noise (a secure node's fresh noise would be a second
    release of the same round). A resumed run (a new segment of the run's lineage) may ask the
    rounds after its checkpoint again: with seeded or keyed noise the difference of two replies
    with the same noise would be exact, so the node refuses other inputs; a node whose state is
    back where it was before round 1 answers the same request bit for bit again and is not
    charged twice; a secure node answers with fresh noise and is charged twice."""
    values = {**BASE, "results-dir": str(tmp_path)}
    other = torch.full_like(build_problem(RunConfig(values)).x0, 0.01)
    for policy, same_noise in ((TRUSTING, True), (real(tmp_path, noise="keyed"), True),
                               (real(tmp_path / "secure"), False)):
        node = Node(values, **policy)
        first = node.send(1)
        for x in (other, None):
            refused = node.send(1, x)
            assert list(refused) == ["refused"]
            assert str(refused["refused"]["reason"]).startswith(
                "round 1, exchange 'train' repeats or precedes an exchange this run already "
                "answered")
        node.lineage = node.lineage.resumed(0)
        if same_noise:
            refused = node.send(1, other)
            assert str(refused["refused"]["reason"]).startswith(
                "replay: round 1, exchange 'train' was answered before with other inputs")
            node.lineage = node.lineage.resumed(0)
            node.context.state = RecordDict()  # its state as before round 1 (ledger on disk)
            again = node.send(1)
            assert torch.equal(node.upload(again), node.upload(first))
            assert dict(again["charged.0"]) == {"message": 1}  # round 1 once: the same release
            assert dict(node.send(2, other)["charged.0"]) == {"message": 2}  # the next is new
        else:
            again = node.send(1, other)
            assert not torch.equal(node.upload(first), node.upload(again))
            assert dict(again["charged.0"]) == {"message": 2}


# ---- item 8: the node's own policy -----------------------------------------------------------

@pytest.mark.parametrize("change, node, reason", [
    ({"noise-multiplier": 0.0}, {}, "node policy max-epsilon=10: the run's releases without "
                                    "noise (ε = ∞) would pass it"),
    ({"non-private-diagnostics": True}, {}, "node policy diagnostics=false"),
    ({"algorithm": "dp-fedavg-quantile", "clipped-count-stddev": 15.0}, {},
     "node policy algorithms: 'dp-fedavg-quantile' is not accepted"),
    ({"relation": "add-remove"}, {"relations": "replace-one"},
     "node policy relations: relation 'add-remove' is not accepted"),
    ({}, {"min-noise-multiplier": 50.0}, "node policy min-noise-multiplier=50"),
    ({"secure-aggregation": True, "distributed-noise": True}, {},
     "node policy distributed-noise=false: this node adds each client's whole noise (a share "
     "of it protects an upload only while the server follows SecAgg+); its operator allows a "
     "share with the node config key distributed-noise=true"),
], ids=["no-noise", "diagnostics", "central", "relation", "min-noise", "distributed"])
def test_a_node_refuses_what_its_policy_does_not_accept(tmp_path, caplog, change, node, reason):
    """The server sets the run config; the node's policy (its node config) decides. The run
    stops with the node's one-line reason, which the node logs too; nothing is computed."""
    values = {**BASE, **change, "results-dir": str(tmp_path), "run-name": "run"}
    with caplog.at_level(logging.WARNING, logger="dpfl"):
        with pytest.raises(FederationError) as stopped:
            run_flower_code_path(values, nodes(tmp_path, 3, **node))
    assert reason in str(stopped.value)
    assert any(reason in r.getMessage() for r in caplog.records)
    # the same request is served by a node that trusts the server (the run's own settings)
    if "min-noise-multiplier" not in node and "relations" not in node:
        run_flower_code_path({**values, "run-name": "trusting"},
                             [{"partition-id": i} for i in range(3)])


def test_a_nodes_cap_spans_every_run_it_serves_by_its_own_ledger(tmp_path):
    """A real node's ε cap is over every run it serves on its data, by its own ledger (its δ and
    accountant), whatever the run config's max-epsilon: a run calibrated for ε = 8 runs; a
    second one on the same nodes is refused as soon as it would pass the cap, and reports what
    it spent; the nodes' ledgers never pass it."""
    values = {**BASE, "noise-multiplier": -1.0, "epsilon": 8.0, "results-dir": str(tmp_path)}
    run_flower_code_path({**values, "run-name": "first"}, nodes(tmp_path, 3))
    assert summary_of(tmp_path / "first")["rounds_completed"] == 3
    run_flower_code_path({**values, "run-name": "second"}, nodes(tmp_path, 3))
    second = summary_of(tmp_path / "second")
    assert second["rounds_completed"] < 3
    assert "node policy max-epsilon=10" in second["stopped_early"]
    for c in range(3):
        ledger = NodeLedger.from_json((tmp_path / "state" / "ledger" / f"client-{c}.json")
                                      .read_text())
        assert 8.0 < ledger.epsilon("rdp", 1e-5) <= 10.0
        assert len(ledger.runs) == 2


def test_a_nodes_ledger_keeps_each_mechanism_once_whatever_the_order_of_its_releases():
    """Releases that alternate (two runs on one node, or two releases a round) are gathered by
    mechanism: the node's history does not grow with the rounds, and its ε is Opacus' ε of
    every release made."""
    ledger = NodeLedger()
    made = []
    for r in range(1, 41):
        releases = [Release(name=name, exchange="train", radius=1.0, relation="replace-one",
                            sample_rate=q, steps=1, noise_multiplier=z)
                    for name, z, q in (("a", 2.0, 0.1), ("b", 1.5, 0.05))]
        ledger.charge("run", r, releases, every=0)
        made += [(r.event[0], r.event[1], 1) for r in releases]
    assert [e[1:] for e in ledger.events] == [[2.0, 0.1, 40], [1.5, 0.05, 40]]
    opacus = RDPAccountant()
    opacus.history = made  # every release, in order (step() merges the last event only)
    assert ledger.epsilon("rdp", 1e-5) == pytest.approx(opacus.get_epsilon(1e-5), rel=1e-12)


# ---- item 2: nothing derived from the record count ----------------------------------------------

def test_a_reply_carries_nothing_derived_from_a_clients_record_count(tmp_path):
    """Two nodes whose client 0 holds 479 and 480 records: their replies differ in the noised
    upload only. (The client's own ledger used to travel in the reply, with its sample rate
    b/n: n exactly.)"""
    values = {**BASE, "results-dir": str(tmp_path)}
    one, other = Node(values, **TRUSTING), Node(values, **TRUSTING)
    ds = other.problem.dataset
    extra = torch.cat([ds.train_x, ds.test_x[:1]]), torch.cat([ds.train_y, ds.test_y[:1]])
    import dataclasses

    import numpy as np
    parts = list(other.problem.partitions)
    parts[0] = np.append(parts[0], len(ds.train_y))
    other.problem = dataclasses.replace(other.problem, dataset=dataclasses.replace(
        ds, train_x=extra[0], train_y=extra[1]), partitions=parts, _cohorts={}, _releases={})
    assert len(other.problem.cohort([0]).y) == len(one.problem.cohort([0]).y) + 1
    for server_round in (1, 2):
        ours, theirs = (reply(node, server_round) for node in (one, other))
        assert list(ours) == list(theirs)
        for name in ours:
            if name != "client.0":
                assert dict(ours[name]) == dict(theirs[name]), name


def reply(node: Node, server_round: int) -> RecordDict:
    from dpfl.client.app import reply as answer

    algorithm = node.problem.algorithm
    state = algorithm.init_server_state(node.problem.x0)
    message = train_message(algorithm.broadcast("train", state, server_round), "train",
                            server_round, [0])
    return answer(message, node.context, node.problem).content


# ---- item 3: a refused round is charged for everyone who replied --------------------------------

def test_a_refused_round_is_charged_for_every_client_that_replied(tmp_path):
    """Node 0's cap refuses round 3; node 1 answered it, and its noised reply reached the
    server: the server charges it, so that the ε it reports for client 1 is client 1's own
    (it used to miss that round)."""
    values = {**BASE, "num-server-rounds": 5, "results-dir": str(tmp_path)}
    engine = run(RunConfig({**values, "run-name": "engine"}), echo=False)
    steps = [json.loads(line)["epsilon"] for line in
             (tmp_path / "engine" / "rounds.jsonl").read_text().splitlines()]
    cap = (steps[1]["0"] + steps[2]["0"]) / 2  # passed by round 3
    grid, _ = run_flower_code_path({**values, "run-name": "flower"},
                                   [{"partition-id": 0, "max-epsilon": cap},
                                    {"partition-id": 1}, {"partition-id": 2}])
    summary = summary_of(tmp_path / "flower")
    assert summary["stopped_early"].startswith("clients [0] refused round 3: node policy "
                                               f"max-epsilon={cap:g}")
    own = NodeLedger.from_json(str(grid.contexts[2].state["dpfl.node.1"]["json"]))
    assert summary["epsilon"]["1"] == pytest.approx(own.epsilon("rdp", 1e-5), rel=1e-12)
    assert summary["epsilon"]["1"] == pytest.approx(steps[2]["1"], rel=1e-12)
    assert summary["epsilon"]["0"] == pytest.approx(steps[1]["0"], rel=1e-12)
    assert engine["rounds_completed"] == 5


# ---- second audit, finding 1: the cap holds whatever the server sends -------------------------

def test_a_capped_node_never_passes_its_cap_whatever_exchanges_a_server_sends(tmp_path):
    """The audit's attack, for every algorithm a real node accepts: a server sends each round's
    exchanges skipped (AdaptDP's ``train`` without its ``statistic``, PriSMA's ``train`` in
    round 1), out of order and repeated, to a secure node capped after about three rounds. The
    node answers only what the algorithm's round structure allows, each exchange once, and its
    ledger (of every release it made, checked before each one) never passes the cap; the cap
    does stop it."""
    from tests.test_privacy_boundary import LOCAL, base

    for case, (name, extra) in enumerate(LOCAL):
        values = {**base(name), **extra, "algorithm": name, "noise-multiplier": 2.0,
                  "results-dir": str(tmp_path)}
        probe = Node(values, **TRUSTING)
        algorithm, releases = probe.problem.algorithm, probe.problem.releases(0)
        budget = NodeLedger()
        for r in range(1, 4):
            budget.charge("probe", r, [x for x in releases if x.exchange in
                                       {e.name for e in algorithm.round_exchanges(r)}], 0)
        cap = budget.epsilon("rdp", 1e-5, relation="replace-one") * 1.001  # a real node's
        state_dir = tmp_path / f"{case}-{name}"
        node = Node(values, **real(state_dir, **{"max-epsilon": cap}))
        names = [e.name for e in algorithm.exchanges]
        reasons: set[str] = set()
        for server_round in range(1, 9):
            for exchange in [*reversed(names), *names, *names]:  # backwards, forwards, again
                reply = node.attack(server_round, exchange)
                if "refused" in reply:
                    reasons.add(str(reply["refused"]["reason"]).split(":")[0])
                path = state_dir / "state" / "ledger" / "client-0.json"
                ledger = NodeLedger.from_json(path.read_text()) if path.exists() else NodeLedger()
                assert ledger.epsilon("rdp", 1e-5, relation="replace-one") <= cap, (
                    name, server_round, exchange)
        assert ledger.events, name  # it answered rounds
        assert f"node policy max-epsilon={cap:g}" in reasons, (name, reasons)
        assert any("repeats or precedes" in r for r in reasons), (name, reasons)
        if len(names) > 1:
            assert any("skips exchange" in r or "has no exchange" in r for r in reasons), name


# ---- second audit, finding 2: no refusal depends on a record count ------------------------------

def test_a_site_is_refused_by_the_two_bounds_alone_never_by_its_record_count(tmp_path,
                                                                            monkeypatch):
    """The audit's binary search: a server varies min-client-records to learn, from which runs
    a site refuses, how many records it holds. A site's node trains under its operator's own
    bound (node config), and a run that declares another is refused by comparing the two
    values, before the data is read: the answers are the same for a site of 479 records and one
    of 478 (whose data file is not even there), and only the node's own bound is served."""
    from dpfl.client.app import hosted
    from dpfl.client.cache import node_problem
    from dpfl.cli import main
    from dpfl.wire import ClientsQuery, decode_refusal

    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path / "cache"))
    node_problem.cache_clear()
    site = tmp_path / "site.npz"  # client 2's 479 records of the split
    run_keys = {"algorithm": "dpsgd-gc", "num-partitions": 3, "seed": 2, "batch-size": 16,
                "noise-multiplier": 1.2}
    assert main(["export-partition", str(site), "-c", "num-partitions=3 seed=2",
                 "--partition-id", "2"]) == 0

    as_the_server()

    def answer(data: Path, declared: int) -> str:
        config = RunConfig({**run_keys, "min-client-records": declared})
        context = Context(run_id=1, node_id=1, state=RecordDict(), run_config=config.as_dict(),
                          node_config={"partition-ids": "2", "data-path": str(data),
                                       "min-client-records": 300, **real(tmp_path)})
        content = hosted(Message(ClientsQuery().encode(), 1, MessageType.QUERY + ".clients"),
                         context).content
        refused = decode_refusal(content)
        return "hosts [2]" if refused is None else refused.reason

    for declared in (100, 299, 301, 478, 479, 480, 1000):
        reasons = {answer(data, declared) for data in (site, tmp_path / "missing.npz")}
        assert reasons == {f"node config key 'min-client-records': the node trains under its "
                           f"own bound, 300, and the run declares {declared} (allowed: 300)"}
    assert answer(site, 300) == "hosts [2]"
    node_problem.cache_clear()
    with pytest.raises(NodeConfigError, match="^node config key 'min-client-records': a node "
                                              "with its own data"):
        NodePolicy.of({"data-path": str(site)}, RunConfig(run_keys))


# ---- second audit, finding 4: a cap under one relation ------------------------------------------

def test_a_nodes_cap_is_stated_under_its_own_relation(tmp_path):
    """The same noise costs less under add/remove than under replace-one: a node's cap must
    not mean what the server's relation makes it mean. Under the default cap-relation
    (replace-one) an add/remove release of multiplier z is charged as a replace-one release of
    z/2 (Opacus' ε of that history); a node whose cap is stated under add/remove refuses a
    replace-one run, naming the key."""
    poisson = {**BASE, "relation": "add-remove", "results-dir": str(tmp_path)}
    release = Node(poisson, **TRUSTING).problem.releases(0)[0]
    assert release.relation == "add-remove"
    ledger = NodeLedger()
    ledger.charge("run", 1, [release], every=0)
    z, q, steps = release.event
    half = NodeLedger(events=[["add-remove", z / 2, q, steps]])
    assert ledger.epsilon("rdp", 1e-5, relation="replace-one") == half.epsilon("rdp", 1e-5)
    for events, relation in (((z / 2, q, steps), "replace-one"), ((z, q, steps), "add-remove")):
        opacus = RDPAccountant()  # fewer orders than the ledger's: an upper bound, close
        opacus.history = [events]
        assert ledger.epsilon("rdp", 1e-5, relation=relation) == pytest.approx(
            opacus.get_epsilon(1e-5), rel=0.05)
    assert ledger.epsilon("rdp", 1e-5, relation="replace-one") > 2 * ledger.epsilon("rdp", 1e-5)
    node = Node(poisson, **real(tmp_path / "one", **{"max-epsilon": 100}))
    node.send(1)
    (path,) = (tmp_path / "one").glob("state/ledger/client-0.json")
    assert NodeLedger.from_json(path.read_text()).epsilon("rdp", 1e-5) == pytest.approx(
        ledger.epsilon("rdp", 1e-5), rel=1e-12)  # the same release, charged once
    capped = Node(poisson, **real(tmp_path / "capped", **{"max-epsilon": ledger.epsilon(
        "rdp", 1e-5) * 1.01}))  # enough under add/remove, not under replace-one
    assert str(capped.send(1)["refused"]["reason"]).startswith("node policy max-epsilon=")
    fixed = Node({**BASE, "results-dir": str(tmp_path)},
                 **real(tmp_path / "two", **{"cap-relation": "add-remove"}))
    assert str(fixed.send(1)["refused"]["reason"]) == (
        "node policy cap-relation=add-remove: the cap is stated under add-remove, and a "
        "replace-one release has no add-remove ε (allowed: runs under add-remove)")
    with pytest.raises(NodeConfigError, match="^node config key 'cap-relation'"):
        NodePolicy.of({"cap-relation": "swap"}, RunConfig(BASE))


def test_check_node_tells_a_sites_operator_whether_its_bound_fits_its_file(tmp_path, capsys,
                                                                           monkeypatch):
    """What the node would refuse every run for (its own bound above its records) the
    operator hears before the node starts, locally: ``dpfl check-node`` reads the file."""
    import os
    import sys

    import numpy as np

    from dpfl.cli import main

    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + "/usr/bin:/bin")
    site = tmp_path / "site.npz"
    np.savez(site, x=np.zeros((40, 3), np.float32), y=np.zeros(40, np.int64))
    config = f'partition-ids="2" data-path="{site}" state-dir="{tmp_path / "state"}"'
    assert main(["check-node", "--node-config", config + " min-client-records=40"]) == 0
    assert "ok  data file " + str(site) + ": 40 records, min-client-records=40" in \
        capsys.readouterr().out
    assert main(["check-node", "--node-config", config + " min-client-records=41"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"dpfl: error: node config key 'min-client-records': 41 exceeds the 40 records of "
        f"'{site}': the node would refuse every run (allowed: 1..40)")
    assert main(["check-node", "--node-config", config]) == 2
    assert "node config key 'min-client-records': a node with its own data" in \
        capsys.readouterr().err
