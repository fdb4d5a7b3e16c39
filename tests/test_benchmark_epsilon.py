"""The matched-ε benchmark: every algorithm's equal search budget, the proxies' noise, the
selection that never reads the test set, the options a user narrows it with, its figure's panels,
and the smoke run."""

from __future__ import annotations

import csv
import statistics

import matplotlib.pyplot as plt
import numpy as np
import pytest

from dpfl import problem
from dpfl.algorithms import ALGORITHMS
from dpfl.config import parse_options
from dpfl.errors import UsageError
from dpfl_reproductions.benchmark import (
    EXCLUDED,
    FAMILIES,
    GRIDS,
    ROUNDS,
    RANKING,
    Setting,
    algorithms,
    plan_of,
)
from dpfl_reproductions.family_figure import OTHER, family_figure
from dpfl_reproductions.lab import Lab
from dpfl.runconfig import RunConfig


def test_every_algorithm_but_the_ablation_gets_the_same_budget_of_valid_configurations(tmp_path):
    assert set(algorithms()) == set(ALGORITHMS) - set(EXCLUDED) == set(GRIDS)
    plan = plan_of(Lab(tmp_path, smoke=False))
    for algorithm in algorithms():
        points = plan.points(algorithm)
        assert len(points) == 16 and len({tuple(sorted(p.items())) for p in points}) == 16
        config = plan.config((Setting("mnist", "silo-dirichlet"), algorithm, 2.0), points[0], 0)
        RunConfig(config)  # every key given: no "auto" left to defaults
        assert config["calibration"] == "accountant" and config["delta"] == 1e-5
        assert "num_validation=5000" in config["dataset-options"]


