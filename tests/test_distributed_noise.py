"""Distributed noise (run-config ``distributed-noise``): each client draws its release's noise
at 1/√n_s of the std, the server's view (the participants' sum) carries at least the whole
std, the ledger charges the sum's guarantee and keeps the one of a client's own share beside
it, and the algorithms whose clients' noise feeds their later steps, the Flower runtimes and a
node refuse it in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from opacus.accountants import RDPAccountant

from dpfl.algorithms import ALGORITHMS
from dpfl.cli import main
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.privacy import Accounting, Release, independent
from dpfl.problem import build_problem
from dpfl.rounds.client import ClientRuntime
from dpfl.runconfig import RunConfig, check_runtime

BASE = {"algorithm": "dpsgd-gc", "num-partitions": 8, "num-server-rounds": 4, "seed": 3,
        "batch-size": 16}

#: the algorithms whose every upload the runtime noises after the client step
SPLITTABLE = {"alpha-normec", "clip-sgd", "clip21-sgd", "clip21-sgd2m", "dpsgd-gc"}


def uploads(values: dict) -> tuple[torch.Tensor, list[Release]]:
    """Round 1's upload of every client of a ``values`` run, and client 0's releases."""
    problem = build_problem(RunConfig({**BASE, **values}))
    algorithm = problem.algorithm
    state = algorithm.init_server_state(problem.x0)
    out, _, _ = ClientRuntime.of(problem).step(
        "train", 1, algorithm.broadcast("train", state, 1),
        algorithm.init_client_state(problem.num_clients), problem.full_cohort())
    return next(iter(out.values())), problem.releases(0)


@pytest.mark.parametrize("survivors", [0, 3])
def test_each_client_draws_a_share_of_the_noise(survivors):
    """The same keyed draws at 1/√n_s of the std: a client's noise is its whole-noise run's
    over √n_s exactly (float32 rounding), of std σ/√n_s; the sum over the n participants then
    has std σ·√(n/n_s) ≥ σ."""
    manual = {"noise-multiplier": 1.5}
    quiet, _ = uploads({**manual, "noise-multiplier": 0.0})
    whole, releases = uploads(manual)
    split, shares = uploads({**manual, "distributed-noise": True, "min-survivors": survivors})
    n_s = survivors or BASE["num-partitions"]
    assert all(r.shares == n_s and r.noise_multiplier == w.noise_multiplier
               for r, w in zip(shares, releases, strict=True))
    assert shares[0].std() == pytest.approx(releases[0].std() / math.sqrt(n_s), rel=1e-12)
    torch.testing.assert_close(split - quiet, (whole - quiet) / math.sqrt(n_s),
                               rtol=1e-4, atol=1e-6)
    noise = (split - quiet).double()
    assert noise.std().item() == pytest.approx(shares[0].std(), rel=0.02)
    summed = noise.sum(0).std().item()
    assert summed == pytest.approx(releases[0].std() * math.sqrt(BASE["num-partitions"] / n_s),
                                   rel=0.02)


def opacus_epsilon(z: float, q: float, steps: int, delta: float) -> float:
    accountant = RDPAccountant()
    accountant.history = [(z, q, steps)]
    return accountant.get_epsilon(delta=delta)


def test_the_ledger_keeps_both_guarantees(tmp_path):
    """Calibrated for ε = 4 (every client from one public bound on its records, as distributed
    noise calibrates them alike): the ledger's ε is the sum's, equal to the same run's without
    distributed noise; ``epsilon_if_unmasked`` is the ε of one client's share (z/√n_s), checked
    against Opacus and dp-accounting's PLD, above the run's; the summary says both."""
    values = {**BASE, "epsilon": 4.0, "min-client-records": 150, "results-dir": str(tmp_path)}
    whole = run(RunConfig({**values, "run-name": "whole"}), echo=False)
    split = run(RunConfig({**values, "run-name": "split", "distributed-noise": True,
                           "min-survivors": 4}), echo=False)
    assert split["epsilon_max"] == whole["epsilon_max"]
    assert "distributed_noise" not in whole
    statement = split["distributed_noise"]
    assert statement["min_survivors"] == 4
    release = Release(**split["releases"]["0"][0])
    assert release.shares == 4
    z, q = release.noise_multiplier / 2, release.sample_rate
    steps = BASE["num-server-rounds"] * release.steps
    unmasked = statement["epsilon_if_unmasked"]
    assert unmasked > 2 * split["epsilon_max"]
    # the ledger's RDP minimises over more orders than Opacus' (never looser), and is never
    # below the PLD's ε by more than its discretisation
    assert unmasked <= opacus_epsilon(z, q, steps, 1e-5) * (1 + 1e-9)
    pld = independent.epsilon("dp-accounting-pld", ((z, q, steps),), 1e-5)
    assert pld * 0.99 - 1e-3 <= unmasked
    saved = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert saved["distributed_noise"]["epsilon_if_unmasked"] == unmasked


def test_the_unmasked_ledger_survives_a_checkpoint():
    release = Release("message", "train", radius=1.0, relation="replace-one",
                      noise_multiplier=2.0).split(9)
    accounting = Accounting(num_clients=2, releases=lambda c: [release], accountant="rdp",
                            relation="replace-one", delta=1e-5)
    accounting.charge([0, 1], "train")
    again = Accounting(num_clients=2, releases=lambda c: [release], accountant="rdp",
                       relation="replace-one", delta=1e-5)
    again.load_state_dict(json.loads(json.dumps(accounting.state_dict())))
    assert again.report_unmasked() == accounting.report_unmasked()
    assert again.clients[0].history == [(2.0, 1.0, 1)]
    assert again.unmasked[0].history == [(2.0 / 3, 1.0, 1)]


def test_a_release_not_split_records_as_before():
    release = Release("message", "train", radius=1.0, relation="replace-one",
                      noise_multiplier=2.0)
    assert "shares" not in release.record() and release.local_event == release.event
    assert release.split(4).record()["shares"] == 4


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_each_algorithm_declares_whether_its_noise_can_be_split(name):
    """The algorithms whose uploads the runtime noises after the client step accept it; the
    others (noise inside the step, central noise, no noise) refuse, naming the key and why."""
    values = {"algorithm": name, "distributed-noise": True}
    if name in SPLITTABLE:
        assert RunConfig(values)["distributed-noise"] is True
        return
    with pytest.raises(ConfigError) as refused:
        RunConfig(values)
    assert refused.value.key == "distributed-noise" and "cannot split" in str(refused.value)


def test_min_survivors_is_checked():
    with pytest.raises(ConfigError, match="read only with distributed-noise"):
        RunConfig({"min-survivors": 2})
    with pytest.raises(ConfigError, match=r"exceeds the 5 clients .*allowed: 0\.\.5"):
        RunConfig({"algorithm": "clip21-sgd2m", "distributed-noise": True,
                   "fraction-train": 0.5, "min-survivors": 6})
    assert RunConfig({"algorithm": "clip21-sgd2m", "distributed-noise": True,
                      "fraction-train": 0.5, "min-survivors": 5})


def test_the_flower_runtimes_and_a_node_refuse_it(tmp_path, monkeypatch):
    """No secure aggregation under Flower yet: the ServerApp refuses the key before anything
    starts, and a node refuses it on its own (the server may send any run config)."""
    config = RunConfig({"distributed-noise": True, "results-dir": str(tmp_path)})
    check_runtime(config, "engine")
    with pytest.raises(ConfigError, match="distributed-noise.*secure aggregation"):
        check_runtime(config, "flower")
    from dpfl.client.cache import node_problem

    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="distributed-noise.*this node"):
        node_problem(tuple(sorted(config.items())), (0,), "")


def test_dpfl_run_refuses_in_one_line(capsys):
    code = main(["run", "--run-config", 'algorithm="dp-fedavg" distributed-noise=true'])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "distributed-noise" in err[0]


def test_the_audit_of_an_unmasked_upload_stays_below_its_shares_ledger():
    """``dpfl audit`` with distributed noise audits one client's uploads read alone: sound
    against the ε of the client's own share (far above the run's ε, which a sum-only view
    keeps), and far above the run's ε (a share alone is weak noise)."""
    from dpfl.audit import audit, full_batch

    config, client = full_batch({"algorithm": "dpsgd-gc", "model": "logistic",
                                 "num-server-rounds": 3, "num-partitions": 10, "epsilon": 1.0,
                                 "distributed-noise": True})
    result = audit(config, trials=200, client=client)
    assert "unmasked" in result.threat_model
    assert result.epsilon_ledger > 3.0
    assert result.bound.epsilon <= result.epsilon_ledger
    assert result.gaussian.epsilon_lower <= result.epsilon_ledger
    assert result.gaussian.epsilon > 1.0
