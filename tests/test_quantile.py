"""dp-fedavg-quantile: client-level DP-FedAvg with Andrew et al.'s quantile clipping as Flower
runs it — the paper's three formulas equal Flower's functions bit for bit, the clipping-norm
trajectory equals Flower's
``DifferentialPrivacyClientSideAdaptiveClipping`` fed the same replies, the server's noise has
the declared std, the ledger composes both central releases, Poisson client sampling amplifies
them for the whole population, and Flower = engine."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import DifferentialPrivacyClientSideAdaptiveClipping, FedAvg
from flwr.supercore.differential_privacy import (
    KEY_NORM_BIT,
    adaptive_clip_inputs_inplace,
    compute_adaptive_noise_params,
)
from opacus.accountants import PRVAccountant, RDPAccountant

from dpfl.algorithms import ServerContext
from dpfl.algorithms.quantile import (
    QuantileHyperparameters,
    clip_update,
    geometric_update,
    update_multiplier,
)
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.privacy import Randomness
from dpfl.problem import build_problem
from dpfl.rounds import ClientRuntime
from dpfl.runconfig import RunConfig
from tests.inprocess_grid import as_the_server

VALUES = {"algorithm": "dp-fedavg-quantile", "dataset": "digits", "model": "logistic",
          "num-partitions": 10, "num-server-rounds": 6, "batch-size": 16, "local-steps": 3,
          "learning-rate": 0.5, "clip": 0.05, "clipped-count-stddev": 4.0, "epsilon": 6.0,
          "delta": 1e-4, "seed": 2}


def _config(tmp_path, name="run", **changes):
    values = {**VALUES, "results-dir": str(tmp_path), "run-name": name}
    values.update({k.replace("_", "-"): v for k, v in changes.items()})
    return RunConfig(values)


def test_the_papers_formulas_equal_flowers_functions_bit_for_bit():
    """Theorem 1's noise split, Algorithm 1's clip and its geometric update, written from the
    paper, against Flower 1.41's ``compute_adaptive_noise_params``,
    ``adaptive_clip_inputs_inplace`` and the strategy wrapper's update, on random inputs."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        z = float(rng.uniform(0.01, 5.0))
        sigma_b = float(rng.uniform(z / 2 * 1.001, 20.0))
        assert compute_adaptive_noise_params(z, 10, sigma_b) == (
            sigma_b, update_multiplier(z, sigma_b))
        update = (rng.standard_normal(int(rng.integers(1, 3000))) * rng.uniform(1e-3, 10.0))
        update, clip = update.astype(np.float32), float(rng.uniform(0.01, 30.0))
        ours, theirs = update.copy(), update.copy()
        assert clip_update(ours, clip) == adaptive_clip_inputs_inplace([theirs], clip)
        assert ours.tobytes() == theirs.tobytes()
        hp = dataclasses.replace(QuantileHyperparameters(),
                                 target_quantile=float(rng.uniform(0.0, 1.0)),
                                 clip_learning_rate=float(rng.uniform(0.01, 1.0)))
        flower = DifferentialPrivacyClientSideAdaptiveClipping(
            FedAvg(), noise_multiplier=0.0, num_sampled_clients=10, initial_clipping_norm=clip,
            target_clipped_quantile=hp.target_quantile, clip_norm_lr=hp.clip_learning_rate)
        fraction = float(rng.uniform(-0.5, 1.5))  # the noisy fraction leaves [0, 1]
        flower._geometric_update(fraction)
        assert geometric_update(clip, fraction, hp) == flower.clipping_norm


class RecordingContext(ServerContext):
    """A server context that keeps what each release's noise made of its input."""

    def privatize(self, name, values, *, radius=None):
        noisy = super().privatize(name, values, radius=radius)
        self.seen = {**getattr(self, "seen", {}), name: (values, noisy)}
        return noisy


def _replies(x, uploads):
    """One reply per client as Flower's client-side wrapper expects them: the clipped model,
    the record count, and the norm bit (here Andrew et al.'s: 1 when unclipped)."""
    as_the_server()
    replies = []
    for i, (delta, bit) in enumerate(zip(uploads["delta"], uploads["unclipped"], strict=True)):
        sent = Message(RecordDict(), dst_node_id=i + 1, message_type="train")
        replies.append(Message(RecordDict({
            "arrays": ArrayRecord({"x": Array((x + delta).numpy())}),
            "metrics": MetricRecord({"num-examples": 100, KEY_NORM_BIT: int(bit[0])})}),
            reply_to=sent))
    return replies


