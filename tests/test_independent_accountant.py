"""A second, independent accountant: the ledger's ε against Google's dp_accounting (PLD and RDP).

The ledger's ε must never be below the tighter of dp_accounting's PLD and RDP figures for the
same history by more than REL·ε + ABS (1% + 1e-3). Both figures are upper bounds of the exact
ε; the PLD is the tight one, and its pessimistic discretisation puts it above the exact ε by at
most 0.11% for ε ≥ 0.3 and 5e-4 below (measured against intervals of 1e-5 to 1e-4,
docs/privacy.md), which the tolerance covers with room. An ε below it by more would be a
privacy bug: the ledger claiming less than the mechanism leaks.
"""

from __future__ import annotations

import math

import pytest

from dpfl.privacy import independent, rdp
from dpfl.privacy.ledger import _epsilon

REL, ABS = 0.01, 1e-3
DELTA = 1e-5
STEPS = (1, 100, 1000, 5000)


def _tight(history, delta=DELTA):
    return min(independent.epsilon(independent.PLD, history, delta),
               independent.epsilon(independent.RDP, history, delta))


def _never_below(ledger: float, tight: float) -> None:
    assert ledger >= tight * (1 - REL) - ABS, f"ledger ε {ledger:.6g} < dp_accounting {tight:.6g}"


# Gaussian releases without sampling (multiplier ∝ √steps keeps ε moderate: composition of k
# Gaussians is one Gaussian of multiplier z/√k) and with Poisson sampling
HISTORIES = ([((c * math.sqrt(k), 1.0, k),) for c in (1.0, 3.0) for k in STEPS]
             + [((z, 0.02, k),) for z in (0.8, 2.0) for k in STEPS])


@pytest.mark.parametrize("history", HISTORIES, ids=lambda h: "z{:.3g}-q{:g}-k{}".format(*h[0]))
@pytest.mark.parametrize("accountant", ["rdp", "prv", "rdp-classical"])
def test_the_ledger_is_never_below_dp_accounting(accountant, history):
    _never_below(_epsilon(accountant, history, DELTA), _tight(history))


@pytest.mark.parametrize("history", [
    ((50.0, 0.01, 1000),),  # ε ≈ 0.02: the best order is above Opacus' 63
    ((30.0, 0.025, 3200),),
    ((0.1, 0.05, 3000),),  # ε ≈ 10⁴: the best order is below Opacus' 1.1
    ((0.05, 1.0, 30),),
    ((1.3, 0.05, 40), (2.0, 0.1, 5), (1.3, 0.05, 60)),  # several mechanisms, interleaved
], ids=["small-eps", "pcdp-sigma30", "huge-eps", "huge-eps-unsampled", "mixed"])
def test_the_ledger_is_never_below_dp_accounting_at_the_ends_of_the_orders(history):
    _never_below(_epsilon("rdp", history, DELTA), _tight(history))


@pytest.mark.parametrize("history", [((z, q, k),) for z, q in ((0.8, 0.02), (3.0, 0.2))
                                     for k in STEPS] + [((2.0 * math.sqrt(k), 1.0, k),)
                                                        for k in (1, 1000)],
                         ids=lambda h: "z{:.3g}-q{:g}-k{}".format(*h[0]))
def test_rdp_wor_is_never_below_dp_accountings_sampled_without_replacement_rdp(history):
    """The ledger's ``rdp-wor`` (Wang et al.'s general Theorem 9) against dp_accounting's
    Gaussian-specific Theorem 27 for the same fixed-size batches under replace-one."""
    wor = independent.epsilon(independent.RDP_WOR, history, DELTA)
    _never_below(_epsilon("rdp-wor", history, DELTA), wor)


