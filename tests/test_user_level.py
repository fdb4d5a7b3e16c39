"""dp-fedavg-user: user-level DP-FedAvg with Poisson or fixed-size client sampling — the draw,
the clipped uploads, the server's noise, the ledger charged to the whole population and checked
against dp-accounting, an empty Poisson round, and Flower = engine."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import dp_accounting
import pytest
import torch

from dpfl.algorithms import ServerContext
from dpfl.algorithms.user_level import poisson_clients
from dpfl.engine import run
from dpfl.privacy import Randomness
from dpfl.problem import build_problem
from dpfl.rounds import ClientRuntime
from dpfl.runconfig import RunConfig

VALUES = {"algorithm": "dp-fedavg-user", "dataset": "digits", "model": "logistic",
          "num-partitions": 40, "num-server-rounds": 5, "batch-size": 16, "local-steps": 2,
          "learning-rate": 0.5, "clip": 0.1, "fraction-train": 0.25, "epsilon": 4.0,
          "delta": 1e-4, "seed": 3}


def _config(tmp_path, name="run", **changes):
    values = {**VALUES, "results-dir": str(tmp_path), "run-name": name}
    values.update({k.replace("_", "-"): v for k, v in changes.items()})
    return RunConfig(values)


def _dp_accounting_epsilon(event: dp_accounting.DpEvent, rounds: int, delta: float,
                           relation) -> float:
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event, rounds)
    return accountant.get_epsilon(delta)


def test_poisson_sampling_flips_one_coin_per_client_from_the_servers_stream():
    population = list(range(2000))
    draws = [poisson_clients(0.1, r, population, Randomness(5)) for r in range(1, 31)]
    sizes = [len(d) for d in draws]
    # Binomial(2000, 0.1): mean 200, std 13.4; the mean of 30 draws within 4 of its std
    assert abs(statistics.mean(sizes) - 200) < 4 * math.sqrt(2000 * 0.1 * 0.9 / 30)
    assert len(set(map(tuple, draws))) == 30  # fresh coins every round
    assert draws[0] == poisson_clients(0.1, 1, population, Randomness(5))  # same seed, same draw
    # client i's coin is the stream's i-th uniform: a smaller population keeps its clients' coins
    assert poisson_clients(0.1, 1, population[:500], Randomness(5)) == [
        c for c in draws[0] if c < 500]
    assert any(not poisson_clients(0.05, r, [0, 1, 2], Randomness(5)) for r in range(1, 60))


def test_clients_send_their_update_clipped_at_s(tmp_path):
    problem = build_problem(_config(tmp_path, noise_multiplier=0.0))
    runtime = ClientRuntime(problem.algorithm, problem.releases, Randomness(0))
    x = problem.algorithm.init_server_state(problem.x0)["x"]
    for clip in (0.1, 100.0):
        problem.algorithm.hp = dataclasses.replace(problem.algorithm.hp, clip=clip)
        uploads = runtime.step("train", 1, {"x": x}, {}, problem.full_cohort())[0]
        norms = torch.linalg.vector_norm(uploads["delta"].double(), dim=1)
        assert (norms <= clip * (1 + 1e-6)).all()
    assert (norms < 100.0 * 0.5).all() and (norms > 0).all()  # nothing clipped at 100


def test_the_server_adds_noise_of_std_z_times_s_and_divides_by_the_expected_cohort(tmp_path):
    problem = build_problem(_config(tmp_path, noise_multiplier=2.0, dataset="mnist",
                                    num_server_rounds=1))
    algorithm = problem.algorithm
    (release,) = problem.server_releases()
    assert (release.noise_multiplier, release.sample_rate) == (2.0, 0.25)
    state = algorithm.init_server_state(problem.x0)
    ctx = ServerContext(1, Randomness(0), [], 40, releases={release.name: release})
    new = algorithm.server_step("train", state, algorithm.zero_sums("train"), ctx)
    noise = (new["x"] - state["x"]) * (0.25 * 40)  # W = q·n, whoever took part
    assert noise.std().item() == pytest.approx(2.0 * 0.1, rel=0.02)


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_every_client_is_charged_each_round_and_the_ledger_equals_dp_accounting(tmp_path,
                                                                                sampling):
    """The subsampled Gaussian at the calibrated z, composed over the rounds, recomputed with
    dp-accounting: Poisson add/remove at rate q (for fixed-size sampling the ledger's proxy, as
    for fixed-size batches: docs/privacy.md), and for fixed-size sampling also sampling without
    replacement under replace-one, reported beside; every client's ε, sampled or not, is the
    run's; participations are counted."""
    summary = run(_config(tmp_path, client_sampling=sampling), echo=False)
    (release,) = summary["releases"]["server"]
    z, q = release["noise_multiplier"], release["sample_rate"]
    gaussian = dp_accounting.GaussianDpEvent(z)
    relation = dp_accounting.NeighboringRelation
    assert q == 0.25  # 10 of 40 clients
    expected = _dp_accounting_epsilon(dp_accounting.PoissonSampledDpEvent(q, gaussian), 5,
                                      1e-4, relation.ADD_OR_REMOVE_ONE)
    if sampling == "fixed":
        without = _dp_accounting_epsilon(
            dp_accounting.SampledWithoutReplacementDpEvent(40, 10, gaussian), 5, 1e-4,
            relation.REPLACE_ONE)
        assert summary["epsilon_by_accountant"]["dp-accounting-rdp-wor"] == pytest.approx(
            without, rel=1e-6)
        assert summary["epsilon_by_accountant"]["rdp-wor"] >= without * 0.99
    # no client released anything of its own: one ε, every client's, whatever the population
    assert summary["epsilon"] == {}
    assert summary["epsilon_population"] == pytest.approx(expected, rel=0.02)
    assert summary["epsilon_max"] <= 4.0 * (1 + 1e-4)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text()
              .splitlines()]
    taken = sum(r["participants"] for r in rounds)
    assert (taken == 50) if sampling == "fixed" else (0 < taken < 120)
    assert not summary["privacy"]["guarantee_against_server"]


