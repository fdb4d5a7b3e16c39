"""``dpfl reproduce clip21 mnist-dp-validated``: Table 1 (MLP) with the same search for every
method, selected on validation — the draws, the runs, and the smoke run's verdict table."""

from __future__ import annotations

import pytest

from dpfl.runconfig import RunConfig
from dpfl_reproductions.clip21 import MNIST_GRIDS
from dpfl_reproductions.clip21_validated import POINTS, drawn, plan_of
from dpfl_reproductions.lab import Lab


def test_every_method_searches_the_same_number_of_points_of_its_own_grid(tmp_path):
    plan = plan_of(Lab(tmp_path, smoke=False))
    assert set(plan.algorithms) == set(MNIST_GRIDS) and plan.rounds == 150 * 37
    for method, grid in MNIST_GRIDS.items():
        points = plan.points(method)
        assert len(points) == POINTS
        assert all(p in grid for p in points)
        assert drawn(method, grid) == drawn(method, grid)  # a fixed draw
        values = RunConfig({**plan.config((plan.settings[0], method, 3.0), points[0], 1, 4),
                            "results-dir": str(tmp_path)})
        assert values["calibration"] == "practice" and values["practice-horizon"] == "epochs"
        assert values["calibration-rounds"] == plan.rounds
        assert "num_validation=5000" in values["dataset-options"]
    assert len({tuple(sorted(p.items())) for p in plan.points("clip21-sgd2m")}) == POINTS


@pytest.mark.smoke
def test_the_smoke_run_decides_the_best_method_per_epsilon(tmp_path):
    from dpfl.cli import main

    assert main(["reproduce", "clip21", "mnist-dp-validated", "--smoke", "--results-dir",
                 str(tmp_path)]) == 0
    report = next(tmp_path.glob("*/report.md")).read_text()
    for text in ("## Protocol", "Is Clip21-SGD2M the best method?", "| ε | clip-sgd | verdict |"):
        assert text in report, text
