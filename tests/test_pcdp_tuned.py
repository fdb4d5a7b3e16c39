"""The tuned protocol of the PCDP-SGD paper's federated experiment (Sha, Liu, Liu, Chen,
"PCDP-SGD: Improving the Convergence of Differentially Private SGD via Projection in Advance",
arXiv:2312.03792 v1, main Table 2): each method's server step γ_g selected on a validation split,
the selected points on fresh seeds, paired differences with t-intervals."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from dpfl.errors import UsageError
from dpfl_reproductions.lab import Lab
from dpfl_reproductions.pcdp import LABEL, SETTINGS, verdict
from dpfl_reproductions.pcdp_tuned import (
    SELECTION_SEED,
    SERVER_LRS,
    choose,
    edge,
    paired,
    plan_of,
)
from dpfl.runconfig import RunConfig


def _summary(validation: float, test: float) -> dict:
    return {"test_loss": 1.0, "test_accuracy": test, "validation_loss": 1.0,
            "validation_accuracy": validation}


def test_the_selection_follows_the_validation_split_not_the_test_set():
    runs = {1.0: _summary(0.80, 0.95), 8.0: _summary(0.90, 0.70), 20.0: _summary(0.85, 0.99)}
    assert choose(runs) == 8.0
    runs[3.0] = _summary(0.90, 0.10)  # a tie on validation: the smaller step
    assert choose(runs) == 3.0


def test_the_selection_refuses_runs_without_a_validation_split():
    with pytest.raises(ValueError, match="num_validation"):
        choose({8.0: {"test_loss": 1.0, "test_accuracy": 0.9}})


def test_an_end_of_the_grid_is_an_edge():
    assert edge(1.0, SERVER_LRS) == "edge (lowest γ_g)"
    assert edge(35.0, SERVER_LRS) == "edge (highest γ_g)"
    assert edge(8.0, SERVER_LRS) == ""
    assert edge(3.0, (3.0, 8.0)) == ""  # two values: no inside, no edge


def test_the_paired_interval_is_the_t_interval_of_the_per_seed_differences():
    result = paired([91.0, 90.0, 92.5], [90.0, 90.5, 91.0])
    assert result.differences == (1.0, -0.5, 1.5)
    half = 4.302653 * math.sqrt(((1 - 2 / 3) ** 2 + (-0.5 - 2 / 3) ** 2 + (1.5 - 2 / 3) ** 2)
                                / 2 / 3)
    assert result.mean == pytest.approx(2 / 3)
    assert (result.low, result.high) == pytest.approx((2 / 3 - half, 2 / 3 + half), rel=1e-6)
    assert verdict(result, "fedpcdp", "dp-fedavg") == "undecided (interval contains 0)"
    assert verdict(paired([91, 92, 93], [90, 90.5, 91]), "fedpcdp", "dp-fedavg") == \
        "FedPCDP better"
    assert verdict(paired([80, 81, 82], [90, 90.5, 91]), "fedpcdp", "dp-fedavg") == \
        "DP-FedAvg better"
    assert verdict(paired([91], [90]), "fedpcdp", "dp-fedavg").startswith("undecided")


def test_a_claim_is_decided_by_where_its_interval_lies():
    """``decided``: above 0 confirms, below refutes, across is undecided; a claim of being
    competitive (not worse) is confirmed unless the interval lies below 0."""
    from dpfl_reproductions.selection import decided

    above, across, below = (paired([91, 92, 93], [90, 90.5, 91]),
                            paired([91.0, 90.0, 92.5], [90.0, 90.5, 91.0]),
                            paired([80, 81, 82], [90, 90.5, 91]))
    assert [decided(d) for d in (above, across, below)] == ["confirmed", "undecided", "refuted"]
    assert [decided(d, competitive=True) for d in (above, across, below)] == [
        "confirmed", "confirmed", "refuted"]
    assert decided(paired([91], [90])) == "undecided (one seed)"


def test_the_full_protocol_plan(tmp_path):
    """17 cells (DP-FedAvg at σ = 0 and four methods at four σ) × (5 γ_g + 3 seeds) = 136 runs;
    the fresh seeds are not the selection seed, and every run holds out the validation split;
    --only restricts the cells and the seeds as in the untuned experiment."""
    setting = SETTINGS["federated-mnist"]
    plan = plan_of(Lab(tmp_path, smoke=False), setting)
    assert len(plan.cells) == 17 and plan.runs == 136 and plan.rounds == 80
    assert [c for c in plan.cells if c[1] == 0] == [("dp-fedavg", 0.0)]
    assert SELECTION_SEED not in plan.seeds and plan.seeds == (1, 2, 3)
    values = plan.config(("fedpcdp", 4.0), 20.0, 2)
    RunConfig(values)  # valid
    assert "num_validation=5000" in values["dataset-options"]
    assert values["eval-every"] == 80 and values["server-learning-rate"] == 20.0
    selection, fresh = plan.config(("fedpcdp", 4.0), 8.0, 0), plan.config(("fedpcdp", 4.0), 8.0, 1)
    assert {k for k in selection if selection[k] != fresh[k]} == {"seed"}
    part = plan_of(Lab(tmp_path, smoke=False, only={"sigma": ["4", "10"], "seed": ["1"]}),
                   setting)
    assert {s for _, s in part.cells} == {4.0, 10.0} and len(part.cells) == 8
    assert part.seeds == (1,)
    with pytest.raises(UsageError, match="--only seed"):
        plan_of(Lab(tmp_path, smoke=False, only={"seed": ["0"]}), setting)
    with pytest.raises(UsageError, match="no cell"):
        plan_of(Lab(tmp_path, smoke=False, only={"sigma": ["0"], "method": ["fedpcdp"]}),
                setting)


@pytest.mark.smoke
def test_the_smoke_protocol_reports_selection_paired_differences_and_verdicts(tmp_path):
    from dpfl.cli import main

    assert main(["reproduce", "pcdp", "federated-mnist-tuned", "--smoke", "--workers", "1",
                 "--results-dir", str(tmp_path)]) == 0
    folder = tmp_path / "reproduce-pcdp-federated-mnist-tuned-smoke"
    report = (folder / "report.md").read_text()
    for text in ("### Selection, seed 0: final validation accuracy", "### Paired differences",
                 "| verdict |", "FedPCDP − DP-FedAvg | 4 |", "Does FedPCDP beat DP-FedAvg?",
                 "γ_g = 8", "dpfl run --run-config", "without DP (σ = 0)"):
        assert text in report, text
    with gzip.open(folder / "runs.jsonl.gz", "rt") as f:
        runs = [json.loads(line) for line in f]
    assert len(runs) == 12  # 3 cells × (2 γ_g + 2 seeds); the probes are selection runs
    seeds = {r["config"]["seed"] for r in runs}
    assert seeds == {SELECTION_SEED, 1, 2}
    for r in runs:
        assert "num_validation=100" in r["config"]["dataset-options"]
        assert r["summary"]["validation_accuracy"] is not None
    # selection (every γ_g) only at the selection seed; the fresh seeds run one γ_g per cell
    fresh = [r["config"] for r in runs if r["config"]["seed"] != SELECTION_SEED]
    assert len(fresh) == 6
    cells = {(c["algorithm"], c["noise-multiplier"]) for c in fresh}
    assert len({(c["algorithm"], c["noise-multiplier"], c.get("server-learning-rate"))
                for c in fresh}) == len(cells) == 3


def test_the_local_settings_fit_the_papers_epsilon_and_the_default_is_the_tuned_experiments(
        tmp_path):
    from dataclasses import replace

    from dpfl_reproductions.pcdp import config_of
    from dpfl_reproductions.pcdp_tuned import LOCALS

    base = SETTINGS["federated-mnist"]
    for batch, steps in LOCALS.values():
        q = batch / 5000
        assert q * q * 80 * steps == pytest.approx(1.0, abs=0.03)  # the paper's q²·T_c
        config = config_of(replace(base, batch_size=batch, local_steps=steps), "dp-fedavg",
                           4.0, 1, "code")
        assert (config["batch-size"], config["local-steps"]) == (batch, steps)
        RunConfig(config)
    assert config_of(replace(base, batch_size=250, local_steps=5), "dp-fedavg", 4.0, 1,
                     "code") == config_of(base, "dp-fedavg", 4.0, 1, "code")  # one archive
    smoke = [config_of(replace(base, batch_size=b, local_steps=t), "dp-fedavg", 4.0, 1, "code",
                       smoke=True) for b, t in LOCALS.values()]
    assert len({(c["batch-size"], c["local-steps"]) for c in smoke}) == 3  # still distinct


@pytest.mark.smoke
def test_the_local_settings_report_dp_fedavg_at_each_beside_the_paper(tmp_path):
    from dpfl.cli import main

    assert main(["reproduce", "pcdp", "federated-mnist-local", "--smoke", "--workers", "1",
                 "--only", "local=250x5,100x32", "--results-dir", str(tmp_path)]) == 0
    report = (tmp_path / "reproduce-pcdp-federated-mnist-local-smoke" / "report.md").read_text()
    assert report.index("### By local setting") < report.index("# B = 250, 5 local steps")
    for text in ("B = 100, T = 32 (q²·T_c = 1.02) | DP-FedAvg | 4 |", "| 84.70 |",
                 "# B = 100, 32 local steps a round", "### Selection, seed 0"):
        assert text in report, text
    assert "B = 200" not in report


def test_the_centralized_report_pairs_pcdp_sgd_with_pdp_sgd_and_dp_sgd_seed_by_seed(tmp_path):
    """§6.4's orderings with more than one seed: per σ, PCDP-SGD − PDP-SGD and PCDP-SGD − DP-SGD
    seed by seed, their mean, t-interval and verdict; a seed whose run has no final accuracy
    drops out of both sides; one seed gives no table."""
    from dpfl_reproductions.pcdp import Sweep, report_paired

    def runs(*values):
        return [{"derived": {"final_accuracy": v}} for v in values]

    lab = Lab(tmp_path, smoke=False, only={"seed": ["0", "1", "2"], "sigma": ["6", "30"],
                                           "method": ["dp-sgd", "pdp-sgd", "pcdp-sgd"]})
    sweep = Sweep(lab, SETTINGS["centralized-mnist"])
    results = {("pcdp-sgd", 6.0): runs(87.0, 88.0, 87.5), ("pdp-sgd", 6.0): runs(87.0, 87.5, 87.5),
               ("dp-sgd", 6.0): runs(91.0, 92.0, 91.5),
               ("pcdp-sgd", 30.0): runs(84.0, 84.5, None), ("pdp-sgd", 30.0): runs(83.0, 83.2, 1.0),
               ("dp-sgd", 30.0): runs(33.0, 35.0, 30.0)}
    report_paired(lab, sweep, results)
    (table,) = lab.sections
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| PCDP")]
    assert [(r[0], r[1]) for r in rows] == [("| PCDP-SGD − PDP-SGD", "6"),
                                            ("| PCDP-SGD − PDP-SGD", "30"),
                                            ("| PCDP-SGD − DP-SGD", "6"),
                                            ("| PCDP-SGD − DP-SGD", "30")]
    assert rows[0][2:4] == ["+0.00 +0.50 +0.00", "+0.17"]
    half = 4.302653 * math.sqrt((2 * (1 / 6) ** 2 + (1 / 3) ** 2) / 2 / 3)
    assert rows[0][4] == f"[{1 / 6 - half:+.2f}, {1 / 6 + half:+.2f}]"
    assert rows[0][5] == "undecided (interval contains 0) |"
    assert rows[1][2] == "+1.00 +1.30"  # seed 2 has no PCDP-SGD accuracy: out of both sides
    assert rows[2][5] == "DP-SGD better |" and rows[3][5] == "PCDP-SGD better |"

    one = Lab(tmp_path / "one", smoke=False, only={"seed": ["0"]})
    report_paired(one, Sweep(one, SETTINGS["centralized-mnist"]),
                  {(m, s): runs(80.0) for m in LABEL for s in SETTINGS["centralized-mnist"].sigmas})
    assert one.sections == []
