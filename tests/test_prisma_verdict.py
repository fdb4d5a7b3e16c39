"""PriSMA's Figure 1 decided: the verdict rules, the extended grid, the pairing of trials, the
accountant arm's noise, and the smoke reproduction."""

from __future__ import annotations

import gzip
import json

import pytest

from dpfl import cli
from dpfl_reproductions import least_squares
from dpfl_reproductions.lab import ARCHIVE
from dpfl_reproductions.prisma import AXES, accountant_epsilon, config_of
from dpfl_reproductions.prisma_verdict import (
    EXTRA,
    MARGIN,
    THEORY_GAP,
    claim_below,
    claim_faster,
    extended,
    per_n,
    pool,
    trial_slopes,
)
from dpfl_reproductions.selection import Paired, Runner, paired

POINT = {"learning-rate": 0.001, "clip": 5.0, "gamma": 0.05, "clip-diff": 0.005,
         "num-server-rounds": 40}


def _interval(low, high):
    return Paired((), (low + high) / 2, low, high)


def test_the_extended_grid_keeps_the_papers_and_walks_past_its_edges():
    axes = extended(AXES, EXTRA)
    for method, paper in AXES.items():
        for key, values in paper.items():
            assert set(values) <= set(axes[method][key])
            assert list(axes[method][key]) == sorted(axes[method][key])
    assert min(axes["prisma"]["learning-rate"]) < 0.001 < max(axes["prisma"]["learning-rate"])
    assert min(axes["prisma"]["clip-diff"]) < 0.005 and max(axes["prisma"]["gamma"]) > 0.05
    assert min(axes["dpsgd-gc"]["clip"]) < 5.0
    assert "gamma" not in axes["dpsgd-gc"]  # a method keeps its own axes


def test_each_n_is_read_from_its_paired_interval():
    assert per_n(_interval(-0.02, -0.01), 0.1) == "PriSMA lower"
    assert per_n(_interval(0.001, 0.002), 0.1) == "DPSGD-GC lower"
    inside = MARGIN * 0.1 * 0.9
    assert per_n(_interval(-inside, inside), 0.1).startswith("equivalent")
    assert per_n(_interval(-0.02, 0.001), 0.1) == "undecided"  # wider than the margin
    assert per_n(Paired((1.0,), 1.0, float("nan"), float("nan")), 0.1) == "undecided"


def test_claim_one_needs_prisma_lower_at_every_n_and_falls_at_one_tie_or_loss():
    assert claim_below(["PriSMA lower"] * 6) == "confirmed"
    assert claim_below(["PriSMA lower"] * 5 + ["DPSGD-GC lower"]) == "refuted"
    assert claim_below(["PriSMA lower"] * 5 + ["equivalent (±5%)"]) == "refuted"
    assert claim_below(["PriSMA lower"] * 5 + ["undecided"]) == "undecided"


def test_claim_two_is_measured_against_the_theorys_gap_of_one_fifteenth():
    assert THEORY_GAP == pytest.approx(1 / 15)
    assert claim_faster(_interval(-0.3, -0.1)) == "confirmed"
    assert claim_faster(_interval(-0.05, 0.02)) == "refuted"
    assert claim_faster(_interval(-0.05, -0.01)) == "refuted"  # steeper, by less than 1/15
    assert claim_faster(_interval(-0.1, -0.03)) == "undecided"


def test_a_trials_slope_is_fitted_to_its_own_curve_over_n():
    sizes = [2000, 4000, 8000]
    runs = {("prisma", n): [{"derived": {"grad_norm": k * n ** -0.5}} for k in (1.0, 2.0)]
            for n in sizes}
    runs |= {("dpsgd-gc", n): [{"derived": {"grad_norm": k * n ** -0.25}} for k in (1.0, 3.0)]
             for n in sizes}
    ours, theirs = (trial_slopes(sizes, runs, m, "final") for m in ("prisma", "dpsgd-gc"))
    assert ours == pytest.approx([-0.5, -0.5]) and theirs == pytest.approx([-0.25, -0.25])
    assert paired(ours, theirs).mean == pytest.approx(-0.25)