def test_a_replace_one_release_is_the_add_remove_event_at_its_multiplier():
    """At q = 1 a replace-one release of multiplier z (std / 2r) is GaussianDpEvent(z) under
    add/remove; dp_accounting's REPLACE_ONE reads z differently in its two accountants (PLD:
    GaussianDpEvent(2z), RDP: GaussianDpEvent(z)). Under fixed-size sampling the symmetric
    replace-one configuration (dp_accounting's REPLACE_ONE Poisson PLD) stays below the
    add/remove figure the ledger uses."""
    from dp_accounting import NeighboringRelation, dp_event
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    def eps(accountant, event):
        accountant.compose(dp_event.SelfComposedDpEvent(event, 100))
        return accountant.get_epsilon(DELTA)

    replace, z = NeighboringRelation.REPLACE_ONE, 8.0
    ours = independent.epsilon(independent.PLD, ((z, 1.0, 100),), DELTA)
    pld = eps(PLDAccountant(replace, 1e-3), dp_event.GaussianDpEvent(2 * z))
    assert pld == pytest.approx(ours, rel=1e-3)
    rdp_replace = eps(RdpAccountant(neighboring_relation=replace), dp_event.GaussianDpEvent(z))
    assert rdp_replace == pytest.approx(independent.epsilon(independent.RDP, ((z, 1.0, 100),),
                                                            DELTA), rel=1e-12)
    for z, q in ((1.0, 0.02), (0.8, 0.2), (3.0, 0.05)):
        symmetric = eps(PLDAccountant(replace, 1e-3),
                        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(2 * z)))
        assert symmetric <= independent.epsilon(independent.PLD, ((z, q, 100),), DELTA) * 1.001


@pytest.mark.parametrize("history", [
    ((1.3, 0.05, 40), (2.0, 0.1, 5), (1.3, 0.05, 60)), ((3.0, 1.0, 30), (0.9, 32 / 144, 300)),
    ((0.6, 0.004, 5000),)], ids=["interleaved", "unsampled-and-sampled", "long"])
def test_each_figure_is_dp_accountings_accountant_on_the_historys_event(history):
    """The ledger's figures reuse each mechanism's one-step PLD and RDP across rounds; they
    equal dp_accounting's PLDAccountant and RdpAccountant composing the whole event."""
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    pld = PLDAccountant(value_discretization_interval=1e-3)
    pld.compose(independent.dp_event(history))
    assert independent.pld_epsilon(history, DELTA, 1e-3) == pytest.approx(
        pld.get_epsilon(DELTA), rel=1e-9)
    for wor, relation in ((False, NeighboringRelation.ADD_OR_REMOVE_ONE),
                          (True, NeighboringRelation.REPLACE_ONE)):
        rdp_accountant = RdpAccountant(neighboring_relation=relation)
        rdp_accountant.compose(independent.dp_event(history, wor))
        assert independent.rdp_epsilon(history, DELTA, wor) == pytest.approx(
            rdp_accountant.get_epsilon(DELTA), rel=1e-12)


def test_the_pld_is_not_computed_past_a_million_subsampled_compositions():
    """Its cost grows with them (minutes at 10^7, uninterruptible): NaN, which the summary
    writes as null and the largest-client report keeps, while the RDP figures stay."""
    from dpfl.privacy import Accounting

    huge = ((5.0, 0.01, 10**7),)
    assert math.isnan(independent.epsilon(independent.PLD, huge, DELTA))
    assert math.isfinite(independent.epsilon(independent.RDP, huge, DELTA))
    # un-subsampled steps are one Gaussian (multiplier z/√k), computed however many: here an
    # effective multiplier of 1.6 (at z = 5, the 10^7 steps leave 0.0016: ε ≈ 2·10^5 and 25 s)
    assert math.isfinite(independent.epsilon(independent.PLD, ((5000.0, 1.0, 10**7),), DELTA))
    accounting = Accounting(num_clients=2, releases=lambda c: [], accountant="rdp",
                            relation="replace-one", delta=DELTA)
    accounting.clients[0].history, accounting.clients[1].history = [(5.0, 0.01, 10)], list(huge)
    accounting.charged = {0, 1}
    by = accounting.report_by_accountant()
    assert math.isnan(by[independent.PLD]) and math.isfinite(by[independent.RDP])


