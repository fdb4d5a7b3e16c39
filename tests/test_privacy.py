"""Privacy core: clip bounds, noise scale, keyed streams, releases, calibration, ledger."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

from dpfl.privacy import (
    Accounting,
    PrivacyLedger,
    Query,
    Randomness,
    Relation,
    Release,
    Side,
    accountant_noise_multiplier,
    add_noise,
    clip_by_norm,
    stds,
)
from dpfl.privacy.ledger import composed
from dpfl.privacy.prv import MAX_POINTS, grid_points


def _release(noise_multiplier, sample_rate, steps=1, relation="replace-one"):
    return Release(name="q", exchange="train", radius=1.0, relation=relation,
                   sample_rate=sample_rate, steps=steps, noise_multiplier=noise_multiplier)


def test_clipped_norms_never_exceed_the_threshold():
    g = torch.randn(500, 300) * torch.logspace(-3, 3, 500).unsqueeze(1)
    for clip in (1e-3, 0.5, 10.0):
        norms = torch.linalg.vector_norm(clip_by_norm(g, clip), dim=1)
        assert (norms <= clip * (1 + 1e-6)).all()


def test_vectors_inside_the_ball_are_unchanged_and_outside_are_rescaled():
    g = torch.tensor([[0.3, 0.4], [3.0, 4.0], [0.0, 0.0]])
    out = clip_by_norm(g, 1.0)
    assert torch.equal(out[0], g[0]) and torch.equal(out[2], g[2])
    assert torch.allclose(out[1], torch.tensor([0.6, 0.8]))


def test_per_client_clip_thresholds_broadcast():
    g = torch.full((2, 4), 10.0)
    norms = torch.linalg.vector_norm(clip_by_norm(g, torch.tensor([1.0, 2.0])), dim=1)
    assert torch.allclose(norms, torch.tensor([1.0, 2.0]))


def test_noise_has_the_requested_standard_deviation_per_client():
    rng = Randomness(7)
    noise = rng.normal([0, 1, 2], 5, "noise", (200_000,), torch.tensor([0.1, 1.0, 3.0]))
    assert noise.shape == (3, 200_000)
    assert torch.allclose(noise.std(dim=1), torch.tensor([0.1, 1.0, 3.0]), rtol=0.01)
    assert noise.mean(dim=1).abs().max() < 0.02


def test_streams_are_keyed_by_seed_client_round_and_purpose():
    a = Randomness(1)
    draw = lambda r, c=0, t=1, p="noise": r.normal([c], t, p, (64,), torch.ones(1))  # noqa: E731
    assert torch.equal(draw(a), draw(Randomness(1)))
    for other in (draw(Randomness(2)), draw(a, c=1), draw(a, t=2), draw(a, p="batch")):
        assert not torch.equal(draw(a), other)


def test_a_client_draws_the_same_noise_alone_or_in_a_cohort():
    rng = Randomness(3)
    cohort = rng.normal([4, 9, 2], 1, "noise", (100,), torch.ones(3))
    alone = rng.normal([9], 1, "noise", (100,), torch.ones(1))
    assert torch.equal(cohort[1], alone[0])


def test_secure_noise_is_not_determined_by_the_seed():
    rng = Randomness(0, secure=True)
    a = rng.normal([0], 1, "noise", (32,), torch.ones(1))
    b = rng.normal([0], 1, "noise", (32,), torch.ones(1))
    assert not torch.equal(a, b)


def test_batches_are_sampled_without_replacement():
    picks = Randomness(0).sample_without_replacement([0, 1], [50, 10], 1, "batch", 10)
    assert len(set(picks[0].tolist())) == 10 and max(picks[0]) < 50
    assert sorted(picks[1].tolist()) == list(range(10))


@pytest.mark.parametrize("accountant,cls", [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_accountant_calibration_meets_the_target_epsilon(accountant, cls):
    z = accountant_noise_multiplier(epsilon=2.0, delta=1e-5, sample_rate=0.02, steps=500,
                                    accountant=accountant)
    acc = cls()
    acc.history = [(z, 0.02, 500)]
    assert 2.0 - 0.011 <= acc.get_epsilon(delta=1e-5) <= 2.0
    acc.history = [(0.97 * z, 0.02, 500)]
    assert acc.get_epsilon(delta=1e-5) > 2.0  # smallest such multiplier, not any


def test_ledger_epsilon_is_opacus_epsilon_of_the_recorded_history():
    ledger = PrivacyLedger(accountant="rdp", relation="replace-one")
    for _ in range(40):
        ledger.record(_release(1.3, 0.05))
    ledger.record(_release(2.0, 0.1, 5))
    assert ledger.history == [(1.3, 0.05, 40), (2.0, 0.1, 5)]
    acc = RDPAccountant()
    for _ in range(40):
        acc.step(noise_multiplier=1.3, sample_rate=0.05)
    for _ in range(5):
        acc.step(noise_multiplier=2.0, sample_rate=0.1)
    assert ledger.epsilon(1e-5) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)
    assert ledger.steps == 45


def test_ledger_projection_records_nothing():
    ledger = PrivacyLedger(accountant="rdp", relation="replace-one")
    ledger.record(_release(1.0, 0.1, 10))
    after = ledger.epsilon_after([_release(1.0, 0.1)], 1e-5)
    assert after > ledger.epsilon(1e-5) and ledger.steps == 10


def test_no_noise_means_infinite_epsilon():
    ledger = PrivacyLedger(accountant="rdp", relation="replace-one")
    ledger.record(_release(0.0, 0.1))
    assert math.isinf(ledger.epsilon(1e-5))


def test_ledger_survives_json():
    ledger = PrivacyLedger(accountant="prv", relation="replace-one")
    ledger.record(_release(1.1, 0.2, 3))
    back = PrivacyLedger.from_json(ledger.to_json())
    assert back == ledger


def test_prv_ledger_matches_opacus_prv_accountant():
    ledger = PrivacyLedger(accountant="prv", relation="replace-one")
    ledger.record(_release(1.2, 0.05, 200))
    acc = PRVAccountant()
    acc.history = [(1.2, 0.05, 200)]
    assert ledger.epsilon(1e-5) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:Optimal order:UserWarning")  # Opacus' numerics
def test_a_ledger_of_alternating_releases_gives_opacus_epsilon_of_its_raw_history():
    """Two releases a round, one after the other (the quantile family's update and count):
    the ledger keeps each mechanism once with its steps, where Opacus' accountant would keep
    every release (it merges a step into the last event only), and its ε equals Opacus' ε of
    that raw history; a history that repeats a mechanism (a node's, an older checkpoint's) is
    composed alike."""
    ledger = PrivacyLedger(accountant="rdp", relation="add-remove")
    acc = RDPAccountant()
    for _ in range(150):
        for z in (3.0, 0.9):
            ledger.record(_release(z, 1.0, relation="add-remove"))
            acc.history.append((z, 1.0, 1))  # Opacus' step() would merge neither
    assert ledger.history == [(3.0, 1.0, 150), (0.9, 1.0, 150)] and len(acc.history) == 300
    assert ledger.epsilon(1e-5) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)
    assert composed(acc.history) == tuple(ledger.history)
    raw = PrivacyLedger(accountant="rdp", relation="add-remove", history=list(acc.history))
    assert raw.epsilon(1e-5) == ledger.epsilon(1e-5)
    after = [_release(3.0, 1.0, relation="add-remove")]
    acc.history.append((3.0, 1.0, 1))
    assert ledger.epsilon_after(after, 1e-5) == pytest.approx(acc.get_epsilon(delta=1e-5),
                                                              rel=1e-12)
    prv = PRVAccountant()
    prv.history = acc.history[:40]  # Opacus' PRV of 40 raw events (a slow path: 1 s)
    short = PrivacyLedger(accountant="prv", relation="add-remove", history=acc.history[:40])
    assert short.epsilon(1e-5) == pytest.approx(prv.get_epsilon(delta=1e-5), rel=1e-6)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:Optimal order:UserWarning")  # Opacus' numerics
def test_a_prv_history_whose_grid_is_too_large_is_given_infinite_epsilon():
    """Opacus' PRV accountant discretises a history on a grid whose length grows as the noise
    shrinks: at noise multiplier 0.01 two steps need 10⁷ points (gigabytes, minutes); the
    ledger's bound on that length, never above Opacus' own, gives ε = inf without making the
    grid, and a history of useful noise its Opacus ε."""
    def opacus_points(history):  # the domain PRVAccountant.get_epsilon(1e-5) discretises on
        prvs = [PoissonSubsampledGaussianPRV(q, z) for z, q, _ in history]
        steps = [n for *_, n in history]
        domain = PRVAccountant()._get_domain(prvs=prvs, num_self_compositions=steps,
                                             eps_error=0.01, delta_error=1e-8)
        return domain.size

    for history in (((0.01, 0.004, 2),), ((0.0078, 1.0, 200), (30.7, 1.0, 200)),
                    ((1.0, 0.01, 10_000),), ((12.0, 1.0, 200), (1.0, 1.0, 200))):
        points = opacus_points(history)
        assert 0.9 * points <= grid_points(history, 1e-5) <= points
    for tiny in (((0.01, 0.004, 2),), ((0.0078, 1.0, 200), (30.7, 1.0, 200))):
        assert grid_points(tiny, 1e-5) > MAX_POINTS
        ledger = PrivacyLedger(accountant="prv", relation="add-remove", history=list(tiny))
        assert math.isinf(ledger.epsilon(1e-5))
    useful = ((1.0, 0.01, 10_000),)
    assert grid_points(useful, 1e-5) < MAX_POINTS / 4
    ledger = PrivacyLedger(accountant="prv", relation="add-remove", history=list(useful))
    opacus = PRVAccountant()
    opacus.history = list(useful)
    assert ledger.epsilon(1e-5) == opacus.get_epsilon(delta=1e-5)


# ---- releases: the one place noise multipliers and stds are converted ------------------------

@pytest.mark.parametrize("relation, factor", [("replace-one", 2.0), ("add-remove", 1.0)])
def test_a_release_converts_between_its_multiplier_the_opacus_one_and_the_std(relation, factor):
    """std = noise multiplier · sensitivity = Opacus multiplier · radius, sensitivity =
    factor · radius (replacing a record moves a sum by 2r, adding one by r); the multiplier of
    the same std under the other relation; the relation and side are enums spelled as in the
    run config and the JSON."""
    query = Query("q", "train", radius=0.25, relation=relation, sample_rate=0.1)
    release = Release.of(query, query.multiplier_of(3.0))  # the key noise-multiplier = 3
    assert release.noise_multiplier == 3.0 / factor
    assert query.sensitivity() == factor * 0.25
    assert release.std() == pytest.approx(3.0 * 0.25) and release.std(1.0) == pytest.approx(3.0)
    assert stds([release]).item() == pytest.approx(3.0 * 0.25)
    other, other_factor = {"replace-one": ("add-remove", 1.0),
                           "add-remove": ("replace-one", 2.0)}[relation]
    assert Relation(other).multiplier(release.noise_multiplier, of=relation) == pytest.approx(
        3.0 * 0.25 / (other_factor * 0.25))
    assert release.relation is Relation(relation) and release.side is Side.CLIENT
    assert f'"relation": "{relation}"' in json.dumps(dataclasses.asdict(release))
    record = release.record()  # what checkpoints keep: they load plain types only
    assert type(record["relation"]) is str and type(record["side"]) is str
    assert Release(**record) == release
    assert stds([release], radius=0.5).item() == pytest.approx(3.0 * 0.5)  # a per-round radius
    assert release.event == (3.0 / factor, 0.1, 1)


@pytest.mark.parametrize("key, value", [("relation", "replace"), ("side", "node")])
def test_a_query_refuses_an_unknown_relation_or_side_naming_the_allowed(key, value):
    with pytest.raises(ValueError, match=f"{key} '{value}' is not one of .*"):
        Query("q", "train", radius=1.0, **{"relation": "add-remove", key: value})


def test_a_query_without_a_fixed_radius_needs_the_rounds_radius():
    query = Query("q", "train", radius=None, relation="replace-one")
    with pytest.raises(ValueError, match="no fixed radius"):
        stds([Release.of(query, 1.0)])


def test_calibrations_prefer_an_algorithms_own_entry_and_list_what_is_offered():
    from dpfl.algorithms import clip21, prisma  # noqa: F401  (register their calibrations)
    from dpfl.errors import ConfigError
    from dpfl.privacy import CALIBRATIONS
    from dpfl.privacy.calibration import accountant

    assert CALIBRATIONS.offered("dpsgd-gc") == ("accountant", "paper")
    assert CALIBRATIONS.offered("clip21-sgd2m") == ("accountant", "paper", "practice")
    assert CALIBRATIONS.get("paper", "dpsgd-gc").formula is prisma.paper_calibration
    assert CALIBRATIONS.get("paper", "clip-sgd").formula is clip21.paper_calibration
    assert CALIBRATIONS.get("accountant", "clip-sgd").formula is accountant
    with pytest.raises(ConfigError, match="'practice' is not offered.*allowed: accountant, paper"):
        CALIBRATIONS.get("practice", "dpsgd-gc")


def test_the_generic_accountant_calibration_needs_one_sample_rate_and_composes_every_release():
    from dpfl.algorithms import Algorithm
    from dpfl.errors import ConfigError
    from dpfl.privacy import Target, calibrate

    class Two:
        name = "two-queries"
        noise_multipliers = Algorithm.noise_multipliers

    queries = [Query("a", "statistic", 1.0, "replace-one", sample_rate=0.1, stream="a"),
               Query("b", "train", 1.0, "replace-one", sample_rate=0.2, stream="b")]
    target = Target(epsilon=1.0, delta=1e-5, rounds=10, accountant="rdp", num_samples=100,
                    steps=20)
    with pytest.raises(ConfigError, match="releases of one sample rate; algorithm 'two-queries' "
                                          "makes releases at 2"):
        calibrate(Two(), queries, target, calibration="accountant", noise_multiplier=-1.0)
    manual = calibrate(Two(), queries, target, calibration="accountant", noise_multiplier=4.0)
    assert [r.noise_multiplier for r in manual] == [2.0, 2.0]
    # one sample rate: one multiplier, for the 20 compositions of both releases together
    same = [dataclasses.replace(q, sample_rate=0.1) for q in queries]
    releases = calibrate(Two(), same, target, calibration="accountant", noise_multiplier=-1.0)
    z = accountant_noise_multiplier(epsilon=1.0, delta=1e-5, sample_rate=0.1, steps=20,
                                    accountant="rdp")
    assert [r.noise_multiplier for r in releases] == [z, z]


# ---- drawing noise: exact per client, or pooled for a sum --------------------------------------

D = 200_000
STD = torch.tensor([1.0, 2.0, 0.5, 3.0])
CLIENTS = [3, 5, 8, 9]


def _noise(pooled: bool, server_round: int = 1) -> torch.Tensor:
    return add_noise(torch.zeros(4, D), CLIENTS, STD, rng=Randomness(7), server_round=server_round,
                     stream="noise", pooled=pooled)


def test_exact_noise_is_per_client_with_each_clients_std():
    noise = _noise(pooled=False)
    for row, std in zip(noise, STD, strict=True):
        assert row.std().item() == pytest.approx(std.item(), rel=0.01)
    assert torch.equal(noise, _noise(pooled=False))  # keyed streams
    alone = add_noise(torch.zeros(1, D), [5], STD[1:2], rng=Randomness(7), server_round=1,
                      stream="noise")
    assert torch.equal(alone[0], noise[1])  # a client draws the same alone or in a cohort


def test_pooled_noise_has_the_law_of_the_sum_of_independent_draws():
    pooled = _noise(pooled=True)
    assert torch.count_nonzero(pooled[1:]) == 0  # one draw, carried by the first row
    total = pooled.sum(dim=0)
    assert total.mean().item() == pytest.approx(0.0, abs=0.05)
    assert total.std().item() == pytest.approx(math.sqrt(float(STD.square().sum())), rel=0.01)
    exact_total = _noise(pooled=False).sum(dim=0)
    assert total.std().item() == pytest.approx(exact_total.std().item(), rel=0.02)
    assert not torch.equal(total, exact_total)  # other numbers, same law
    assert not torch.equal(pooled, _noise(pooled=True, server_round=2))


# ---- accounting: the server's mirror of every client's ledger ---------------------------------

def test_accounting_charges_participants_only_and_stops_before_the_limit():
    release = _release(3.0, 0.05)
    accounting = Accounting(num_clients=3, releases=lambda c: [release], accountant="rdp",
                            relation="replace-one", delta=1e-5, limit=2.0)
    one_round = accounting.clients[0].epsilon_after([release], 1e-5)
    rounds = 0
    while accounting.refusal(rounds + 1, [0, 2], ["train"]) is None:
        accounting.charge([0, 2], "train")
        rounds += 1
    assert rounds > 1 and accounting.epsilon(0) <= 2.0 < accounting.clients[0].epsilon_after(
        [release], 1e-5)
    assert accounting.report() == {0: accounting.epsilon(0), 2: accounting.epsilon(2)}
    assert accounting.epsilon(1) == 0.0 and one_round > 0
    assert "max-epsilon" in accounting.refusal(rounds + 1, [0], ["train"])
    assert accounting.refusal(rounds + 1, [0], ["another"]) is None  # releases nothing
    assert accounting.refusal(rounds + 1, [1], ["train"]) is None  # client 1 spent nothing


@pytest.mark.parametrize("sigma, classical, opacus, ledger_rdp", [
    (2.0, 3.986, 3.497, 3.497), (6.0, 1.175, 0.963, 0.963), (10.0, 0.693, 0.549, 0.549),
    (22.0, 0.311, 0.233, 0.233), (30.0, 0.228, 0.173, 0.167)])
def test_the_classical_rdp_conversion_over_orders_2_to_256(sigma, classical, opacus,
                                                           ledger_rdp):
    """80 epochs of 40 Poisson steps at q = 250/10,000, δ = 1e-5: the classical conversion
    min_α RDP(α) + ln(1/δ)/(α − 1) over α = 2…256 gives the ε values the PCDP-SGD paper prints
    for its σ grid (4.00, 1.18, 0.69, 0.31, 0.23); Opacus' own conversion is tighter. Orders up
    to 63 only would not reach σ = 22 and 30's optima (α ≈ 75 and 102). Opacus' conversion's
    best order for σ = 30 (≈ 81) is above its default orders too: the ledger's ``rdp``, whose
    orders go on to 1024, gives 0.167 where Opacus' defaults stop at 0.173."""
    from dpfl.privacy import rdp
    from dpfl.privacy.ledger import _epsilon

    history = ((sigma, 0.025, 3200),)
    assert _epsilon("rdp-classical", history, 1e-5) == pytest.approx(classical, abs=6e-4)
    assert rdp.epsilon(history, 1e-5, extended=False) == pytest.approx(opacus, abs=6e-4)
    assert _epsilon("rdp", history, 1e-5) == pytest.approx(ledger_rdp, abs=6e-4)
    ledger = PrivacyLedger("rdp", "replace-one", list(history))
    assert ledger.epsilon(1e-5, "rdp-classical") > ledger.epsilon(1e-5)


@pytest.mark.parametrize("algorithm", ["dp-sgd", "adaptdp-fedavg", "dp-fedavg-quantile"])
def test_calibration_rounds_give_a_short_run_the_noise_of_the_full_one(algorithm):
    """A search's proxy of 3 rounds calibrated for 12 carries the 12-round run's noise on every
    release, and its ledger charges the 3 rounds it ran; fewer than the run's rounds would
    lower the noise below what ε needs, and are refused."""
    from dpfl.errors import ConfigError
    from dpfl.problem import build_problem
    from dpfl.runconfig import RunConfig

    base = {"algorithm": algorithm, "epsilon": 2.0, "seed": 0}
    full = build_problem(RunConfig({**base, "num-server-rounds": 12}))
    proxy = build_problem(RunConfig({**base, "num-server-rounds": 3, "calibration-rounds": 12}))
    short = build_problem(RunConfig({**base, "num-server-rounds": 3}))
    stds = [[r.noise_multiplier for r in p.releases(0)] for p in (full, proxy, short)]
    assert stds[1] == stds[0] and all(a > b for a, b in zip(stds[1], stds[2], strict=True))
    with pytest.raises(ConfigError, match="calibration-rounds.*allowed: 0 or at least"):
        build_problem(RunConfig({**base, "num-server-rounds": 12, "calibration-rounds": 3}))


def test_the_extremes_are_the_largest_and_smallest_client_epsilon_through_a_checkpoint():
    """``Accounting.extremes`` keeps each charged client's history as it is charged (one ε per
    distinct history a round, not one per client): it equals the max and min over every
    reported client and the population's ε, after charges, a node's reconciliation and a
    checkpoint's round trip."""
    import random

    own = Release("q", "train", radius=1.0, relation="replace-one", noise_multiplier=1.0,
                  sample_rate=0.2)
    shared = Release("c", "train", radius=1.0, relation="replace-one", noise_multiplier=3.0,
                     sample_rate=0.1)
    accounting = Accounting(num_clients=50, releases=lambda c: [own], accountant="rdp",
                            relation="replace-one", delta=1e-5, central=(shared,),
                            population=(shared,))

    def brute() -> tuple[float, float]:
        values = [*accounting.report().values(), accounting.population_epsilon()]
        return max(values), min(values)

    rng = random.Random(0)
    for _ in range(30):
        accounting.charge_population("train")
        accounting.charge(rng.sample(range(50), 5), "train")
        assert accounting.extremes() == pytest.approx(brute(), rel=1e-12)
    accounting.reconcile(3, {"q": accounting.counts[3]["q"] + 20})  # a node counts 20 more
    assert accounting.extremes() == pytest.approx(brute(), rel=1e-12)
    assert accounting.extremes()[0] == pytest.approx(accounting.epsilon(3), rel=1e-12)
    again = Accounting(num_clients=50, releases=lambda c: [own], accountant="rdp",
                       relation="replace-one", delta=1e-5, central=(shared,),
                       population=(shared,))
    again.load_state_dict(json.loads(json.dumps(accounting.state_dict())))
    assert again.extremes() == accounting.extremes()
    assert again.holders == accounting.holders
