"""Secure aggregation and distributed noise (run-config ``secure-aggregation``,
``distributed-noise``): each upload is quantised on a public grid and summed exactly; each
client draws its release's noise at 1/√n_s of the std, the server's view (the participants'
sum) carries at least the whole std, the ledger charges the sum's guarantee and keeps the one
of a client's own share beside it, and the algorithms whose clients' noise feeds their later
steps, the fast engine mode and diagnostics refuse it in one line."""

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
from dpfl.rounds.secure_sum import Quantisation, SecureSum, quantisations
from dpfl.runconfig import RunConfig, check_runtime

BASE = {"algorithm": "dpsgd-gc", "num-partitions": 8, "num-server-rounds": 4, "seed": 3,
        "batch-size": 16}

SPLIT = {"secure-aggregation": True, "distributed-noise": True}

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
    split, shares = uploads({**manual, **SPLIT, "min-survivors": survivors})
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
    split = run(RunConfig({**values, "run-name": "split", **SPLIT,
                           "min-survivors": 4}), echo=False)
    assert split["epsilon_max"] == whole["epsilon_max"]
    assert "secure_aggregation" not in whole
    statement = split["secure_aggregation"]["distributed_noise"]
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
    assert saved["secure_aggregation"]["distributed_noise"]["epsilon_if_unmasked"] == unmasked
    grid = saved["secure_aggregation"]["grids"]["train"]["c"]
    assert grid["step"] <= Release(**saved["releases"]["0"][0]).std() / 1024


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
    values = {"algorithm": name, **SPLIT}
    if name in SPLITTABLE:
        assert RunConfig(values)["distributed-noise"] is True
        return
    with pytest.raises(ConfigError) as refused:
        RunConfig(values)
    assert refused.value.key == "secure-aggregation" and "cannot have" in str(refused.value)


def test_min_survivors_and_distributed_noise_are_checked():
    with pytest.raises(ConfigError, match="read only with distributed-noise"):
        RunConfig({"min-survivors": 2})
    with pytest.raises(ConfigError, match="distributed-noise.*needs secure-aggregation=true"):
        RunConfig({"distributed-noise": True})
    with pytest.raises(ConfigError, match=r"exceeds the 5 clients .*allowed: 0\.\.5"):
        RunConfig({"algorithm": "clip21-sgd2m", **SPLIT, "fraction-train": 0.5,
                   "min-survivors": 6})
    assert RunConfig({"algorithm": "clip21-sgd2m", **SPLIT, "fraction-train": 0.5,
                      "min-survivors": 5})
    with pytest.raises(ConfigError, match="secure-aggregation.*the sum of one upload"):
        RunConfig({"secure-aggregation": True, "num-partitions": 1})


def test_the_fast_engine_mode_and_diagnostics_refuse_it(tmp_path):
    """The engine's fast mode pools the participants' noise, which cannot be put on each
    client's grid; diagnostics would travel beside the secure sum in clear."""
    config = RunConfig({**SPLIT, "results-dir": str(tmp_path)})
    check_runtime(config, "engine")
    check_runtime(config, "flower")
    with pytest.raises(ConfigError, match="engine-mode.*its own noise"):
        check_runtime(config.replace(engine_mode="fast"), "engine")
    with pytest.raises(ConfigError, match="non-private-diagnostics.*in clear"):
        RunConfig({**SPLIT, "non-private-diagnostics": True})


def test_dpfl_run_refuses_in_one_line(capsys):
    code = main(["run", "--run-config", 'algorithm="dp-fedavg" secure-aggregation=true'])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "secure-aggregation" in err[0]


