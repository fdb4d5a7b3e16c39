"""``dpfl audit`` sees record displacement (dpfl/audit/gradient_canary.py, "Displacement"):
under add/remove neighbours with every record in every batch, the audited client's records are
anti-records, so a fixed-size batch, in which the canary takes an anti-record's place, moves
the score by 2C where Poisson sampling moves it by C. The broken variant, built only here,
draws fixed-size batches under add/remove; the unchanged ledger still charges C."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpfl.algorithms import ALGORITHMS
from dpfl.algorithms.base import Batches, ClientContext, Cohort
from dpfl.audit import audit, full_batch, gradient_canary
from dpfl.privacy import Relation
from dpfl.problem import build_problem
from dpfl.runconfig import RunConfig

#: the algorithms and keys audited for power: DP-SGD (Poisson batches: add/remove always) and
#: DPSGD-GC with add/remove declared
ADD_REMOVE = [("dp-sgd", {}), ("dpsgd-gc", {"relation": "add-remove"})]

#: every record-level audit under add/remove: each algorithm, with the key that declares it
ADD_REMOVE_SETTINGS = [("dp-fedavg", {"sampling": "poisson"}),
                       ("dp-scaffold", {"sampling": "poisson"}), ("dp-sgd", {}),
                       ("dpsgd-gc", {"relation": "add-remove"}), ("fedlrs", {"sampling": "poisson"}),
                       ("fedpcdp", {}), ("fedpdp", {}), ("moon", {"sampling": "poisson"}),
                       ("pcdp-sgd", {}), ("pdp-sgd", {}), ("pfa-simplified", {}),
                       ("prisma", {"relation": "add-remove"}), ("rpdp-sgd", {}), ("rsdp-sgd", {})]


def fixed_size_batches(monkeypatch) -> None:
    """The broken variant: every batch b records drawn without replacement, add/remove
    neighbours included (an added record then pushes another out of the batch)."""
    def draw(self: Cohort, ctx: ClientContext, purpose: str, release: str,
             batch_size: int) -> Batches:
        return Batches(batch_size, *self.sample(ctx.rng, ctx.server_round, purpose, batch_size))
    monkeypatch.setattr(Cohort, "draw", draw)


def full_batch_values(name: str, epsilon: float, **keys) -> dict:
    return {"algorithm": name, "model": "logistic", "num-server-rounds": 3,
            "num-partitions": 10, "epsilon": epsilon, **keys}


@pytest.mark.parametrize("name, keys", [*ADD_REMOVE, ("dpsgd-gc", {})])
@pytest.mark.parametrize("whole", [True, False])
def test_the_audited_records_are_anti_records_where_displacement_shows(name, keys, whole):
    """The audited client's records carry z = −s under add/remove with every record in every
    batch, z = 0 with sampled batches or under replace-one (which fixed-size batches protect);
    under add/remove both worlds calibrate from the out world's record count."""
    config, client = full_batch(full_batch_values(name, 2.0, **keys))
    if not whole:
        config = config.replace(**{"batch-size": 20})
    source = build_problem(config)
    n = len(source.partitions[client])
    federation = gradient_canary.record_trials(source, client, 2, 1.0)
    z = federation.dataset.train_x[:n, -1]
    add_remove = name == "dp-sgd" or keys.get("relation") == "add-remove"
    s = gradient_canary.scale(source, 1.0)
    assert torch.all(z == (-s if add_remove and whole else 0.0))
    assert int(federation.config["min-client-records"]) == (n if add_remove else 0)
    out, inn = federation.releases(0), federation.releases(2)
    assert [r.noise_multiplier for r in out] == [r.noise_multiplier for r in inn]


@pytest.mark.slow
@pytest.mark.parametrize("name, keys", ADD_REMOVE)
def test_the_audit_catches_fixed_size_batches_under_add_remove(name, keys, monkeypatch):
    """Power: at ε = 4, with the runs the audit takes by default (1,000 a side), the full-batch
    audit's Gaussian-DP fit puts its 95% lower bound above the ledger's ε for fixed-size batches
    (DP-SGD: the fit 8.19, the broken mechanism's exact ε 8.32 by dp-accounting's PLD; the
    θ-only canary read 3.67) and not for the correct Poisson batches (3.70; exact 3.69)."""
    config, client = full_batch(full_batch_values(name, 4.0, **keys))
    correct = audit(config, trials=1000, client=client)
    assert correct.gaussian.epsilon_lower <= correct.epsilon_ledger
    assert correct.bound.epsilon <= correct.epsilon_ledger
    fixed_size_batches(monkeypatch)
    broken = audit(config, trials=1000, client=client)
    assert broken.epsilon_ledger == correct.epsilon_ledger
    assert broken.gaussian.epsilon_lower > broken.epsilon_ledger


@pytest.mark.parametrize("name, keys", [s for s in ADD_REMOVE_SETTINGS
                                         if s[0] not in gradient_canary.NEUTRAL_RECORDS])
def test_anti_records_shift_a_correct_mechanisms_scores_by_a_constant(name, keys, monkeypatch):
    """With every record in every batch, Poisson batches hold every anti-record in both worlds:
    the scores are the θ-only canary's (records at z = 0) plus one constant per world, to float
    rounding (about 1e-5 of the scores' spread), so the tight audit is unchanged."""
    config, client = full_batch(full_batch_values(name, 2.0, **keys))
    anti = audit(config, trials=20, client=client)
    monkeypatch.setattr(gradient_canary, "data_z", lambda source, client, s: 0.0)
    plain = audit(config, trials=20, client=client)
    for a, p in ((anti.scores_out, plain.scores_out), (anti.scores_in, plain.scores_in)):
        shift = a - p
        assert abs(shift.mean()) > 1 and np.ptp(shift) < 1e-4 * p.std()
    assert abs(anti.gaussian.mu - plain.gaussian.mu) < 1e-4


def test_the_settings_are_every_add_remove_record_level_audit():
    """:data:`ADD_REMOVE_SETTINGS` lists every algorithm (and the key that declares it) whose
    record-level audit is under add/remove: a new one is checked above, or joins
    :data:`~dpfl.audit.gradient_canary.NEUTRAL_RECORDS`, where its records keep z = 0."""
    found = []
    for name in ALGORITHMS.names():
        reads = RunConfig({"algorithm": name}).reads
        for keys in ({}, {"relation": "add-remove"}, {"sampling": "poisson"}):
            if ALGORITHMS.get(name).noise_free or not set(keys) <= reads:
                continue
            config, client = full_batch(full_batch_values(name, 2.0, **keys))
            source = build_problem(config)
            if (source.algorithm.relation is Relation.ADD_REMOVE
                    and not source.algorithm.central_releases()):
                found.append((name, keys))
                z = gradient_canary.data_z(source, client, 1.0)
                assert z == (0.0 if name in gradient_canary.NEUTRAL_RECORDS else -1.0)
    assert found == ADD_REMOVE_SETTINGS