def test_a_trial_pairs_the_methods_on_one_dataset_and_one_stream_of_normals(tmp_path):
    """Seed s gives both methods (and every N) the same base data; the same configuration with
    another seed draws other data."""
    from dpfl.problem import dataset_of
    from dpfl.runconfig import RunConfig

    def rows(method, size, seed):
        ds = dataset_of(RunConfig(config_of(method, POINT if method == "prisma" else
                                            {k: POINT[k] for k in ("learning-rate", "clip",
                                                                   "num-server-rounds")},
                                            size, seed)))
        return ds.train_x[:2000], ds.train_y[:2000]

    a, b = rows("prisma", 2000, 100), rows("dpsgd-gc", 4000, 100)
    assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
    assert not (rows("prisma", 2000, 101)[0] == a[0]).all()


def test_the_accountant_arm_spends_the_target_and_theorem_3_does_not():
    paper = config_of("prisma", POINT, 2000, 0)
    ours = config_of("prisma", POINT, 2000, 0, "accountant")
    assert accountant_epsilon(ours) == pytest.approx(1.0, abs=0.01)
    assert accountant_epsilon(paper) < 0.5
    results = [least_squares.simulate([c], fused=False)[0] for c in (paper, ours)]
    assert results[0]["derived"] != results[1]["derived"]  # the noise differs, so do the iterates


class StandInFigure:
    """The part of a ``Figure1`` that :func:`pool` uses, its trials' runner: runs answered from
    ``scores`` (learning rate -> {seed: (final, mean)})."""

    def __init__(self, scores):
        self.scores, self.ran = scores, []
        self.trials = Runner(lambda cell, point, seed: {**point, "seed": seed}, self.run)

    def run(self, configs):
        self.ran += configs
        return [{"derived": dict(zip(("grad_norm", "grad_norm_mean"),
                                     self.scores[c["learning-rate"]][c["seed"]], strict=True))}
                for c in configs]


def test_the_pooled_selection_takes_the_lowest_tuning_mean_among_both_metrics_confirmations():
    """Each metric's confirmation ran one point per T; pooled, the final iterate takes the
    point the running mean's confirmation found, whose tuning mean is lower than the winner
    of its own metric's seed-0 search."""
    def point(lr, rounds):
        return {"learning-rate": lr, "clip": 5.0, "num-server-rounds": rounds}

    seeds = range(5)
    scores = {0.001: {s: (0.30 if s else 0.05, 0.9) for s in seeds},  # lucky at seed 0 only
              0.01: {s: (0.20, 0.5) for s in seeds},
              0.002: {s: (0.25, 0.7) for s in seeds}}
    cell = ("dpsgd-gc", 2000)
    confirmed = {"final": {cell: {2000: (point(0.001, 2000), []),
                                  4000: (point(0.002, 4000), [])}},
                 "mean": {cell: {2000: (point(0.01, 2000), []),
                                 4000: (point(0.002, 4000), [])}}}
    fig = StandInFigure(scores)
    chosen, tuning = pool(fig, confirmed, "final")[cell]
    assert chosen == point(0.01, 2000)
    assert [run["derived"]["grad_norm"] for run in tuning] == [0.20] * 5
    assert len(fig.ran) == 3 * 5  # the three distinct points once each, on every tuning seed
    assert pool(StandInFigure(scores), confirmed, "mean")[cell][0] == point(0.01, 2000)