def test_a_round_whose_poisson_draw_is_empty_still_releases_the_noise(tmp_path):
    summary = run(_config(tmp_path, num_partitions=3, fraction_train=0.05,
                          noise_multiplier=1.0, num_server_rounds=8), echo=False)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text()
              .splitlines()]
    assert summary["rounds_completed"] == 8 and any(r["participants"] == 0 for r in rounds)
    assert summary["server_epsilon"] > 0 and summary["epsilon_population"] > 0


def test_a_resumed_run_keeps_charging_the_population(tmp_path):
    """The population's shared ledger is part of the checkpoint: a run continued to more rounds
    equals the run started with them, ledger and model."""
    from dpfl.cli import main
    from tests.test_resume import assert_same_run

    values = {**VALUES, "noise-multiplier": 1.0, "checkpoint-every": 1,
              "results-dir": str(tmp_path)}
    run(RunConfig({**values, "num-server-rounds": 2, "run-name": "short"}), echo=False)
    assert main(["run", "-q", "--resume", str(tmp_path / "short"), "-c",
                 "num-server-rounds=4"]) == 0
    run(RunConfig({**values, "num-server-rounds": 4, "run-name": "long"}), echo=False)
    assert_same_run(tmp_path / "short", tmp_path / "long")


def test_flower_code_path_equals_engine(tmp_path):
    from tests.inprocess_grid import assert_flower_equals_engine

    assert_flower_equals_engine(tmp_path, {**VALUES, "num-partitions": 8}, 8)


def test_the_local_variant_noises_each_reply_and_charges_its_participants_alone(tmp_path):
    """dp-fedavg-user-local: each participant's reply carries N(0, (z·2S)²) (replace-one), no
    amplification: a client's ε is the Gaussian's composed over the rounds it took part in,
    recomputed with dp-accounting from the server's draw; Poisson sampling cannot be summed
    securely."""
    from dpfl.algorithms.base import sample_clients
    from dpfl.errors import ConfigError

    summary = run(_config(tmp_path, algorithm="dp-fedavg-user-local", client_sampling="fixed"),
                  echo=False)
    (release,) = summary["releases"]["0"]
    assert (release["side"], release["sample_rate"], release["relation"]) == (
        "client", 1.0, "replace-one")
    taken = [0] * 40
    for r in range(1, 6):
        for c in sample_clients(0.25, r, list(range(40)), Randomness(3)):
            taken[c] += 1
    for client, times in enumerate(taken):
        if not times:
            assert client not in summary["epsilon"]
            continue
        expected = _dp_accounting_epsilon(
            dp_accounting.GaussianDpEvent(release["noise_multiplier"]), times, 1e-4,
            dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        assert summary["epsilon"][client] == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ConfigError, match="secure-aggregation"):
        _config(tmp_path, algorithm="dp-fedavg-user-local", secure_aggregation=True)
    RunConfig({**VALUES, "algorithm": "dp-fedavg-user-local", "client-sampling": "fixed",
               "secure-aggregation": True, "distributed-noise": True})  # accepted


def test_a_million_client_ledger_holds_only_the_clients_that_took_part():
    """The population's release is one shared history; a client's own ledger, counts and
    participations exist once it takes part: 1,000 rounds of 1,000 participants out of 10⁶
    keep memory in the cohorts, and the checkpoint's state holds no empty ledger."""
    from dpfl.privacy import Accounting, Release
    from dpfl.privacy.release import Side

    population = Release(name="model", exchange="train", radius=1.0, relation="add-remove",
                         sample_rate=1e-3, steps=1, noise_multiplier=1.0, side=Side.SERVER)
    accounting = Accounting(num_clients=10**6, releases=lambda c: [], accountant="rdp",
                            relation="add-remove", delta=1e-6, central=(population,),
                            population=(population,))
    for r in range(1000):
        accounting.charge_population("train")
        accounting.charge(range(r * 10, r * 10 + 1000), "train")
    assert len(accounting.clients) == 0 and len(accounting.participations) == 10_990
    assert accounting.shared.history == [(1.0, 1e-3, 1000)]
    state = accounting.state_dict()
    assert state["clients"] == {} and state["unmasked"] == {}
    again = Accounting(num_clients=10**6, releases=lambda c: [], accountant="rdp",
                       relation="add-remove", delta=1e-6, central=(population,),
                       population=(population,))
    again.load_state_dict(state)
    assert again.epsilon(999_999) == accounting.epsilon(0) > 0
