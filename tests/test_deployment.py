"""Real Flower processes: a ``flower-superlink`` and ``flower-supernode`` processes hosting
cohorts of clients, driven by ``flwr run``, give the engine's model bit for bit when their
operators let them trust the server (node config ``trust-server=true``: seeded noise; PriSMA:
its first round of its own, then x^t and x^{t−1} broadcast and the noisy v_i kept in each node's
``Context.state``; AdaptDP-FedAvg: two exchanges a round; two clients per node); with their
default policy they draw secret noise and keep their own ledgers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dpfl.cli import main
from dpfl.config import format_overrides
from dpfl.engine import run
from dpfl.federation import BIN, LocalFederation, wait_for
from dpfl.federation import stop as stop_process
from dpfl.runconfig import RunConfig
from dpfl.strategies.algorithm import CONNECT_TIMEOUT

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[1]


def _federation(folder: Path) -> LocalFederation:
    """A :class:`LocalFederation` in ``folder``, its nodes' cache and ledgers there too."""
    federation = LocalFederation(folder)
    federation.env["DPFL_CACHE_DIR"] = str(folder / "cache")  # the nodes' cache (one folder)
    federation.env["DPFL_STATE_DIR"] = str(folder / "state")  # their ledgers: this test's
    return federation


@pytest.fixture
def deployment(tmp_path):
    """A :class:`LocalFederation` in ``tmp_path``: ``deployment(nodes, tls=…, database=…)``
    starts it and yields the environment for ``flwr run . local-deployment``; every process is
    stopped at the end, the test passed or not."""
    with _federation(tmp_path) as federation:
        yield federation


CASES = {
    "dpsgd-gc": {"algorithm": "dpsgd-gc", "num-partitions": 3, "num-server-rounds": 2,
                 "seed": 2},
    # client state (the momentum buffers) kept in each SuperNode's Context.state
    "clip21-sgd2m": {"algorithm": "clip21-sgd2m", "num-partitions": 4, "num-server-rounds": 2,
                     "seed": 2},
    "prisma": {"algorithm": "prisma", "num-partitions": 4, "num-server-rounds": 2,
               "batch-size": 16, "seed": 5, "gamma": 0.3, "clip-diff": 0.2,
               "learning-rate": 0.5},
    # two exchanges a round: the noisy statistic sets C_r, then K local DP-SGD steps
    "adaptdp-fedavg": {"algorithm": "adaptdp-fedavg", "dataset": "quadratic",
                       "model": "least-squares", "num-partitions": 4, "num-server-rounds": 2,
                       "batch-size": 50, "local-steps": 5, "learning-rate": 0.4, "clip": 3.0,
                       "calibration": "paper", "epsilon": 1000.0, "delta": 1e-4, "seed": 3},
    # the server's public subspace broadcast each round, client sampling, k-number uploads
    "fedpcdp": {"algorithm": "fedpcdp", "dataset-options": "num_public=40",
                "model": "logistic", "num-partitions": 4, "num-server-rounds": 2,
                "fraction-train": 0.75, "batch-size": 40, "local-steps": 3, "clip": 0.5,
                "learning-rate": 0.5, "projection-dim": 12, "noise-multiplier": 2.0,
                "momentum": 0.5, "seed": 4},
}


# one node per client: the three SuperNodes dpsgd-gc's case runs on
NODES = ["0", "1", "2"]
# nodes whose operators trust the server: the run's seeded noise, its ε and diagnostics
TRUSTING = "trust-server=true"

# two clients a node: the federation the other cases run on
COHORTS = ["0,1", "2,3"]


@pytest.fixture(scope="module")
def cohorts(tmp_path_factory):
    """The trusting SuperNodes of :data:`COHORTS`, started once for the cases that run on them
    (a SuperLink, its SuperNodes and their SuperExecs cost about a quarter of a case's CPU):
    their environment and their cache folder."""
    folder = tmp_path_factory.mktemp("cohorts")
    with _federation(folder) as federation:
        yield federation.start(COHORTS, policy=TRUSTING), folder / "cache"