@pytest.mark.smoke
def test_the_smoke_verdict_reports_both_claims_for_both_arms_and_metrics(tmp_path, capsys):
    assert cli.main(["reproduce", "prisma", "least-squares-verdict", "--smoke",
                     "--results-dir", str(tmp_path)]) == 0
    assert "least-squares-verdict: ≈" in capsys.readouterr().out  # the estimate, first
    folder = tmp_path / "reproduce-prisma-least-squares-verdict-smoke"
    report = (folder / "report.md").read_text()
    for text in ("Cost estimate", "## Verdicts", "The two claims, by noise, selection and metric",
                 "## Noise: paper", "## Noise: accountant", "outside the paper's grid",
                 "PriSMA − DPSGD-GC, 95% interval", "dpfl run --run-config"):
        assert text in report
    table = report.split("### The two claims")[1].split("##")[0]
    for arm in ("paper", "accountant"):  # both selections under both metrics
        assert table.count(f"| {arm} | protocol |") == 2
        assert table.count(f"| {arm} | pooled |") == 2
        for metric in ("final", "mean"):
            for suffix in ("", "-pooled"):
                assert (folder / f"figure1-{arm}-{metric}{suffix}.png").stat().st_size > 0
    with gzip.open(folder / ARCHIVE, "rt") as f:
        runs = [json.loads(line) for line in f]
    assert {r["config"]["calibration"] for r in runs} == {"paper", "accountant"}
    assert {r["config"]["seed"] for r in runs} >= {100, 101, 102}


def test_a_search_over_several_seeds_ranks_every_point_on_its_mean():
    """``Search`` with seeds (0, 1, 2): each point runs at every seed, and the best is the best
    mean, not seed 0's winner."""
    from dpfl_reproductions.selection import Ranking, Runner, Search

    norms = {("a", 0): 1.0, ("a", 1): 9.0, ("a", 2): 9.0,  # wins seed 0 by luck
             ("b", 0): 2.0, ("b", 1): 2.0, ("b", 2): 2.0}
    asked = []

    def run_many(configs):
        asked.extend(configs)
        return [{"norm": norms[(c["name"], c["seed"])]} for c in configs]

    runner = Runner(lambda cell, point, seed: {**point, "seed": seed}, run_many)
    lowest = Ranking(lambda summary: summary["norm"])
    one, three = Search(runner, (0,)), Search(runner, (0, 1, 2))
    for search in (one, three):
        search.run({"cell": [{"name": "a"}, {"name": "b"}]})
    assert one.best("cell", lowest) == {"name": "a"}
    assert three.best("cell", lowest) == {"name": "b"}
    assert sorted((c["name"], c["seed"]) for c in asked[2:]) == sorted(norms)
    three.run({"cell": [{"name": "a"}]})  # searched already: nothing runs again
    assert len(asked) == 8


def test_a_local_search_stops_at_its_cells_budget():
    """``Search.local`` with a budget runs a cell's neighbours in their order only up to it, and
    a cell without one runs them all."""
    from dpfl_reproductions.selection import Ranking, Runner, Search

    runner = Runner(lambda cell, point, seed: {**point, "seed": seed},
                    lambda configs: [{"norm": abs(c["x"] - 7) + abs(c["y"] - 7)} for c in configs])
    search = Search(runner, (0,))
    axes = {"x": tuple(range(10)), "y": tuple(range(10))}
    search.run({"capped": [{"x": 0, "y": 0}], "free": [{"x": 0, "y": 0}]})
    rounds = search.local(Ranking(lambda s: s["norm"]), lambda cell: axes, 20,
                          budget=lambda cell: 6 if cell == "capped" else None)
    assert len(search.searched["capped"]) == 6
    assert search.best("free", Ranking(lambda s: s["norm"])) == {"x": 7, "y": 7}
    assert 0 < rounds < 20