def test_a_sample_rate_is_written_as_the_batch_it_came_from():
    for b, m in ((32, 144), (250, 10_000), (1, 7), (100, 22_605)):
        g = math.gcd(b, m)
        assert independent.batch(b / m) == (b // g, m // g)


# ---- the extended RDP orders --------------------------------------------------------------

EDGES = [((1.13, 0.222, 30),), ((0.6, 0.004, 5000),), ((30.0, 0.025, 3200),),
         ((50.0, 0.01, 1000),), ((0.05, 1.0, 30),), ((0.1, 0.05, 3000),), ((100.0, 1.0, 1000),)]


def _opacus_default(history):
    """Opacus' RDPAccountant ε and whether its best order is an end of its default orders."""
    import warnings

    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as rdp_analysis

    curve = sum(rdp.curve(z, q, rdp.DEFAULT_ORDERS) * k for z, q, k in history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _, best = rdp_analysis.get_privacy_spent(orders=list(rdp.DEFAULT_ORDERS), rdp=curve,
                                                 delta=DELTA)
        accountant = RDPAccountant()
        accountant.history = list(history)
        return accountant.get_epsilon(DELTA), best in (rdp.DEFAULT_ORDERS[0],
                                                       rdp.DEFAULT_ORDERS[-1])


@pytest.mark.parametrize("history", EDGES, ids=lambda h: "z{:g}-q{:g}-k{}".format(*h[0]))
def test_the_ledger_minimises_over_every_order_and_never_exceeds_opacus_defaults(history):
    """The extensions are evaluated only where a lower bound says they can help, yet the
    result is the minimum over all the orders; it is Opacus' ε where Opacus' best order is
    interior, and below it where that order is an end of its range."""
    import numpy as np

    orders = rdp.orders()
    curve = sum(rdp.curve(z, q, orders) * k for z, q, k in history)
    brute = float(np.nanmin(curve + rdp.conversion(np.asarray(orders), DELTA)))
    ours = rdp.epsilon(history, DELTA)
    assert ours == pytest.approx(max(brute, 0.0), rel=1e-12)
    default, at_an_end = _opacus_default(history)
    if at_an_end:
        assert ours < default
    else:
        assert ours == default


PRUNED = [*EDGES, ((0.5, 0.01, 300), (2.0, 0.2, 40)), ((0.8, 1.0, 5), (4.0, 0.05, 900)),
          ((1.0, 0.3, 10000),), ((10.0, 0.001, 1),), ((0.02, 0.5, 3),), ((0.0, 0.1, 5),)]


@pytest.mark.parametrize("history", PRUNED, ids=lambda h: "-".join(
    "z{:g}-q{:g}-k{}".format(*e) for e in h))
def test_the_fractional_orders_left_out_by_the_bound_never_held_the_minimum(history):
    """Opacus' fractional orders are evaluated only where the secants of (α − 1)·RDP(α) leave
    room below the best ε: the minimum over its default orders is the same float as when every
    one of them is evaluated (multi-mechanism histories, q = 1, no noise: RDP infinite)."""
    import numpy as np

    orders = rdp.DEFAULT_ORDERS
    everything = rdp._best(orders, sum(rdp.curve(z, q, orders) * k for z, q, k in history),
                           DELTA)
    pruned, _ = rdp._default_best(history, DELTA)
    assert pruned == everything or (np.isnan(pruned) and np.isnan(everything))


def test_the_bound_leaves_most_fractional_orders_out(monkeypatch):
    """The pruning is real: for a typical history (the optimum interior) fewer than a fifth of
    Opacus' 99 fractional orders are evaluated."""
    evaluated: list[float] = []
    curve = rdp.curve

    def counted(z, q, alphas):
        evaluated.extend(a for a in alphas if not float(a).is_integer())
        return curve(z, q, alphas)

    monkeypatch.setattr(rdp, "curve", counted)
    rdp._default_best(((1.1, 0.01, 3000),), DELTA)
    assert 0 < len(evaluated) < 20


@pytest.mark.parametrize("epsilon, q, steps, opacus_orders", [
    (2.0, 0.02, 500, "interior"), (8.0, 0.222, 30, "interior"), (3000.0, 0.05, 3000, "end"),
    (5000.0, 1.0, 30, "end"), (0.05, 0.01, 1000, "unreachable")])
def test_calibration_meets_the_target_in_the_ledgers_own_terms(epsilon, q, steps,
                                                               opacus_orders):
    """A multiplier calibrated for ε gives ledger ε ≤ target, within Opacus' tolerance 0.01.
    It is Opacus' own multiplier where Opacus' best order is interior; where that order is an
    end of Opacus' range the extended orders certify the target with less noise, and a target
    below 2 ln(1/δ)/63 that Opacus' orders cannot reach at all becomes reachable."""
    import warnings

    from opacus.accountants.utils import get_noise_multiplier

    from dpfl.privacy import accountant_noise_multiplier

    z = accountant_noise_multiplier(epsilon=epsilon, delta=DELTA, sample_rate=q, steps=steps,
                                    accountant="rdp")
    assert epsilon - 0.01 <= _epsilon("rdp", ((z, q, steps),), DELTA) <= epsilon
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if opacus_orders == "unreachable":
            with pytest.raises(ValueError, match="privacy budget is too low"):
                get_noise_multiplier(target_epsilon=epsilon, target_delta=DELTA,
                                     sample_rate=q, steps=steps, epsilon_tolerance=0.01)
            return
        opacus = get_noise_multiplier(target_epsilon=epsilon, target_delta=DELTA,
                                      sample_rate=q, steps=steps, epsilon_tolerance=0.01)
    assert _opacus_default(((opacus, q, steps),))[1] == (opacus_orders == "end")
    if opacus_orders == "end":
        assert z < opacus
    else:
        assert z == opacus


# ---- every algorithm's calibration ----------------------------------------------------------

def _algorithms():
    from dpfl.algorithms import ALGORITHMS

    return ALGORITHMS.names()


@pytest.fixture(scope="module")
def problems():
    from dpfl.problem import build_problem
    from dpfl.runconfig import RunConfig

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build_problem(RunConfig({"algorithm": name}))
        return cache[name]

    return get


def _accounting(problem, rounds):
    from dpfl.privacy import Accounting

    cfg, algorithm = problem.config, problem.algorithm
    accounting = Accounting(
        num_clients=problem.num_clients, releases=problem.releases,
        accountant=str(cfg["accountant"]), relation=algorithm.relation,
        delta=float(cfg["delta"]), also=algorithm.reported_accountants,
        central=tuple(r for r in problem.server_releases()
                      if r.name in algorithm.central_releases()))
    everyone = list(range(problem.num_clients))
    for r in range(1, rounds + 1):
        for exchange in algorithm.round_exchanges(r):
            accounting.charge(everyone, exchange.name)
    return accounting


@pytest.mark.parametrize("name", _algorithms())
def test_every_algorithms_calibration_holds_by_both_libraries(name, problems):
    """Each algorithm at its defaults (digits, 10 clients, its own calibration for ε = 8 over
    its rounds): the run's ledger ε meets the target, and over 1,000 rounds of the same
    releases no accountant the ledger reports is below the tighter of dp_accounting's PLD and
    RDP (for ``rdp-wor``, dp_accounting's sampled-without-replacement RDP)."""
    problem = problems(name)
    cfg = problem.config
    run = _accounting(problem, int(cfg["num-server-rounds"]))
    if problem.algorithm.noise_free:
        assert all(math.isinf(e) for e in run.report_by_accountant().values())
        return
    assert max(run.report().values()) <= float(cfg["epsilon"]) * (1 + REL)
    long = _accounting(problem, 1000)
    assert set(long.report_by_accountant()) == {*run.accountants, *run.independent}
    delta = float(cfg["delta"])
    for history in {tuple(long.clients[c].history) for c in long.charged}:
        tight = _tight(history, delta)
        for accountant in run.accountants:
            reference = (independent.epsilon(independent.RDP_WOR, history, delta)
                         if accountant == "rdp-wor" else tight)
            _never_below(_epsilon(accountant, history, delta), reference)