def _deployed_equals_engine(tmp_path: Path, env: dict[str, str], case: dict,
                            app: Path) -> None:
    """``flwr run`` against the SuperLink, then the engine with the same config: the models
    equal bit for bit, the rounds too (but their wall times)."""
    overrides = {**case, "results-dir": str(tmp_path / "results")}
    done = subprocess.run(
        [str(BIN / "flwr"), "run", str(app), "local-deployment", "--stream", "--run-config",
         format_overrides({**overrides, "run-name": "deployed"})],
        env=env, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run(RunConfig({**overrides, "run-name": "engine"}), echo=False)
    deployed = torch.load(tmp_path / "results" / "deployed" / "model.pt")
    engine = torch.load(tmp_path / "results" / "engine" / "model.pt")
    for k in engine:
        assert torch.equal(deployed[k], engine[k]), k
    rounds = [[json.loads(line) for line in (tmp_path / "results" / name / "rounds.jsonl")
               .read_text().splitlines()] for name in ("deployed", "engine")]
    for d, e in zip(*rounds, strict=True):
        d.pop("seconds"), e.pop("seconds")
        assert d == e


# dpsgd-gc's case runs over TLS (test_tls_with_supernode_authentication); two rounds carry
# every stateful case's client state from one round into the next
@pytest.mark.xdist_group("deployment-cohorts")  # one worker starts the cohorts, once
@pytest.mark.parametrize("case", sorted(set(CASES) - {"dpsgd-gc"}))
def test_real_supernodes_equal_the_engine_bitwise(tmp_path, cohorts, app, case):
    env, cache = cohorts
    before = set((cache / "nodes").glob("data-*.pt"))
    _deployed_equals_engine(tmp_path, env, CASES[case], app)
    # each node built this run's data once, on its first message, and read it from its cache
    # after
    assert len(set((cache / "nodes").glob("data-*.pt")) - before) == len(COHORTS)


def test_a_site_with_its_own_data(tmp_path, deployment, app):
    """A node that trains on its own data file (node config ``data-path``: client 2's records,
    exported from the split) beside two nodes of the split: calibrated from the public
    ``min-client-records`` on both sides, the run equals the engine's on the split."""
    case = {**CASES["dpsgd-gc"], "min-client-records": 200}
    site = tmp_path / "site-2.npz"
    assert main(["export-partition", str(site), "-c", format_overrides(case),
                 "--partition-id", "2"]) == 0
    env = deployment.start(NODES, node_config={2: f'data-path="{site}" min-client-records=200'},
                           policy=TRUSTING)
    _deployed_equals_engine(tmp_path, env, case, app)


def test_real_supernodes_draw_secret_noise_and_keep_their_own_ledgers(tmp_path, deployment,
                                                                       app):
    """SuperNodes with their default policy: whatever the run config says (secure-noise=false,
    a seed the server knows), they draw their clients' noise and batches from the OS CSPRNG,
    so the model is not the engine's, and the summary says the ε holds against the server;
    each node charged its client's releases in its own ledger, which the server's matches."""
    from dpfl.client.node_ledger import NodeLedger

    env = deployment.start(NODES)
    case = {**CASES["dpsgd-gc"], "results-dir": str(tmp_path / "results"), "run-name": "real"}
    done = subprocess.run(
        [str(BIN / "flwr"), "run", str(app), "local-deployment", "--stream", "--run-config",
         format_overrides(case)], env=env, cwd=ROOT, timeout=600, capture_output=True,
        text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "results" / "real" / "summary.json").read_text())
    assert summary["rounds_completed"] == 2
    assert summary["privacy"]["guarantee_against_server"] is True
    assert summary["privacy"]["noise"] == {"secure": 3}
    engine = run(RunConfig({**case, "run-name": "engine"}), echo=False)
    deployed = torch.load(tmp_path / "results" / "real" / "model.pt")
    seeded = torch.load(tmp_path / "results" / "engine" / "model.pt")
    assert not all(torch.equal(deployed[k], seeded[k]) for k in seeded)
    assert engine["privacy"]["guarantee_against_server"] is False
    for c in range(3):
        ledger = NodeLedger.from_json((tmp_path / "state" / "ledger" / f"client-{c}.json")
                                      .read_text())
        assert summary["epsilon"][str(c)] == pytest.approx(ledger.epsilon("rdp", 1e-5),
                                                           rel=1e-12)