def test_equal_budgets_give_prisma_dpsgd_gcs_whole_grid_and_split_its_walk_between_metrics(
        tmp_path):
    """Under equal budgets a cell may hold as many configurations as DPSGD-GC's extended grid
    (the smoke grid's 3 × 3 of (η, C1), each axis one value past an end: 16); PriSMA starts from the 9
    of the plane and the first of two metrics' walks may take half the 7 left; the paper's
    budget has no bound."""
    from dpfl_reproductions.lab import Lab
    from dpfl_reproductions.prisma import SMOKE_AXES, Figure1
    from dpfl_reproductions.prisma_verdict import SMOKE_EXTRA

    lab = Lab(tmp_path, smoke=True)
    axes = extended(SMOKE_AXES, SMOKE_EXTRA)
    equal = Figure1(lab, axes=axes, budget="equal")
    prisma, dpsgd = ("prisma", 2000, 20), ("dpsgd-gc", 2000, 20)
    assert [equal.budget_of(prisma, share) for share in (0.5, 1.0)] == [9 + 3, 16]
    assert [equal.budget_of(dpsgd, share) for share in (0.5, 1.0)] == [16, 16]
    start = equal.coarse()
    assert len(start[prisma]) == 9 and len(start[dpsgd]) == 16
    assert Figure1(lab, axes=axes).budget_of(prisma) is None


def _paper_arm_smoke(name, tmp_path, capsys):
    """The smoke run of experiment ``name``'s arm at Theorem 3's noise: its report, and the
    configurations of its archived runs."""
    assert cli.main(["reproduce", "prisma", name, "--smoke", "--only", "calibration=paper",
                     "--results-dir", str(tmp_path)]) == 0
    assert f"{name}: ≈" in capsys.readouterr().out  # the estimate, first
    folder = tmp_path / f"reproduce-prisma-{name}-smoke"
    with gzip.open(folder / ARCHIVE, "rt") as f:
        return (folder / "report.md").read_text(), [json.loads(line)["config"] for line in f]


@pytest.mark.smoke
def test_the_equal_smoke_verdict_gives_both_methods_one_budget(tmp_path, capsys):
    """Every (method, N, T) cell searches as many configurations as DPSGD-GC's extended grid
    has; PriSMA's start is DPSGD-GC's (η, C1) plane with the (γ, C3) pairs in turn, and the
    report counts each method's search."""
    from dpfl_reproductions.prisma import SMOKE_AXES

    report, runs = _paper_arm_smoke("least-squares-equal", tmp_path, capsys)
    assert "each method's search (equal budget)" in report
    assert "| PriSMA | 64 | 192 |" in report and "| DPSGD-GC | 64 | 192 |" in report
    cells = {}  # (method, N by its batch, T) -> the points searched at seed 0
    for c in runs:
        if c["seed"] == 0:
            cell = (c["algorithm"], c["batch-size"], c["num-server-rounds"])
            cells.setdefault(cell, set()).add((c["learning-rate"], c["clip"],
                                               c.get("gamma"), c.get("clip-diff")))
    extended = 4 * 4  # the smoke grid's 3 × 3 of (η, C1), each axis one value past an end
    assert len(cells) == 8 and all(len(points) == extended for points in cells.values())
    plane = {(lr, clip) for lr in SMOKE_AXES["dpsgd-gc"]["learning-rate"]
             for clip in SMOKE_AXES["dpsgd-gc"]["clip"]}
    for (method, _, _), points in cells.items():
        assert plane <= {(lr, clip) for lr, clip, _, _ in points}
        if method == "prisma":  # every (γ, C3) pair of the smoke grid in the start
            assert {(g, c3) for lr, clip, g, c3 in points if (lr, clip) in plane} >= {
                (g, c3) for g in SMOKE_AXES["prisma"]["gamma"]
                for c3 in SMOKE_AXES["prisma"]["clip-diff"]}


@pytest.mark.smoke
def test_the_hardened_smoke_verdict_searches_every_point_on_three_seeds(tmp_path, capsys):
    report, runs = _paper_arm_smoke("least-squares-hardened", tmp_path, capsys)
    assert "configurations searched at tuning seeds 0, 1, 2" in report
    assert "best by its mean over tuning seeds 0, 1, 2 confirmed" in report
    assert "each method's search (paper budget)" in report
    searched = {}  # every point the search ran, by its seeds
    for c in runs:
        if c["seed"] in (0, 1, 2):
            key = json.dumps({k: v for k, v in c.items() if k != "seed"}, sort_keys=True)
            searched.setdefault(key, set()).add(c["seed"])
    assert searched and all(seeds == {0, 1, 2} for seeds in searched.values())
