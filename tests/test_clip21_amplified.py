"""``dpfl reproduce clip21 amplified`` (the Clip21 paper's E5): both methods' runs and grids, and
the smoke run's verdict table."""

from __future__ import annotations

import pytest

from dpfl.runconfig import RunConfig
from dpfl_reproductions.clip21_amplified import ROUNDS, plan_of
from dpfl_reproductions.lab import Lab


def test_both_methods_clip_each_example_on_e3s_federation_with_the_papers_grid(tmp_path):
    plan = plan_of(Lab(tmp_path, smoke=False))
    assert ROUNDS == 150 * 75 and plan.epsilons == (3.0, 9.0, 27.0)
    for method in plan.algorithms:
        points = plan.points(method)
        assert len(points) == 20  # τ_out × γ, the same for both
        cell = (plan.settings[0], method, 9.0)
        values = RunConfig({**plan.config(cell, points[0], 1, share=4),
                            "results-dir": str(tmp_path)})
        assert (values["num-partitions"], values["batch-size"], values["delta"]) == (25, 32,
                                                                                     1e-3)
        assert values["calibration"] == "accountant" and values["calibration-rounds"] == ROUNDS
        assert values["num-server-rounds"] == ROUNDS // 4
        if method == "clip-sgd":
            assert values["clipping"] == "per-sample"
        else:
            assert (values["clip-inner"], values["beta"], values["beta-hat"]) == (0.1, 0.1, 0.01)


@pytest.mark.smoke
def test_the_smoke_run_decides_competitiveness_per_epsilon(tmp_path):
    from dpfl.cli import main

    assert main(["reproduce", "clip21", "amplified", "--smoke", "--results-dir",
                 str(tmp_path)]) == 0
    report = (tmp_path / "reproduce-clip21-amplified-smoke" / "report.md").read_text()
    for text in ("## Protocol", "| clip21-sgd2m-plus |", "Is Clip21-SGD2M+ competitive",
                 "| ε | mean difference | interval | verdict |"):
        assert text in report, text