def test_tls_with_supernode_authentication(tmp_path, deployment, app):
    """Over TLS with registered node keys, through Flower's SecAgg+ with each client's noise
    split over the three (secure aggregation and distributed noise), the run equals the
    engine's; a SuperNode with an unregistered key and a plaintext SuperNode are refused by the
    SuperLink. One round (SecAgg+'s four stages are a ClientApp process each; rounds after the
    first are checked under simulation, test_flower's ``secagg`` case)."""
    env = deployment.start(NODES, tls=True, policy=TRUSTING)
    _deployed_equals_engine(tmp_path, env, {**CASES["dpsgd-gc"], "num-server-rounds": 1,
                                            "secure-aggregation": True,
                                            "distributed-noise": True}, app)
    summary = json.loads((tmp_path / "results" / "deployed" / "summary.json").read_text())
    assert summary["secure_aggregation"]["sum"].startswith("Flower's SecAgg+")
    assert summary["secure_aggregation"]["distributed_noise"]["min_survivors"] == 3
    unregistered = deployment.supernode("unregistered", "0", *deployment.node_security(3))
    plaintext = deployment.supernode("plaintext", "0", "--insecure", "--max-retries", "2")
    assert unregistered.wait(timeout=120) == 1  # what the guide says: status 1, 305 in its log
    assert "Exit Code: 305" in (tmp_path / "unregistered.log").read_text()
    assert plaintext.wait(timeout=120) != 0
    link = (tmp_path / "superlink.log").read_text()
    assert link.count("Activated node_id") == 3
    assert "No SuperNode found with the given public key" in link