def test_the_audit_of_an_unmasked_upload_stays_below_its_shares_ledger():
    """``dpfl audit`` with distributed noise audits one client's uploads read alone: sound
    against the ε of the client's own share (far above the run's ε, which a sum-only view
    keeps), and far above the run's ε (a share alone is weak noise)."""
    from dpfl.audit import audit, full_batch

    config, client = full_batch({"algorithm": "dpsgd-gc", "model": "logistic",
                                 "num-server-rounds": 3, "num-partitions": 10, "epsilon": 1.0,
                                 **SPLIT})
    result = audit(config, trials=200, client=client, view="upload")
    assert "unmasked" in result.threat_model
    assert result.epsilon_ledger > 3.0
    assert result.bound.epsilon <= result.epsilon_ledger
    assert result.gaussian.epsilon_lower <= result.epsilon_ledger
    assert result.gaussian.epsilon > 1.0


# ---- the secure sum --------------------------------------------------------------------------

def test_the_grid_rounds_to_nearest_and_clamps_at_its_range():
    grid = Quantisation.of(radius=1.0, std=0.5)
    assert grid.bits == 11 and grid.bound == math.ceil((1.0 + 8 * 0.5) * 2**11)
    step = 2.0**-grid.bits
    rows = torch.tensor([[0.0, 0.5 * step, 1.5 * step, -0.5 * step, 100.0, -100.0, 0.3]])
    ints = grid.block_sum(rows)  # one row: its own grid points
    assert ints.dtype == torch.int64
    assert (ints - grid.bound)[:6].tolist() == [0, 0, 2, 0, grid.bound, -grid.bound]
    back = grid.dequantise(ints, 1)
    assert abs(back[6].item() - 0.3) <= step / 2
    assert Quantisation.of(radius=2.0, std=0.0).bits == 9  # no noise: 1/1024 of the radius


@pytest.mark.parametrize("std", [0.37, 1e-3, 1e-5])
def test_a_blocks_sum_of_grid_points_is_the_float64_reference_exactly(std):
    """:meth:`Quantisation.block_sum` (float32 points summed in groups that stay exact, or
    float64) equals rounding and summing in float64 and int64, ties and saturation included:
    for a grid whose 300 rows sum within 2^24 in one group, one that needs groups of 15 rows,
    and one beyond float32's exact range (L > 2^24)."""
    grid = Quantisation.of(radius=1.0, std=std)
    torch.manual_seed(0)
    rows = torch.randn(300, 2000) * std
    rows[0, :100] = (torch.arange(100) + 0.5) * 2.0**-grid.bits  # ties: to even
    rows[1, :10] = 1e6  # saturated
    reference = (torch.round(rows.double() * 2.0**grid.bits).clamp(-grid.bound, grid.bound)
                 .to(torch.int64) + grid.bound).sum(0)
    assert (grid.bound <= 2**24) is (std > 1e-5)
    assert torch.equal(grid.block_sum(rows), reference)


def test_the_secure_sum_is_the_same_bits_in_any_order_and_grouping():
    """Integers sum exactly: any order of the rows and any blocks give the same sums (a float
    sum does not), within half a step a row of the float64 sum."""
    torch.manual_seed(0)
    rows = torch.randn(300, 50) * 3
    grids = {"c": Quantisation.of(radius=1.0, std=3.0)}
    forward, backward = SecureSum(grids, torch.device("cpu")), SecureSum(grids,
                                                                         torch.device("cpu"))
    for part in (slice(0, 7), slice(7, 256), slice(256, 300)):
        forward.add({"c": rows[part]})
    backward.add({"c": rows.flip(0)})
    assert torch.equal(forward.sums["c"], backward.sums["c"])
    exact = rows.double().sum(0)
    step = 2.0**-grids["c"].bits
    assert (forward.sums["c"].double() - exact).abs().max() <= 300 * step / 2 + 1e-3