def test_the_clipping_norm_follows_flowers_client_side_adaptive_clipping(tmp_path,
                                                                         monkeypatch):
    """Six noisy rounds: every round the clients' uploads go both to our server step and, as
    replies, to Flower's own strategy wrapper, whose count noise is made the draw of our
    keyed stream; the two clipping norms agree to the last bit, and they move."""
    problem = build_problem(_config(tmp_path))
    algorithm = problem.algorithm
    flower = DifferentialPrivacyClientSideAdaptiveClipping(
        FedAvg(), noise_multiplier=0.0, num_sampled_clients=10, initial_clipping_norm=0.05,
        target_clipped_quantile=0.5, clip_norm_lr=0.2, clipped_count_stddev=4.0)
    runtime = ClientRuntime(algorithm, problem.releases, Randomness(2))
    state = algorithm.init_server_state(problem.x0)
    cohort = problem.full_cohort()
    ours, theirs = [], []
    for server_round in range(1, 7):
        broadcast = algorithm.broadcast("train", state, server_round)
        uploads = runtime.step("train", server_round, broadcast, {}, cohort)[0]
        sums = {k: v.sum(dim=0) for k, v in uploads.items()}
        ctx = RecordingContext(server_round, Randomness(2), list(range(10)), 10,
                               releases={r.name: r for r in problem.server_releases()})
        x = state["x"]
        state = algorithm.server_step("train", state, sums, ctx)
        count, noisy_count = ctx.seen["count"]
        monkeypatch.setattr(np.random, "normal", lambda loc=0.0, scale=1.0, size=None:
                            float(noisy_count.sum()) if size is None
                            else np.zeros(size))
        flower.aggregate_train(server_round, _replies(x, uploads))
        monkeypatch.undo()
        ours.append(float(state["clip"][0]))
        theirs.append(flower.clipping_norm)
        assert float(noisy_count.sum()) != float(count.sum())  # the count was noised
    assert ours == theirs
    assert len(set(ours)) == 6


def test_clients_clip_their_update_and_report_whether_it_was_left_unclipped(tmp_path):
    problem = build_problem(_config(tmp_path, noise_multiplier=0.0))
    runtime = ClientRuntime(problem.algorithm, problem.releases, Randomness(0))
    state = problem.algorithm.init_server_state(problem.x0)
    for clip in (0.05, 50.0):
        broadcast = {"x": state["x"], "clip": torch.tensor([clip], dtype=torch.float64)}
        uploads = runtime.step("train", 1, broadcast, {}, problem.full_cohort())[0]
        norms = torch.linalg.vector_norm(uploads["delta"].double(), dim=1)
        assert (norms <= clip * (1 + 1e-6)).all()
        assert uploads["unclipped"][:, 0].tolist() == [float(n < clip * (1 - 1e-6))
                                                       for n in norms]
    assert uploads["unclipped"].sum() == 10  # nothing clipped at 50


def test_the_server_adds_noise_of_std_z_delta_times_the_clip_to_the_update_sum(tmp_path):
    """On the sum of the clipped updates the server draws N(0, (z_Δ·C)²) per coordinate, C the
    norm the updates were clipped at (not the updated one), z_Δ Flower's split of z = 2."""
    problem = build_problem(_config(tmp_path, noise_multiplier=2.0, dataset="mnist",
                                    num_server_rounds=1))
    algorithm = problem.algorithm
    sigma_b, z_delta = algorithm.noise_split(2.0)
    assert sigma_b == 4.0 and z_delta == pytest.approx((2.0 ** -2 - 8.0 ** -2) ** -0.5)
    model, count = problem.server_releases()
    assert (model.noise_multiplier, count.noise_multiplier) == (z_delta, 4.0)
    state = algorithm.init_server_state(problem.x0)
    sums = {"delta": torch.zeros(algorithm.model.d), "unclipped": torch.tensor([10.0])}
    ctx = ServerContext(1, Randomness(0), list(range(10)), 10,
                        releases={r.name: r for r in problem.server_releases()})
    new = algorithm.server_step("train", state, sums, ctx)
    noise = (new["x"] - state["x"]) * 10
    assert noise.std().item() == pytest.approx(z_delta * 0.05, rel=0.05)
    assert float(new["clip"][0]) != 0.05


def test_the_ledger_composes_both_central_releases_for_every_client(tmp_path):
    """Each client's ε is the client-level ε of the server's two releases per round,
    recomputed with Opacus; the accountant calibration meets the target; the pair costs more
    than one Gaussian at the effective multiplier z (the bits are not centred)."""
    summary = run(_config(tmp_path), echo=False)
    model, count = summary["releases"]["server"]
    accountant = RDPAccountant()
    for _ in range(6):
        for r in (model, count):
            accountant.step(noise_multiplier=r["noise_multiplier"], sample_rate=1.0)
    recomputed = accountant.get_epsilon(1e-4)
    assert set(summary["epsilon"]) == set(range(10))
    assert all(e == pytest.approx(recomputed, rel=1e-6) for e in summary["epsilon"].values())
    assert summary["server_epsilon"] == pytest.approx(recomputed, rel=1e-6)
    assert recomputed <= 6.0 * (1 + 1e-4) and recomputed > 6.0 * 0.99
    z = (model["noise_multiplier"] ** -2 - 8.0 ** -2) ** -0.5  # Flower's effective multiplier
    single = RDPAccountant()
    for _ in range(6):
        single.step(noise_multiplier=z, sample_rate=1.0)
    assert single.get_epsilon(1e-4) < recomputed
    assert not summary["privacy"]["guarantee_against_server"]
    assert "central DP" in summary["privacy"]["note"]


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:Optimal order:UserWarning")  # Opacus' numerics
def test_the_prv_accountant_calibrates_the_pair_of_releases(tmp_path):
    """The calibration's bisection starts at tiny multipliers, whose PRV grid would take
    gigabytes (a 173 GiB allocation at z = 0.008); the ledger gives those ε = inf, and the
    pair of releases it settles on meets the target by Opacus' PRV accountant."""
    model, count = build_problem(_config(tmp_path, accountant="prv")).server_releases()
    accountant = PRVAccountant()
    accountant.history = [(model.noise_multiplier, 1.0, 6), (count.noise_multiplier, 1.0, 6)]
    assert 6.0 * 0.99 < accountant.get_epsilon(delta=1e-4) <= 6.0 * (1 + 1e-4)