def test_a_proxy_stops_early_with_the_noise_of_the_full_run(tmp_path):
    plan = plan_of(Lab(tmp_path, smoke=False))
    cell = (Setting("mnist", "silo-iid"), "dp-sgd", 4.0)
    proxy = plan.config(cell, plan.points("dp-sgd")[0], 0, share=4)
    assert (proxy["num-server-rounds"], proxy["calibration-rounds"]) == (ROUNDS // 4, ROUNDS)
    assert proxy["eval-every"] == ROUNDS // 4  # evaluated once, at its end


def test_the_selection_ranks_by_validation_never_by_test():
    good = {"validation_accuracy": 0.9, "validation_loss": 0.3, "test_accuracy": 0.1,
            "test_loss": 3.0}
    bad = {"validation_accuracy": 0.5, "validation_loss": 1.0, "test_accuracy": 0.99,
           "test_loss": 0.1}
    assert RANKING.key([good]) < RANKING.key([bad])
    tie = {**good, "validation_loss": 0.2}
    assert RANKING.key([tie]) < RANKING.key([good])  # the lower validation loss breaks a tie


def test_a_user_narrows_it_to_their_dataset_and_epsilons(tmp_path):
    plan = plan_of(Lab(tmp_path, smoke=False, only={"dataset": ["digits"],
                                                    "epsilon": ["3", "0.5"],
                                                    "federation": ["silo-iid"]}))
    assert plan.settings == (Setting("digits", "silo-iid"),) and plan.epsilons == (3.0, 0.5)
    # a small dataset keeps nine tenths to train on: digits has 1,437 training images
    config = plan.config((plan.settings[0], "pcdp-sgd", 3.0), plan.points("pcdp-sgd")[0], 1)
    assert config["dataset-options"] == "num_public=100 num_validation=143"
    for only, message in (({"dataset": ["imagenet"]}, "unknown dataset 'imagenet'"),
                          ({"dataset": ["npz"]}, "or FILE.npz"),
                          ({"dataset": [str(tmp_path / "absent.npz")]}, "is not a file"),
                          ({"epsilon": ["x"]}, "numbers > 0"),
                          ({"epsilon": ["-1"]}, "numbers > 0"),
                          ({"federation": ["device"]}, "allowed: silo-iid, silo-dirichlet")):
        with pytest.raises(UsageError, match=message):
            plan_of(Lab(tmp_path, smoke=False, only=only))


def test_a_user_runs_it_on_their_own_arrays(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mine.npz", train_x=rng.normal(size=(600, 5)),
             train_y=rng.integers(0, 2, 600), test_x=rng.normal(size=(50, 5)),
             test_y=rng.integers(0, 2, 50))
    monkeypatch.chdir(tmp_path)  # a path on the command line is the user's, made absolute
    plan = plan_of(Lab(tmp_path, smoke=False, only={"dataset": ["mine.npz"],
                                                    "federation": ["silo-iid"]}))
    setting = Setting("npz", "silo-iid", str(tmp_path / "mine.npz"))
    assert plan.settings == (setting,) and setting.name == "mine"
    config = plan.config((setting, "dp-sgd", 2.0), plan.points("dp-sgd")[0], 1)
    assert config["dataset"] == "npz"
    assert parse_options(config["dataset-options"]) == {"path": str(tmp_path / "mine.npz"),
                                                        "num_validation": 60}
    dataset = problem.dataset_of(RunConfig(config))
    assert (dataset.num_validation, dataset.num_train) == (60, 540)
    # a file placed in the data folder, as docs/data.md says, is found from any folder too
    monkeypatch.setenv("DPFL_DATA_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)
    assert plan_of(Lab(tmp_path, smoke=False, only={"dataset": ["mine.npz"], "federation": [
        "silo-iid"]})).settings == (setting,)


def test_every_algorithm_has_one_family_in_the_figure():
    members = [a for family in FAMILIES.values() for a in family]
    assert sorted(members) == sorted(ALGORITHMS)


@pytest.mark.filterwarnings("error")
def test_the_figure_draws_a_panel_per_family_present_each_line_labelled(tmp_path):
    epsilons = (1.0, 4.0)
    accuracies = {"prisma": [[70, 72, 71], [80, 81, 82]], "dpsgd-gc": [[75, 76, 74], [84, 85, 83]],
                  "clip21-sgd": [[10, 11, 9], [12, 10, 11]],  # at chance: below the axis
                  "dp-sgd": [[85, 86, 84], [89, 90, 88]], "mine": [[60, 61, 62], [70, 70, 70]]}
    fig = family_figure("a title", epsilons, accuracies, FAMILIES)
    try:
        assert [ax.get_title() for ax in fig.axes] == [
            "PriSMA family", "Clip21 family", "DP-SGD baselines", OTHER]
        assert [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes] == [
            ["prisma", "dpsgd-gc"], ["clip21-sgd (↓ 10–11%)"], ["dp-sgd"], ["mine"]]
        for ax in fig.axes:
            assert ax.get_xscale() == "log" and list(ax.get_xticks()) == list(epsilons)
            assert ax.get_ylim() == (55.0, 95.0)  # shared, zoomed to those that learn
            assert list(ax.lines[0].get_ydata()) == [85, 89]  # the best of any family
        fig.savefig(tmp_path / "figure.png")
    finally:
        plt.close(fig)


@pytest.mark.smoke
def test_the_smoke_benchmark_tables_every_epsilon_and_lists_every_configuration(tmp_path,
                                                                               capsys):
    from dpfl.cli import main

    assert main(["reproduce", "benchmark", "epsilon", "--smoke", "--results-dir",
                 str(tmp_path)]) == 0
    assert "benchmark/epsilon: ≈" in capsys.readouterr().out
    folder = tmp_path / "reproduce-benchmark-epsilon-smoke"
    report = (folder / "report.md").read_text()
    for text in ("## Protocol", "Cost estimate", "| algorithm | ε = 2 | ε = 8 |", "**",
                 "the selected points", "dpfl run --run-config", "configurations.csv"):
        assert text in report, text
    assert (folder / "accuracy-digits-silo-iid.png").stat().st_size > 0
    with open(folder / "configurations.csv") as f:
        rows = list(csv.DictReader(f))
    # per cell: 4 points at 1/4, 4 at 1/2 (all survive), 2 at full length, and the
    # confirmation's 4 (the quarter rung's best 4, the neighbour's winner among them);
    # 2 algorithms × 2 ε
    assert len(rows) == 4 * (4 + 4 + 2 + 4)
    assert {r["rounds share"] for r in rows} == {"1/4", "1/2", "1/1", "1/1, confirmation"}


def test_auto_defaults_follow_the_runs_epsilon_to_the_nearest_benchmarked_one(monkeypatch):
    from dpfl.algorithms import tuned

    points = {"dp-sgd": {1.0: {"learning-rate": 0.5, "clip": 0.2},
                         4.0: {"learning-rate": 2.5, "clip": 0.7}}}
    assert tuned.tuned_value("dp-sgd", "clip", 1.9, points) == 0.2  # log-nearer to 1 than 4
    assert tuned.tuned_value("dp-sgd", "clip", 2.0, points) == 0.2  # a tie: the smaller ε
    assert tuned.tuned_value("dp-sgd", "clip", 2.1, points) == 0.7
    assert tuned.tuned_value("dp-sgd", "beta-hat", 2.0, points) is None
    assert tuned.tuned_value("prisma", "clip", 2.0, points) is None
    monkeypatch.setattr(tuned, "POINTS", points)
    assert RunConfig({"algorithm": "dp-sgd", "epsilon": 8})["learning-rate"] == 2.5
    assert RunConfig({"algorithm": "dp-sgd", "epsilon": 1})["clip"] == 0.2
    assert RunConfig({"algorithm": "dp-sgd", "epsilon": 1, "clip": 3})["clip"] == 3  # given wins
    assert RunConfig({"algorithm": "prisma", "epsilon": 1})["clip"] == 1.0  # not benchmarked
    # a given noise multiplier leaves no target ε: the algorithm's own defaults
    assert RunConfig({"algorithm": "dp-sgd", "epsilon": 8, "noise-multiplier": 1.0})[
        "learning-rate"] == ALGORITHMS.get("dp-sgd").defaults.get("learning-rate", 2.0)


def test_clients_needed_reads_the_first_count_that_learns_else_extrapolates():
    from dpfl_reproductions.benchmark import clients_needed

    assert clients_needed([10, 100, 1000], [10.0, 80.0, 90.0], 75.0) == 100
    # 10 points a decade from 20% at 10 clients: 60% at 10^5
    assert clients_needed([10, 100, 1000], [20.0, 30.0, 40.0], 60.0) == pytest.approx(1e5)
    assert clients_needed([10, 100, 1000], [15.0, 14.0, 15.0], 60.0) is None


def test_the_clients_experiment_runs_each_family_at_its_benchmarked_point(monkeypatch):
    from dpfl.algorithms import tuned
    from dpfl_reproductions.benchmark import GRIDS, selected_point

    monkeypatch.setattr(tuned, "POINTS", {})
    with pytest.raises(UsageError, match="clip21-sgd2m has no benchmarked"):
        selected_point("clip21-sgd2m", 8.0)
    monkeypatch.setattr(tuned, "POINTS", {"clip21-sgd2m": {
        8.0: {"learning-rate": 0.01, "clip": 0.1, "momentum": 0.9}}})
    assert selected_point("clip21-sgd2m", 6.0) == {"learning-rate": 0.01, "clip": 0.1}
    assert set(selected_point("clip21-sgd2m", 6.0)) == set(GRIDS["clip21-sgd2m"])
    # on a benchmarked dataset its own IID table's point
    fashion = tuned.SETTINGS[("fashion-mnist", "iid")]["dp-sgd"][2.0]
    assert selected_point("dp-sgd", 2.0, "fashion-mnist") == fashion


@pytest.mark.smoke
def test_the_smoke_clients_experiment_tables_accuracy_and_clients_needed(tmp_path, monkeypatch):
    from dpfl.algorithms import tuned
    from dpfl.cli import main
    from dpfl_reproductions.benchmark import GRIDS, REFERENCE

    points = {a: {e: {k: v[len(v) // 2] for k, v in GRIDS[a].items()} for e in (1.0, 8.0)}
              for a in ("clip21-sgd2m", "dp-fedavg-quantile", REFERENCE)}
    monkeypatch.setattr(tuned, "POINTS", points)
    assert main(["reproduce", "benchmark", "clients", "--smoke", "--results-dir",
                 str(tmp_path)]) == 0
    report = (tmp_path / "reproduce-benchmark-clients-smoke" / "report.md").read_text()
    for text in ("## Protocol", "| algorithm | n = 4, ε = 1 | n = 8, ε = 1 |",
                 "clients needed to come within 5 points", "| clip21-sgd2m |"):
        assert text in report, text
    # without the reference in the run there is nothing to come within: '–'
    assert main(["reproduce", "benchmark", "clients", "--smoke", "--only",
                 "algorithm=clip21-sgd2m", "--results-dir", str(tmp_path / "alone")]) == 0
    alone = next((tmp_path / "alone").glob("*/report.md")).read_text()
    assert "| clip21-sgd2m | – | – |" in alone


def test_the_clients_experiment_runs_three_seeds_and_the_archive_holds_the_first(capsys,
                                                                                 tmp_path):
    """Every cell on seeds 1, 2, 3 (the verdict rule's three): the committed report's archive
    holds seed 1's 36 runs, so a plan over it has the other 72 to do."""
    from dpfl.cli import main
    from tests.conftest import ROOT

    archive = ROOT / "reports" / "benchmark-clients" / "runs.jsonl.gz"
    assert main(["reproduce", "benchmark", "clients", "--plan", "--results-dir", str(tmp_path),
                 "--reuse", str(archive)]) == 0
    assert "72 of its 108 runs" in capsys.readouterr().out


def test_an_extrapolation_far_past_the_measured_counts_gives_its_order_of_magnitude_only():
    from dpfl_reproductions.benchmark import needed_text

    assert needed_text(100.0, 1000) == "100"
    assert needed_text(5000.0, 1000) == "5,000 (extrapolated)"
    assert needed_text(1.05e10, 1000) == "~10^10 (extrapolated far past 1,000)"
    assert needed_text(None, 1000) == "–"


@pytest.mark.parametrize("report, table, setting", [
    ("benchmark-epsilon", "mnist silo-iid", None),
    ("benchmark-epsilon", "mnist silo-dirichlet", ("mnist", "dirichlet")),
    ("benchmark-epsilon-fashion-mnist", "fashion-mnist silo-iid", ("fashion-mnist", "iid")),
])
def test_the_committed_points_are_the_benchmark_reports_selection(report, table, setting):
    """tuned.POINTS is reports/benchmark-epsilon/selected.json's MNIST cross-silo IID table and
    tuned.SETTINGS the other benchmarked tables, every value a point of the algorithm's
    benchmark grid, so that a run at a benchmarked ε in a benchmarked setting starts where the
    benchmark's selection ended."""
    import json
    from pathlib import Path

    from dpfl.algorithms import tuned

    folder = Path(__file__).resolve().parents[1] / "reports" / report
    selected = json.loads((folder / "selected.json").read_text())[table]
    points = tuned.POINTS if setting is None else tuned.SETTINGS[setting]
    assert {a: {float(e): p for e, p in by.items()} for a, by in selected.items()} == points
    dataset, partitioner = setting or ("mnist", "iid")
    for algorithm, by_epsilon in points.items():
        for point in by_epsilon.values():
            for key, value in point.items():
                assert value in GRIDS[algorithm].get(key, (value,)), (algorithm, key, value)
        for epsilon, point in by_epsilon.items():
            config = RunConfig({"algorithm": algorithm, "epsilon": epsilon, "dataset": dataset,
                                "partitioner": partitioner})
            assert all(config[k] == v for k, v in point.items()), (algorithm, epsilon)


def test_a_run_outside_the_benchmarked_settings_takes_mnist_iids_points():
    from dpfl.algorithms import tuned

    iid = tuned.POINTS["dp-fedavg"][2.0]
    assert tuned.SETTINGS[("fashion-mnist", "iid")]["dp-fedavg"][2.0] != iid  # they differ here
    for dataset, partitioner in (("digits", "iid"), ("fashion-mnist", "dirichlet"),
                                 ("mnist", "shards"), ("cifar10", "iid")):
        config = RunConfig({"algorithm": "dp-fedavg", "epsilon": 2, "dataset": dataset,
                            "partitioner": partitioner})
        assert {k: config[k] for k in iid} == iid


def test_a_point_a_proxy_rung_cut_is_confirmed_at_full_length():
    """The review's case: the point best at full length ranks third at the quarter rung and is
    cut at the half rung; the confirmation reruns the quarter rung's best 4 and the
    neighbouring ε's winner at full length, and selects it."""
    from dpfl_reproductions.selection import confirmation, halving, top

    def summary(point, rounds):  # validation accuracy by point and length
        proxy = {"a": 0.9, "b": 0.8, "c": 0.7, "d": 0.6, "e": 0.5, "f": 0.4}[point["p"]]
        full = {"a": 0.85, "b": 0.84, "c": 0.95, "d": 0.5, "e": 0.5, "f": 0.99}[point["p"]]
        value = full if rounds == 8 else proxy
        return {"validation_accuracy": value, "validation_loss": 1 - value}

    ran: list[dict] = []

    def run_many(configs):
        ran.extend(configs)
        return [summary(c, c["rounds"]) for c in configs]

    points = [{"p": p} for p in "abcdef"]
    cells = {("s", "x", 1.0): points, ("s", "x", 2.0): points[:2]}
    rungs = halving(run_many, cells, [(4, top(4)), (2, top(2)), (1, top(1))],
                    lambda cell, p, share: {**p, "rounds": 8 // share}, RANKING)
    assert rungs[("s", "x", 1.0)][-1].ranked[0][0] == {"p": "a"}  # halving alone keeps a
    final = confirmation(run_many, rungs, {("s", "x", 2.0): [{"p": "c"}]},
                         lambda cell, p: {**p, "rounds": 8}, RANKING, 4)
    chosen = final[("s", "x", 1.0)]
    assert chosen.ranked[0][0] == {"p": "c"}  # cut at the half rung, best at full length
    assert [p for p, _ in chosen.runs] == [{"p": "a"}, {"p": "b"}, {"p": "c"}, {"p": "d"}]
    assert final[("s", "x", 2.0)].ranked[0][0] == {"p": "c"}  # the neighbour's point, added
    assert {"p": "f", "rounds": 8} not in ran  # beyond the quarter rung's best 4: never rerun



def test_seeds_that_cannot_separate_an_algorithm_from_the_best_get_a_second_stage(tmp_path):
    """Seeds 1–3 leave B tied with A (the best) and C below both: seeds 4–10 run for A and B
    alone, once; the table reads every seed each ran (⁺), and B, 0.6 points below A on every
    new seed, is no longer a tie. Seeds chosen with ``--only seed`` get no second stage."""
    from dpfl_reproductions.benchmark import Plan, report_setting, seed_runs, unseparated

    spread = {1: 0.0, 2: 1.0, 3: 2.0, 4: 0.5, 5: 1.5, 6: 0.2, 7: 0.8, 8: 1.2, 9: 1.8, 10: 1.1}
    below = {1: 0.4, 2: -0.4, 3: 0.1, **dict.fromkeys(range(4, 11), 0.6)}  # A − B by seed
    accuracy = {"a": lambda s: 80 + spread[s], "b": lambda s: 80 + spread[s] - below[s],
                "c": lambda s: 70 + spread[s]}

    class Stood(Plan):  # a run's configuration: its algorithm and seed; a grid of one point
        def config(self, cell, point, seed, share=1):
            return {"algorithm": cell[1], "seed": seed}

        def points(self, algorithm):
            return [{"learning-rate": 0.1}]

    def lab_of(folder, only=None):
        lab = Lab(folder, smoke=False, only=only)
        lab.asked = []

        def run_many(configs, **_):
            lab.asked.extend(configs)
            return [{"test_accuracy": accuracy[c["algorithm"]](c["seed"]) / 100}
                    for c in configs]

        lab.run_many = run_many
        return lab

    setting = Setting("digits", "silo-iid")
    plan = Stood((setting,), ("a", "b", "c"), (1.0,), (1, 2, 3), 4, 100, smoke=False)
    chosen = {(setting, a, 1.0): {"learning-rate": 0.1} for a in "abc"}
    lab = lab_of(tmp_path / "full")
    results = seed_runs(lab, plan, chosen)
    assert plan.second_seeds() == tuple(range(4, 11))
    assert sorted((c["algorithm"], c["seed"]) for c in lab.asked) == sorted(
        [(a, s) for a in "abc" for s in (1, 2, 3)] + [(a, s) for a in "ab" for s in range(4, 11)])
    assert [len(results[(setting, a, 1.0)]) for a in "abc"] == [10, 10, 3]
    assert unseparated(plan, {cell: runs[:3] for cell, runs in results.items()}) == [
        (setting, "a", 1.0), (setting, "b", 1.0)]
    assert unseparated(plan, results) == []
    report_setting(lab, plan, setting, chosen, results)
    rows = {cells[0]: cells[1] for cells in (
        [c.strip() for c in line.strip("|").split("|")]
        for line in lab.sections[0].splitlines() if line.startswith("| "))}

    def shown(algorithm, seeds):
        values = [accuracy[algorithm](s) for s in seeds]
        return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"

    assert rows["a"] == f"**{shown('a', range(1, 11))}⁺**"
    assert rows["b"] == f"{shown('b', range(1, 11))}⁺"
    assert rows["c"] == shown("c", (1, 2, 3))  # below A on the three seeds both ran: no tie

    only = lab_of(tmp_path / "only", only={"seed": ["1", "2", "3"]})
    assert [len(runs) for runs in seed_runs(only, plan, chosen).values()] == [3, 3, 3]


def test_a_paired_interval_over_common_seeds_reads_the_seeds_both_ran():
    from dpfl_reproductions.selection import paired

    longer, shorter = [3.0, 1.0, 2.0, 9.0, 9.0], [1.0, 0.0, 0.0]
    assert paired(longer, shorter, common=True) == paired(longer[:3], shorter)
    with pytest.raises(ValueError):
        paired(longer, shorter)