@pytest.mark.xdist_group("deployment-cohorts")
def test_a_federation_missing_a_client_stops_early_in_one_line(tmp_path, cohorts, app):
    """num-partitions=5 with two SuperNodes hosting clients 0-3: once they have answered and
    no other SuperNode came for 10 s, one line naming the missing client, no traceback; the
    run is finished:failed (`flwr run --stream` exits 0 whatever happened, as the guide says)."""
    env, _ = cohorts
    done = subprocess.run(
        [str(BIN / "flwr"), "run", str(app), "local-deployment", "--stream", "--run-config",
         format_overrides({**CASES["dpsgd-gc"], "num-partitions": 5,
                           "results-dir": str(tmp_path / "results")})],
        env=env, cwd=ROOT, timeout=300, capture_output=True, text=True)
    out = done.stdout + done.stderr
    errors = [line for line in out.splitlines() if "dpfl: error:" in line]
    assert len(errors) == 1, out[-3000:]
    found = re.search(r"num-partitions=5, but no SuperNode hosts clients \[4\] \(the 2 "
                      r"SuperNodes that answered in (\d+) s host \[0-3\]\)", errors[0])
    assert found, errors[0]
    assert "Traceback" not in out
    # the server's own clock, not this test's (which counts packaging and process starts):
    # once the two have answered, 10 s without a third ends discovery, before the 120 s
    # timeout (the two answering can take a minute on a loaded machine: a ClientApp process
    # per node starts to answer)
    assert int(found.group(1)) < CONNECT_TIMEOUT, errors[0]
    run_id = re.search(r"Successfully started run (\d+)", out)
    assert run_id, out[-3000:]
    listed = subprocess.run([str(BIN / "flwr"), "ls", "local-deployment", "--run-id",
                             run_id.group(1), "--format", "json"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert [r["status"] for r in json.loads(listed.stdout)["runs"]] == ["finished:failed"]


def test_killed_supernodes_min_clients(tmp_path, deployment, app):
    """Three SuperNodes of one client each, ``min-clients=2``: one node killed (SIGKILL:
    Flower reports it unavailable once its heartbeats stop) after a round, the run goes on with
    two; a second stopped (SIGTERM: it leaves the federation at once), the run stops with one
    line naming the lost clients and keeps its last complete round. Every client sent an exchange
    is charged, replied or not; a client whose node is known to be gone is not sent one."""
    env = deployment.start(NODES, policy=TRUSTING)
    results = tmp_path / "results"
    overrides = {"algorithm": "dpsgd-gc", "num-partitions": 3, "num-server-rounds": 40,
                 "noise-multiplier": 1.0, "min-clients": 2, "seed": 1,
                 "results-dir": str(results), "run-name": "faults"}
    with open(tmp_path / "flwr-run.log", "w") as out:
        flwr = subprocess.Popen(
            [str(BIN / "flwr"), "run", str(app), "local-deployment", "--stream",
             "--run-config", format_overrides(overrides)],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    rounds_file = results / "faults" / "rounds.jsonl"

    def rounds() -> list[dict]:
        text = rounds_file.read_text() if rounds_file.exists() else ""
        return [json.loads(line) for line in text.splitlines()]

    try:
        wait_for(lambda: len(rounds()) >= 1, "no first round", [flwr], timeout=300)
        os.killpg(deployment.nodes[2].pid, signal.SIGKILL)
        wait_for(lambda: any(r.get("lost_clients") for r in rounds()),
              "the run did not go on without the killed node", [flwr], timeout=300)
        os.killpg(deployment.nodes[1].pid, signal.SIGTERM)
        flwr.wait(timeout=400)
    finally:
        stop_process(flwr)
    log = (tmp_path / "flwr-run.log").read_text()
    summary = json.loads((results / "faults" / "summary.json").read_text())
    done = rounds()
    lost = [r["round"] for r in done if r.get("lost_clients")]
    assert lost and all(r["lost_clients"] == [2] and r["participants"] == 2
                        for r in done if r.get("lost_clients")), done
    assert "going on with 2 of 3 participants" in log
    stop = [line for line in log.splitlines() if line.startswith("dpfl: error: stopped after")]
    assert len(stop) == 1 and "min-clients=2 needs 2" in stop[0] and "clients [1]" in stop[0]
    assert "clients [2]: node" in stop[0] and "offline" in stop[0]
    assert summary["rounds_completed"] == len(done) < 40
    epsilon, last = summary["epsilon"], done[-1]["epsilon"]
    # the stopping round was sent to client 0 (charged), to client 1 only if its node had not
    # left yet, never to client 2, whose node was known to be gone
    assert epsilon["0"] > last["0"]
    assert epsilon["1"] >= last["1"] and epsilon["2"] == last["2"]


def test_superlink_restart_does_not_reset_the_ledger(tmp_path, deployment, app):
    """A SuperLink killed mid-run and restarted on its ``--database``: Flower marks the run
    failed and nothing restarts it from round 1 with a fresh ledger; the ServerApp, cut off,
    closes the results folder with the rounds it completed and says why it stopped; running the
    same run name again is refused."""
    env = deployment.start(["0", "1"], database=True, policy=TRUSTING)
    results = tmp_path / "results"
    overrides = {"algorithm": "dpsgd-gc", "num-partitions": 2, "num-server-rounds": 40,
                 "noise-multiplier": 1.0, "results-dir": str(results), "run-name": "restart"}
    command = [str(BIN / "flwr"), "run", str(app), "local-deployment", "--run-config",
               format_overrides(overrides)]
    flwr = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert flwr.returncode == 0, flwr.stdout + flwr.stderr
    rounds_file = results / "restart" / "rounds.jsonl"

    def rounds() -> int:
        return len(rounds_file.read_text().splitlines()) if rounds_file.exists() else 0

    wait_for(lambda: rounds() >= 1, "no first round", [], timeout=300)
    deployment.restart_superlink()
    wait_for(lambda: (results / "restart" / "summary.json").exists(),
          "the ServerApp did not close its results", [], timeout=300)
    summary = json.loads((results / "restart" / "summary.json").read_text())
    # the ServerApp closed the folder saying why, before Flower's handler ran: Flower's exit
    # signal, or its next push failing on the restarted SuperLink (which comes first is timing)
    reason = summary["stopped_early"]
    assert reason.startswith(f"failed in round {rounds() + 1}: "), reason
    assert "Flower ended the ServerApp (SIG" in reason or "ObjectPushError" in reason, reason
    assert summary["rounds_completed"] == rounds() < 40

    def statuses() -> list[str]:
        listed = subprocess.run([str(BIN / "flwr"), "ls", "local-deployment", "--format",
                                 "json"], env=env, cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        return [r["status"] for r in json.loads(listed.stdout)["runs"]]

    # the results are closed first, then Flower's exit reports the run to the SuperLink
    wait_for(lambda: statuses() != ["running"], "the run stayed running", [], timeout=150)
    assert statuses() == ["finished:failed"]
    time.sleep(20)  # nothing picks the run up again
    assert rounds() == summary["rounds_completed"]
    again = subprocess.run([*command[:4], "--stream", *command[4:]], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert "dpfl: error: run config key 'run-name'" in again.stdout + again.stderr
