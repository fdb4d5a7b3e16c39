"""``dpfl reproduce benchmark cross-device``: its plan (the populations, each method's keys, the
user-level δ = 1/n, the stateful method kept to a population it can hold) and the smoke run's
report."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpfl.runconfig import RunConfig
from dpfl_reproductions.cross_device import (
    EAGER_UP_TO,
    FEWEST_RECORDS,
    GRIDS,
    METHODS,
    plan_of,
)
from dpfl_reproductions.lab import Lab


def test_the_plan_runs_every_method_at_every_population_it_can_hold(tmp_path):
    plan = plan_of(Lab(tmp_path, smoke=False))
    cells = plan.cells()
    assert {s.federation for s, _, _ in cells} == {"population-10k", "population-1m"}
    assert {m for _, m, _ in cells} == set(METHODS)
    assert {e for _, _, e in cells} == {1.0, 2.0, 4.0, 8.0}
    # clip21-sgd2m keeps a state on each client: over 10⁴ clients, not 10⁶
    assert {plan.size(s) for s, m, _ in cells if m == "clip21-sgd2m"} == {10_000}
    assert len(cells) == 2 * 4 * len(METHODS) - 4
    assert all(len(plan.points(m)) == 16 for m in METHODS)  # the same search for each
    assert set(GRIDS) == set(METHODS)


@pytest.mark.parametrize("method", list(METHODS))
def test_each_methods_run_is_a_valid_configuration_of_its_keys(tmp_path, method):
    plan = plan_of(Lab(tmp_path, smoke=False))
    for setting, m, epsilon in plan.cells():
        if m != method:
            continue
        n = plan.size(setting)
        config = plan.config((setting, m, epsilon), plan.points(m)[0], 1, share=4)
        values = RunConfig({**config, "results-dir": str(tmp_path)})
        assert values["delta"] == 1.0 / n and values["num-partitions"] == n
        assert values["fraction-train"] * n == pytest.approx(100)
        assert values["num-server-rounds"] == 75 and values["calibration-rounds"] == 300
        assert ("lazy=true" in config["dataset-options"]) == (n > EAGER_UP_TO or
                                                               m != "clip21-sgd2m")
        assert "iid=true" in config["dataset-options"]
        for key, value in METHODS[method].items():
            assert values[key] == value
        record_level = m in ("clip21-sgd2m", "dp-sgd")
        assert values["min-client-records"] == (FEWEST_RECORDS if record_level else 0)


def test_the_fewest_records_bound_is_the_populations_smallest_client():
    from dpfl.datasets import load_dataset

    population = load_dataset("leaf-synthetic", seed=0, num_clients=10, lazy=True, iid=True,
                              validation_fraction=0.1).population
    assert population.smallest == FEWEST_RECORDS


def test_only_restricts_populations_methods_and_epsilons(tmp_path):
    plan = plan_of(Lab(tmp_path, smoke=False, only={"population": ["population-10k"],
                                                     "method": ["dp-ftrl-tree"],
                                                     "epsilon": ["2"]}))
    assert [(s.federation, m, e) for s, m, e in plan.cells()] == [
        ("population-10k", "dp-ftrl-tree", 2.0)]


@pytest.mark.smoke
def test_the_smoke_cross_device_benchmark_tables_every_epsilon(tmp_path, capsys):
    from dpfl.cli import main

    assert main(["reproduce", "benchmark", "cross-device", "--smoke", "--results-dir",
                 str(tmp_path)]) == 0
    assert "benchmark/cross-device: ≈" in capsys.readouterr().out
    folder = Path(tmp_path) / "reproduce-benchmark-cross-device-smoke"
    report = (folder / "report.md").read_text()
    for text in ("## Protocol", "Cost estimate", "| algorithm | ε = 2 | ε = 8 |",
                 "| dp-ftrl-banded-poisson |", "the selected points", "configurations.csv"):
        assert text in report, text
    assert (folder / "accuracy-leaf-synthetic-population-200.png").stat().st_size > 0
    with open(folder / "configurations.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * (4 + 4 + 2 + 4)