def test_an_unreachable_target_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="'epsilon'.*raise clipped-count-stddev"):
        build_problem(_config(tmp_path, clipped_count_stddev=0.5)).server_releases()
    with pytest.raises(ConfigError, match="'clipped-count-stddev'"):
        build_problem(_config(tmp_path, clipped_count_stddev=0.5,
                              noise_multiplier=1.5)).server_releases()


def test_the_default_count_noise_is_raised_where_flowers_cannot_reach_the_target(tmp_path):
    """10 clients: Flower's σ_b = 10/20 leaves ε = 6 out of reach; the default raises σ_b to
    twice the multiplier of one release a round for the target (recomputed with Opacus), and
    the pair of releases then meets the target."""
    config = _config(tmp_path, clipped_count_stddev=-1.0)
    model, count = build_problem(config).server_releases()
    single = RDPAccountant()
    for _ in range(6):
        single.step(noise_multiplier=count.noise_multiplier / 2, sample_rate=1.0)
    assert count.noise_multiplier > 10 / 20
    assert single.get_epsilon(1e-4) == pytest.approx(6.0, abs=0.01)  # Opacus' tolerance
    pair = RDPAccountant()
    for _ in range(6):
        for r in (model, count):
            pair.step(noise_multiplier=r.noise_multiplier, sample_rate=1.0)
    assert 6.0 * 0.99 < pair.get_epsilon(1e-4) <= 6.0 * (1 + 1e-4)


def test_flower_code_path_equals_engine(tmp_path):
    from tests.inprocess_grid import run_flower_code_path

    values = {**VALUES, "results-dir": str(tmp_path)}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    grid, _ = run_flower_code_path({**values, "run-name": "flower"},
                                   [{"partition-id": i} for i in range(10)])
    e, f = (torch.load(tmp_path / name / "model.pt") for name in ("engine", "flower"))
    assert all(torch.equal(e[key], f[key]) for key in e)
    # each client's own ledger (in its node's Context.state) holds the central releases too
    from dpfl.client.node_ledger import NodeLedger

    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    for node, context in grid.contexts.items():
        ledger = NodeLedger.from_json(str(context.state[f"dpfl.node.{node - 1}"]["json"]))
        assert ledger.epsilon("rdp", 1e-4) == pytest.approx(summary["epsilon"][str(node - 1)])
    rounds = [[json.loads(line)["clip"] for line in
               (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
              for name in ("engine", "flower")]
    assert rounds[0] == rounds[1] and len(set(rounds[0])) == 6


def test_poisson_client_sampling_charges_the_population_at_rate_q(tmp_path):
    """client-sampling="poisson" at q = 0.3 of 20 clients: a random cohort a round (some
    empty rounds possible), both releases amplified at rate q and charged to every client,
    sampled or not, each round: dp-accounting's Poisson-sampled Gaussians of z_Δ and σ_b,
    composed over the rounds; a fixed-size cohort of fewer than every client is refused."""
    import dp_accounting

    summary = run(_config(tmp_path, num_partitions=20, fraction_train=0.3,
                          clipped_count_stddev=-1.0, num_server_rounds=8), echo=False)
    releases = {r["name"]: r for r in summary["releases"]["server"]}
    assert {r["sample_rate"] for r in releases.values()} == {0.3}
    assert releases["count"]["noise_multiplier"] >= 0.3 * 20 / 20  # σ_b at least P/20, P = qn
    accountant = dp_accounting.rdp.RdpAccountant()
    for name in ("model", "count"):
        accountant.compose(dp_accounting.PoissonSampledDpEvent(
            0.3, dp_accounting.GaussianDpEvent(releases[name]["noise_multiplier"])), 8)
    expected = accountant.get_epsilon(1e-4)
    assert summary["epsilon"] == {}  # every client's ε is the population's
    assert summary["epsilon_population"] == pytest.approx(expected, rel=0.02)
    assert summary["epsilon_max"] <= 6.0 * (1 + 1e-4)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text()
              .splitlines()]
    assert len({r["participants"] for r in rounds}) > 1  # the cohort's size varies
    with pytest.raises(ConfigError, match="client-sampling"):
        _config(tmp_path, fraction_train=0.5, client_sampling="fixed")


def test_poisson_sampled_flower_code_path_equals_engine(tmp_path):
    from tests.inprocess_grid import assert_flower_equals_engine

    assert_flower_equals_engine(tmp_path, {**VALUES, "fraction-train": 0.5}, 10)
