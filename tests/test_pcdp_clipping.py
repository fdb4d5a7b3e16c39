"""``dpfl reproduce pcdp clipping-functions`` (the PCDP paper's Fig. 3): the plan's variants and
their runs, and the smoke run's report."""

from __future__ import annotations

import pytest

from dpfl.runconfig import RunConfig
from dpfl_reproductions.lab import Lab
from dpfl_reproductions.pcdp_clipping import LEARNING_RATES, plan_of


def test_each_variant_runs_its_function_with_or_without_projection_at_the_papers_sigma(
        tmp_path):
    plan = plan_of(Lab(tmp_path, smoke=False))
    assert len(plan.cells) == 2 * 3 * 2 and plan.learning_rates == LEARNING_RATES
    for cell in plan.cells:
        dataset, function, projection = cell
        values = RunConfig({**plan.config(cell, 1.0, 1), "results-dir": str(tmp_path)})
        assert values["clipping-function"] == function and values["clip"] == 0.01
        assert values["algorithm"] == ("pcdp-sgd" if projection == "pre-projection"
                                       else "dp-sgd")
        assert values["noise-multiplier"] == {"mnist": 22.0, "fashion-mnist": 18.0}[dataset]
        assert "num_validation=5000" in values["dataset-options"]


@pytest.mark.smoke
def test_the_smoke_run_tables_each_variant_and_the_projections_verdict(tmp_path):
    from dpfl.cli import main

    assert main(["reproduce", "pcdp", "clipping-functions", "--smoke", "--results-dir",
                 str(tmp_path)]) == 0
    report = (tmp_path / "reproduce-pcdp-clipping-functions-smoke" / "report.md").read_text()
    for text in ("## Protocol", "| mnist | Auto-S | none |", "| mnist | Auto-S | pre-projection |",
                 "Does pre-projection enhance each clipping function?", "dpfl run --run-config"):
        assert text in report, text