def test_an_engine_run_with_secure_aggregation_is_the_float_run_to_rounding(tmp_path):
    """The same run through the secure sum moves the model by about the grid's rounding: each
    round's sum differs from the float sum by at most half a step a client."""
    values = {**BASE, "results-dir": str(tmp_path), "min-client-records": 150}
    problem = build_problem(RunConfig({**values, "secure-aggregation": True}))
    grids = quantisations(problem, "train")
    algorithm = problem.algorithm
    state = algorithm.init_server_state(problem.x0)
    out, _, _ = ClientRuntime.of(problem).step(
        "train", 1, algorithm.broadcast("train", state, 1),
        algorithm.init_client_state(problem.num_clients), problem.full_cohort())
    secure = SecureSum(grids, torch.device("cpu"))
    secure.add(out)
    step = 2.0**-grids["c"].bits
    plain = out["c"].double().sum(0)
    assert 0 < (secure.sums["c"].double() - plain).abs().max() <= 8 * step / 2 + 1e-5
    a = run(RunConfig({**values, "run-name": "plain"}), echo=False)
    b = run(RunConfig({**values, "run-name": "secure", "secure-aggregation": True}), echo=False)
    assert a["epsilon_max"] == b["epsilon_max"]
    assert abs(a["test_loss"] - b["test_loss"]) < 1e-3


def test_a_grid_that_would_wrap_the_modulus_is_refused():
    """Noise far below the radius asks for a fine grid over a wide range, whose sum over the
    participants would pass the range a node's sum is passed to SecAgg+ at (2^30, below its
    modulus 2^32): refused, naming the key, before anything runs."""
    problem = build_problem(RunConfig({**BASE, "secure-aggregation": True,
                                       "noise-multiplier": 1e-6}))
    with pytest.raises(ConfigError, match="secure-aggregation.*overflow the secure sum"):
        quantisations(problem, "train")


@pytest.mark.smoke
def test_the_gain_experiment_smoke_run_writes_its_table(tmp_path):
    """``dpfl reproduce secagg gain --smoke``: both arms tuned alike, their paired difference,
    the unmasked ε, and why PriSMA is not run."""
    assert main(["reproduce", "secagg", "gain", "--smoke", "--results-dir", str(tmp_path),
                 "--workers", "1"]) == 0
    report = (tmp_path / "reproduce-secagg-gain-smoke" / "report.md").read_text()
    assert "distributed − local (95% CI)" in report and "ε if one upload is read" in report
    assert "`prisma`: its uploads are built from noise drawn inside the client step" in report
    rows = [line for line in report.splitlines() if line.startswith("| dpsgd-gc")]
    assert len(rows) == 4
    # the archive alone writes the same report (the unmasked ε is archived with each run)
    first = tmp_path / "reproduce-secagg-gain-smoke"
    assert main(["reproduce", "secagg", "gain", "--smoke", "--results-dir", str(tmp_path / "b"),
                 "--workers", "1", "--reuse", str(first / "runs.jsonl.gz")]) == 0
    again = tmp_path / "b" / "reproduce-secagg-gain-smoke"
    assert not (again / "runs").exists()
    assert (again / "report.md").read_text().split("\n", 3)[3] == report.split("\n", 3)[3]


def test_the_audit_of_the_secure_sum_stays_below_the_ledger():
    """``dpfl audit`` under secure aggregation audits, by default, what a server that follows
    the protocol sees: every exchange's sum over the whole federation, against the ledger's ε
    (the fit is about the ledger's with distributed noise: docs/audit.md)."""
    from dpfl.audit import audit, full_batch

    config, client = full_batch({"algorithm": "dpsgd-gc", "model": "logistic",
                                 "num-server-rounds": 2, "num-partitions": 3, "epsilon": 2.0,
                                 **SPLIT})
    result = audit(config, trials=200, client=client)
    assert "sees only the sum" in result.threat_model and result.scored_uploads == ("c",)
    assert math.isclose(result.epsilon_ledger, 2.0, rel_tol=0.02)
    assert result.bound.epsilon <= result.epsilon_ledger
    assert result.gaussian.epsilon_lower <= result.epsilon_ledger


def test_dpfl_audit_refuses_a_view_without_secure_aggregation(capsys):
    assert main(["audit", "--view", "sum", "--trials", "4"]) == 2
    assert "--view: 'sum'" in capsys.readouterr().err
