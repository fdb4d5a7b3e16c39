"""The one-run audit (dpfl/audit/one_run.py): its p-value against the exact binomial tail and
the closed form of all-correct guesses, and one run of DPSGD-GC that stays below its ledger
without noise removed and far above it without noise."""

from __future__ import annotations

import math

import pytest
from scipy.stats import binom

from dpfl.audit.one_run import epsilon_lower_bound, one_run, p_value
from dpfl.runconfig import RunConfig


def test_without_delta_the_p_value_is_randomised_responses_binomial_tail():
    for eps in (0.0, 0.5, 2.0, 6.0):
        q = math.exp(eps) / (1 + math.exp(eps))
        for v in (0, 30, 55, 80, 100):
            assert math.isclose(p_value(1000, 100, v, eps, 0.0), binom.sf(v - 1, 100, q),
                                rel_tol=1e-12, abs_tol=1e-300)


def test_all_guesses_right_give_the_closed_form_bound():
    # P[Bin(r, q) ≥ r] = q^r < α  ⇔  q < α^(1/r): ε = ln(q / (1 − q)) at q = α^(1/r)
    q = 0.05 ** (1 / 100)
    assert math.isclose(epsilon_lower_bound(1000, 100, 100, 0.0, 0.95), math.log(q / (1 - q)),
                        rel_tol=1e-5)


def test_delta_only_weakens_the_bound_and_chance_gives_none():
    assert p_value(1000, 100, 80, 2.0, 1e-5) >= p_value(1000, 100, 80, 2.0, 0.0)
    assert epsilon_lower_bound(1000, 100, 90, 1e-5, 0.95) <= epsilon_lower_bound(
        1000, 100, 90, 0.0, 0.95)
    assert epsilon_lower_bound(1000, 100, 50, 1e-5, 0.95) == 0.0
    with pytest.raises(ValueError, match="v ≤ r ≤ m"):
        p_value(10, 20, 5, 1.0, 0.0)


@pytest.mark.parametrize("noise_multiplier,above", [(-1.0, False), (0.0, True)])
def test_one_run_of_dpsgd_gc(noise_multiplier, above):
    """Poisson sampling at q ≈ 0.15, 50 rounds. ε = 2 calibrated (noise-multiplier −1): the
    bound stays below the ledger; without noise (every canary sampled at least once, almost
    surely) every guess is right and the bound is the most 100 guesses show (3.49)."""
    values = {"algorithm": "dpsgd-gc", "model": "logistic", "num-server-rounds": 50,
              "relation": "add-remove", "batch-size": 68, "epsilon": 2.0,
              "noise-multiplier": noise_multiplier}
    result = one_run(RunConfig(values), canaries=500, guesses=100)
    if above:
        assert result.correct == 100 and result.epsilon_lower > 3.4
    else:
        assert result.epsilon_lower <= result.epsilon_ledger
        assert math.isclose(result.epsilon_ledger, 2.0, rel_tol=0.02)


def test_dpfl_audit_one_run_writes_its_folder_and_refuses_bad_guesses(tmp_path, capsys):
    import json

    from dpfl.cli import main

    assert main(["audit", "-c", f'algorithm="dpsgd-gc" results-dir="{tmp_path}" run-name="a" '
                 'relation="add-remove" batch-size=20 num-server-rounds=3', "--one-run",
                 "--canaries", "200", "--guesses", "20"]) == 0
    record = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert record["method"] == "one-run" and record["canaries"] == 200
    assert record["epsilon_lower"] <= record["epsilon_ledger"]
    assert "consistent" in capsys.readouterr().out
    assert main(["audit", "--one-run", "--canaries", "10", "--guesses", "20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--guesses" in err[0]
