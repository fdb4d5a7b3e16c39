"""`dpfl reproduce clip21 <experiment> --smoke`: the reduced reproductions CI runs."""

from __future__ import annotations

import functools
import json
import math
import shlex
from pathlib import Path

import pytest

from dpfl.cli import main
from dpfl.config import parse_overrides
from dpfl.engine import run
from dpfl_reproductions.lab import read_archive
from dpfl_reproductions.selection import command
from dpfl.runconfig import RunConfig
from tests.conftest import ROOT, bash_blocks
from tests.interrupting import SIGTERM_TO_GROUP, STOPS, interrupted

# one worker runs the module (make test: --dist loadgroup), so that each smoke reproduction the
# module-scoped fixture builds is built once, not once a worker
pytestmark = pytest.mark.xdist_group("reproduce-clip21")

# an experiment's run gives every key the algorithm tunes (the lab refuses "auto" for them)
POINT = {"algorithm": "clip-sgd", "learning-rate": 0.1, "clip": 0.1}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Each smoke reproduction, run once for the module: name -> its folder."""
    root = tmp_path_factory.mktemp("reproduce")
    done = {}

    def get(name):
        if name not in done:
            # E4 (partial) takes E3's (mnist-dp) selected points: from its archive, as a user
            # who ran E3 first does, so that E3's selection does not run twice
            reuse = (["--reuse", str(get("mnist-dp") / "runs.jsonl.gz")] if name == "partial"
                     else [])
            assert main(["reproduce", "clip21", name, "--smoke", "--results-dir",
                         str(root), *reuse]) == 0
            done[name] = root / f"reproduce-clip21-{name}-smoke"
        return done[name]

    return get


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["logreg", "logreg-leukemia", "mnist-dp", "partial",
                                  "noise-mapping"])
def test_smoke_reproduction_writes_a_report(name, smoke):
    folder = smoke(name)
    report = (folder / "report.md").read_text()
    assert "wall time" in report and "dpfl run --run-config" in report
    assert " of CPU)" in report  # every run behind it counted its CPU time
    for method in ("clip-sgd", "clip21-sgd2m"):
        assert f"| {method} |" in report
    assert list(folder.glob("*.png"))
    # a run's folder holds what `dpfl run` writes but its plot (the report draws the figures)
    runs = [run for run in (folder / "runs").iterdir() if (run / "summary.json").exists()]
    assert runs and all((run / "model.pt").exists() for run in runs)
    assert not list((folder / "runs").glob("*/summary.png"))


@pytest.mark.smoke
def test_a_selected_cell_reruns_alone_with_its_dpfl_run_line(smoke, tmp_path):
    """The report's command for a Table 1 cell gives that seed's accuracy again."""
    cells = json.loads((smoke("mnist-dp") / "cells.json").read_text())
    cell = next(c for c in cells if c["method"] == "clip21-sgd2m")
    line = command(cell["selected"])
    assert line in (smoke("mnist-dp") / "report.md").read_text()
    overrides = parse_overrides(shlex.split(line)[-1])
    summary = run(RunConfig({**overrides, "seed": 1, "results-dir": str(tmp_path)}), echo=False)
    assert 100 * summary["test_accuracy"] == pytest.approx(cell["runs"][0], abs=1e-9)


@pytest.mark.smoke
def test_a_report_regenerates_from_its_archive_without_running_again(smoke, tmp_path):
    """``runs.jsonl.gz`` beside a report is enough to write the same report elsewhere (what
    the committed reports/ rely on): no run starts, tables, cells and archive are the same."""
    first = smoke("mnist-dp")
    again = tmp_path / "again"
    assert main(["reproduce", "clip21", "mnist-dp", "--smoke", "--results-dir", str(again),
                 "--reuse", str(first / "runs.jsonl.gz")]) == 0
    folder = again / "reproduce-clip21-mnist-dp-smoke"
    assert not (folder / "runs").exists()

    def body(f):  # the report after its header (which states this invocation's wall time)
        return (f / "report.md").read_text().split("\n", 3)[3]

    assert body(folder) == body(first)
    assert json.loads((folder / "cells.json").read_text()) == \
        json.loads((first / "cells.json").read_text())
    assert (folder / "runs.jsonl.gz").read_bytes() == (first / "runs.jsonl.gz").read_bytes()


@pytest.mark.smoke
def test_logreg_regenerates_from_its_archive_running_only_its_curves_again(smoke, tmp_path):
    """E1's metric is archived (derived from each run's rounds); only Fig. I.1's curves, the
    selected points at seed 0, need rounds.jsonl and run again."""
    first = smoke("logreg")
    assert main(["reproduce", "clip21", "logreg", "--smoke", "--results-dir", str(tmp_path),
                 "--reuse", str(first / "runs.jsonl.gz")]) == 0
    folder = tmp_path / "reproduce-clip21-logreg-smoke"
    assert len(list((folder / "runs").iterdir())) == 2 * 3  # oracles x methods (one τ, seed)
    assert (folder / "report.md").read_text().split("\n", 3)[3] == \
        (first / "report.md").read_text().split("\n", 3)[3]


def test_archived_runs_count_as_finished_unless_their_rounds_are_read(tmp_path, monkeypatch):
    from dpfl_reproductions import Lab
    from dpfl_reproductions import lab as lab_module

    ran = []

    def fake_run(values):
        ran.append(values["seed"])
        folder = Path(values["results-dir"]) / values["run-name"]
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps(
            {"test_accuracy": values["seed"] / 10, "wall_seconds": 2.0, "epsilon": {"0": 1}}))
        (folder / "rounds.jsonl").write_text(json.dumps({"round": 1, "x": values["seed"]}))

    monkeypatch.setattr(lab_module, "_run_one", fake_run)
    configs = [{**POINT, "seed": s} for s in range(3)]
    first = Lab(tmp_path / "a", smoke=True)
    first.run_many(configs)
    first.write("first")
    assert ran == [0, 1, 2]
    archive = tmp_path / "a" / "runs.jsonl.gz"
    second = Lab(tmp_path / "b", smoke=True, reuse=[archive])
    summaries = second.run_many([*configs, {**POINT, "seed": 3}])
    assert ran == [0, 1, 2, 3]  # only the run the archive does not hold
    assert [s["test_accuracy"] for s in summaries] == [0.0, 0.1, 0.2, 0.3]
    assert "epsilon" not in summaries[0] and summaries[0]["wall_seconds"] == 2.0  # ARCHIVED only
    third = Lab(tmp_path / "c", smoke=True, reuse=[archive])
    third.run_many(configs, rounds=True)  # an archive keeps no rounds.jsonl
    assert ran == [0, 1, 2, 3, 0, 1, 2]

    def derive(rounds):
        return {"twice": 2 * rounds[-1]["x"]}

    fourth = Lab(tmp_path / "d", smoke=True, reuse=[archive])
    fourth.run_many(configs, derive=derive)  # archived without derived numbers: run again
    assert ran == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    fourth.write("fourth")
    fifth = Lab(tmp_path / "e", smoke=True, reuse=[tmp_path / "d" / "runs.jsonl.gz"])
    derived = [s["derived"] for s in fifth.run_many(configs, derive=derive)]
    assert ran == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]  # the derived numbers came from the archive
    assert derived == [{"twice": 0}, {"twice": 2}, {"twice": 4}]


def test_an_interrupted_sweep_leaves_an_archive_of_the_runs_it_finished(tmp_path, monkeypatch):
    """The archive is rewritten as each run finishes: a sweep stopped during a run leaves the
    runs it finished archived, and ``--reuse`` of that archive runs only the rest."""
    from dpfl_reproductions import Lab
    from dpfl_reproductions import lab as lab_module

    ran, stop_at = [], {2}

    def fake_run(values):
        if values["seed"] in stop_at:
            raise KeyboardInterrupt  # the sweep is stopped during this run
        ran.append(values["seed"])
        folder = Path(values["results-dir"]) / values["run-name"]
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"test_accuracy": values["seed"]}))

    monkeypatch.setattr(lab_module, "_run_one", fake_run)
    configs = [{**POINT, "seed": s} for s in range(4)]
    with pytest.raises(KeyboardInterrupt):
        Lab(tmp_path / "a", smoke=True).run_many(configs)
    archive = tmp_path / "a" / "runs.jsonl.gz"
    assert sorted(r["config"]["seed"] for r in read_archive(archive).values()) == [0, 1]
    assert not list((tmp_path / "a").glob("*.part"))  # written whole, then renamed
    stop_at.clear()
    resumed = Lab(tmp_path / "b", smoke=True, reuse=[archive]).run_many(configs)
    assert ran == [0, 1, 2, 3]  # seeds 0 and 1 came from the archive
    assert [s["test_accuracy"] for s in resumed] == [0, 1, 2, 3]


def test_a_resumed_sweep_stopped_early_keeps_its_later_stages_archived(tmp_path, monkeypatch):
    """A sweep's stages (e.g. successive halving's rungs) each call ``run_many``: resumed in
    a folder whose archive holds every stage, and stopped again during the first, the archive
    still holds the later stages' runs (they were only dropped once the report was written)."""
    from dpfl_reproductions import Lab
    from dpfl_reproductions import lab as lab_module

    stop_at = set()

    def fake_run(values):
        if values["seed"] in stop_at:
            raise KeyboardInterrupt
        folder = Path(values["results-dir"]) / values["run-name"]
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"test_accuracy": values["seed"]}))

    monkeypatch.setattr(lab_module, "_run_one", fake_run)
    first, later = [{**POINT, "seed": s} for s in (0, 1)], [{**POINT, "seed": 5}]
    lab = Lab(tmp_path / "a", smoke=True)
    lab.run_many(first)
    lab.run_many(later)
    lab.write("both stages")
    archive = tmp_path / "a" / "runs.jsonl.gz"
    for folder in (tmp_path / "a" / "runs").iterdir():  # only the archive is left
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    stop_at.add(2)
    with pytest.raises(KeyboardInterrupt):
        Lab(tmp_path / "a", smoke=True).run_many([*first, *[{**POINT, "seed": s} for s in (3, 2)]])
    assert sorted(r["config"]["seed"] for r in read_archive(archive).values()) == [0, 1, 3, 5]
    resumed = Lab(tmp_path / "a", smoke=True)
    resumed.run_many(first)
    resumed.write("the first stage only")  # the report's runs, and no others
    assert sorted(r["config"]["seed"] for r in read_archive(archive).values()) == [0, 1]


def test_a_sweeps_run_cut_by_an_interruption_is_run_again(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM during a sweep's run (in the sweep's own process, ``--workers 1``): the
    run closes its folder, but keeps no ``summary.json`` there, which would mark it finished:
    the next sweep runs it again, to its last round."""
    from dpfl_reproductions import Lab
    from dpfl.interrupt import Terminated
    from dpfl.rounds import driver

    answered = driver.answered

    def terminated(request, transport):
        if isinstance(request, driver.ExchangeRequest) and request.server_round == 2:
            raise Terminated
        return answered(request, transport)

    config = {**POINT, "num-partitions": 4, "num-server-rounds": 3, "batch-size": 16}
    monkeypatch.setattr(driver, "answered", terminated)
    with pytest.raises(Terminated):
        Lab(tmp_path, smoke=True).run_many([config])
    [folder] = (tmp_path / "runs").iterdir()
    assert (folder / "model.pt").exists() and not (folder / "summary.json").exists()
    monkeypatch.setattr(driver, "answered", answered)
    [summary] = Lab(tmp_path, smoke=True).run_many([config])
    assert summary["rounds_completed"] == 3 and summary["stopped_early"] is None


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "group", "status"), [*STOPS, SIGTERM_TO_GROUP])
def test_ctrl_c_or_sigterm_stops_a_sweep_and_its_workers_at_once(tmp_path, signum, group,
                                                                 status):
    """Ctrl-C or SIGTERM (to dpfl alone, or to its process group) while two workers are in
    their runs (of 10,000 rounds): no further run starts, the workers are ended at once, the
    runs they were in left without a summary.json (the next sweep runs them again), the
    finished ones archived; exit status 130 or 143 in one line. Ctrl-C used to let the sweep
    go on to its end."""
    folder = tmp_path / "reproduce-clip21-logreg"
    runs = folder / "runs"

    def both_workers_in_a_run(_: str) -> bool:
        return len(list(runs.glob("*/rounds.jsonl"))) >= 2

    stopped = interrupted(["reproduce", "clip21", "logreg", "--only", "tau=0.01", "--workers",
                           "2", "--results-dir", str(tmp_path)], both_workers_in_a_run, signum,
                          group)
    stopped.check(status)
    assert stopped.seconds < 15, stopped.seconds  # not the half minute a run takes
    finished = {path.parent.name: json.loads(path.read_text())
                for path in runs.glob("*/summary.json")}
    assert all(summary["stopped_early"] is None for summary in finished.values())
    assert 0 < len(list(runs.iterdir())) - len(finished) <= 2  # the runs cut, none after
    archive = folder / "runs.jsonl.gz"
    assert set(read_archive(archive) if archive.exists() else {}) == set(finished)
    assert not (folder / "report.md").exists()


@pytest.mark.smoke
def test_an_edited_archive_is_refused_naming_reuse(smoke, tmp_path, capsys):
    import gzip

    lines = gzip.decompress((smoke("mnist-dp") / "runs.jsonl.gz").read_bytes()).splitlines()
    record = json.loads(lines[0])
    record["config"]["learning-rate"] = 123.0  # its key no longer names its configuration
    edited = tmp_path / "edited.jsonl.gz"
    edited.write_bytes(gzip.compress(b"\n".join([json.dumps(record).encode(), *lines[1:]])))
    garbage = tmp_path / "garbage.jsonl.gz"
    garbage.write_text("not an archive")
    out = tmp_path / "out"
    for archive, message in ((edited, f"run {record['key']} does not match its configuration"),
                             (garbage, "not a run archive written by dpfl reproduce")):
        capsys.readouterr()
        assert main(["reproduce", "clip21", "mnist-dp", "--smoke", "--results-dir", str(out),
                     "--reuse", str(archive)]) == 2
        err = capsys.readouterr().err
        assert f"--reuse {archive}: {message}" in err and len(err.strip().splitlines()) == 1
        assert not out.exists()


@pytest.mark.smoke
def test_partial_runs_e3s_selected_points_with_24_clients_and_s_sampled(smoke):
    """E4 takes each (model, method, ε)'s point from E3's selection: given E3's archive it
    runs only its own seed runs, n = 24 and fraction s/24, at exactly E3's selected point."""
    e3, folder = smoke("mnist-dp"), smoke("partial")  # partial: given E3's archive
    selected = {c["method"]: c["selected"] for c in json.loads((e3 / "cells.json").read_text())}
    tuned = ("learning-rate", "clip", "beta", "beta-hat")
    runs = [json.loads((d / "config.json").read_text())["run_config"]
            for d in (folder / "runs").iterdir()]
    assert len(runs) == 2 * 3 * 2  # methods x s x seeds: no selection run
    assert {(r["algorithm"], r["fraction-train"] * 24, r["seed"]) for r in runs} == {
        (m, s, seed) for m in selected for s in (6, 12, 18) for seed in (1, 2)}
    for r in runs:
        assert r["num-partitions"] == 24 and r["num-server-rounds"] == 39  # 1 epoch (smoke)
        assert all(r[k] == selected[r["algorithm"]][k] for k in tuned
                   if k in selected[r["algorithm"]])
    for s in (6, 12, 18):
        cells = json.loads((folder / f"cells-s{s}.json").read_text())
        assert {c["method"] for c in cells} == set(selected)
        assert all(c["selected"]["fraction-train"] == s / 24 for c in cells)


def test_unknown_experiment_names_the_allowed_ones(capsys):
    assert main(["reproduce", "clip21", "cifar"]) == 2
    assert "allowed: adaptive/interpolation, adaptive/t1, adaptive/t2, adaptive/t3, " \
        "adaptive/t4, benchmark/clients, benchmark/cross-device, benchmark/epsilon, " \
        "clip21/amplified, clip21/logreg, clip21/logreg-leukemia, " \
        "clip21/mnist-dp, clip21/mnist-dp-epochs, clip21/mnist-dp-epochs-unit, " \
        "clip21/mnist-dp-validated, " \
        "clip21/noise-mapping, clip21/partial, " \
        "clip21/partial-epochs, pcdp/centralized-fmnist, pcdp/centralized-mnist, " \
        "pcdp/clipping-functions, " \
        "pcdp/federated-fmnist, pcdp/federated-fmnist-baselines, pcdp/federated-fmnist-tuned, " \
        "pcdp/federated-mnist, pcdp/federated-mnist-baselines, pcdp/federated-mnist-local, " \
        "pcdp/federated-mnist-tuned, pcdp/noniid, pcdp/noniid-tuned, prisma/cifar10, " \
        "prisma/least-squares, prisma/least-squares-equal, prisma/least-squares-hardened, " \
        "prisma/least-squares-verdict" \
        in capsys.readouterr().err


@pytest.mark.smoke
def test_only_restricts_the_experiment_and_refuses_what_it_does_not_have(smoke, tmp_path,
                                                                          capsys):
    """``--only`` (here over the whole smoke's archive: its runs of the other method are not
    read, and none runs again) and its one-line refusals."""
    out = tmp_path / "out"
    assert main(["reproduce", "clip21", "mnist-dp", "--smoke", "--results-dir", str(out),
                 "--only", "method=clip-sgd", "--reuse",
                 str(smoke("mnist-dp") / "runs.jsonl.gz")]) == 0
    folder = out / "reproduce-clip21-mnist-dp-smoke"
    assert not (folder / "runs").exists()
    report = (folder / "report.md").read_text()
    assert "restricted to method = clip-sgd" in report
    assert "| clip-sgd |" in report and "| clip21-sgd2m |" not in report
    capsys.readouterr()
    refused = tmp_path / "refused"
    for option, message in (("epsilon=99", "--only epsilon: unknown value 99 (allowed: 27)"),
                            ("temperature=1", "allowed: model=..., method=..., epsilon=...")):
        assert main(["reproduce", "clip21", "mnist-dp", "--smoke", "--results-dir",
                     str(refused), "--only", option]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
        assert not refused.exists()


@pytest.mark.smoke
def test_plan_runs_and_writes_nothing_and_names_the_first_stage_with_runs_to_do(
        smoke, tmp_path, capsys):
    """``--plan`` over a partial archive: the stages whose runs are all archived pass, the
    first with runs to do is named with its count and an estimate at the archived runs' pace;
    over the whole archive it says every stage is finished; nothing is run or written."""
    from dpfl_reproductions.lab import read_archive, write_archive

    archive = read_archive(smoke("mnist-dp") / "runs.jsonl.gz")
    half = dict(sorted(archive.items())[: len(archive) // 2])
    partial = write_archive(tmp_path / "half.jsonl.gz",
                            {k: (r["config"], r["summary"]) for k, r in half.items()})
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["reproduce", "clip21", "mnist-dp", "--smoke", "--results-dir", str(out),
                 "--workers", "2", "--reuse", str(partial), "--plan"]) == 0
    said = capsys.readouterr().out
    assert "(nothing run or written)" in said
    assert "- stage 1, the first with runs to do: " in said  # the grid: half of it archived
    todo = int(said.split("the first with runs to do: ")[1].split(" of ")[0])
    assert 0 < todo < len(archive)
    assert "of single-thread run time (at the finished runs' seconds per round)" in said
    assert " on 2 workers" in said
    assert not out.exists()
    assert main(["reproduce", "clip21", "mnist-dp", "--smoke", "--results-dir", str(out),
                 "--reuse", str(smoke("mnist-dp") / "runs.jsonl.gz"), "--plan"]) == 0
    said = capsys.readouterr().out
    assert "every run of its" in said and "stages is finished" in said
    assert not out.exists()  # not even the report's figures or cells.json


def test_a_plans_estimate_is_each_runs_rounds_at_the_pace_of_runs_like_it():
    from dpfl_reproductions.lab import seconds_at_pace

    def done(wall, rounds, **config):
        return {**POINT, "dataset": "mnist", **config}, {"wall_seconds": wall,
                                                         "rounds_completed": rounds}

    finished = [done(10.0, 10, **{"batch-size": 64}),  # 1 s a round
                done(30.0, 10, **{"batch-size": 64}),  # 3 s: the median is 2
                done(40.0, 4, **{"batch-size": 32})]  # 10 s a round
    todo = [{**POINT, "dataset": "mnist", "batch-size": 64, "num-server-rounds": 5},
            {**POINT, "dataset": "mnist", "batch-size": 32, "num-server-rounds": 2}]
    assert seconds_at_pace(todo, finished) == pytest.approx(5 * 2.0 + 2 * 10.0)
    # no finished run of its batch size: the pace of its algorithm, dataset and model
    other = {**POINT, "dataset": "mnist", "batch-size": 16, "num-server-rounds": 3}
    assert seconds_at_pace([other], finished) == pytest.approx(3 * 3.0)  # median of 1, 3, 10
    assert seconds_at_pace([{**other, "algorithm": "clip21-sgd2m"}], finished) is None


def test_a_plan_of_batched_runs_goes_by_the_experiments_cost_model(tmp_path):
    """Batched runs share their work, so a finished one's time is no pace for another: a
    planning lab estimates them by the cost model the experiment gives, else not at all."""
    from dpfl_reproductions import Lab
    from dpfl_reproductions.lab import Pending

    configs = [{**POINT, "seed": s} for s in range(3)]

    def never(group):
        raise AssertionError("a planning lab runs nothing")

    with pytest.raises(Pending) as stop:
        Lab(tmp_path, smoke=True, workers=3, plan=True).run_batched(
            configs, federation=lambda c: c["seed"], simulate=never,
            cost=lambda todo: 7200.0 * len(todo))
    assert (stop.value.stage, len(stop.value.todo), stop.value.total) == (1, 3, 3)
    assert "≈ 6.00 h of single-thread run time (by the experiment's cost model), ≈ 2.00 h " \
        "on 3 workers" in stop.value.describe()
    with pytest.raises(Pending) as stop:
        Lab(tmp_path, smoke=True, plan=True).run_batched(
            configs, federation=lambda c: c["seed"], simulate=never)
    assert "no estimate: batched runs share their work" in stop.value.describe()
    assert not list(tmp_path.iterdir())


def test_the_docs_plan_line_finds_every_stage_of_its_committed_archive_finished(tmp_path,
                                                                                 capsys):
    """The `--plan` line of docs/reproductions.md, run as a reader copies it (the report's
    archive is complete, so every stage passes and nothing is written)."""
    lines = [line for block in bash_blocks(ROOT / "docs" / "reproductions.md")
             for line in block.splitlines() if line.startswith("dpfl reproduce ")
             and "--plan" in line]
    assert lines
    for line in lines:
        capsys.readouterr()
        args = [a if not a.startswith("reports/") else str(ROOT / a)
                for a in shlex.split(line)[1:]]
        assert main([*args, "--results-dir", str(tmp_path)]) == 0
        assert "stages is finished" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


class StandInLab:
    """A lab whose runs end as ``outcome(config)`` says (a summary), recording every config."""

    def __init__(self, outcome):
        self.outcome, self.runs = outcome, []

    def run_many(self, configs):
        self.runs += configs
        return [self.outcome(c) for c in configs]


def test_selection_counts_identical_runs_once_and_prefers_interior_representatives():
    """Successive halving on a stand-in lab where, as for Clip-SGD, only γτ matters and a
    small γτ that is poor after 5 epochs wins at full length: every γτ must get its chance,
    once (ranking all points together would drop it after 5 epochs)."""
    from dpfl_reproductions.clip21 import MNIST_BASE, MNIST_GRIDS, ladder
    from dpfl_reproductions.selection import edge_axes, select

    def outcome(c):
        gt = round(c["learning-rate"] * c["clip"], 12)
        acc = {1e-3: 0.3, 1e-4: 0.2, 1e-2: 0.15, 1e-6: 0.1, 1e-7: 0.08}.get(gt, 0.05)
        if c["num-server-rounds"] >= 15 * 37:
            acc += {1e-4: 0.2, 1e-5: 0.3}.get(gt, 0.0)  # small steps catch up with time...
        if gt == 1e-5 and c["num-server-rounds"] >= 150 * 37:
            acc += 0.5  # ...and 1e-5 is best only at full length
        return {"test_accuracy": acc, "test_loss": 1 + gt * (1 + 1e-9 * c["clip"])}  # ~twins

    cell = ("mlp", "clip-sgd", 27.0)
    points = [{**MNIST_BASE, "algorithm": "clip-sgd", **p} for p in MNIST_GRIDS["clip-sgd"]]
    lab = StandInLab(outcome)
    ranked = select(lab, {cell: points}, ladder(((5, 0.25), (15, 3), (150, 1)), 1.0))
    rounds = [c["num-server-rounds"] for c in lab.runs]
    assert rounds.count(5 * 37) == 20
    assert rounds.count(15 * 37) == 8  # γτ ∈ {1e-7, ..., 1}: one run each, twins once
    full = [round(c["learning-rate"] * c["clip"], 12) for c in lab.runs if c["num-server-rounds"]
            == 150 * 37]
    assert sorted(full) == [1e-6, 1e-5, 1e-4]  # the leader, and the best at 1/10 and 1/100
    best = ranked[cell][0][1]
    assert round(best["learning-rate"] * best["clip"], 12) == 1e-5
    assert edge_axes(best, points) == []  # γ = 0.01, τ = 1e-3 rather than an edge twin


def test_selection_extends_the_hedge_while_its_smallest_step_wins():
    """When the smallest-step full-length run wins, the next smaller 15-epoch point runs too;
    the extension stops when it loses (or the grid has no smaller step)."""
    from dpfl_reproductions.clip21 import MNIST_BASE, MNIST_GRIDS, ladder
    from dpfl_reproductions.selection import select

    def outcome(c):
        gt = round(c["learning-rate"] * c["clip"], 12)
        full = c["num-server-rounds"] >= 150 * 37
        acc = {1e-3: 0.5, 1e-4: 0.4, 1e-5: 0.3, 1e-6: 0.2, 1e-7: 0.15}.get(gt, 0.1) if not full \
            else {1e-3: 0.2, 1e-4: 0.4, 1e-5: 0.6, 1e-6: 0.8, 1e-7: 0.7}.get(gt, 0.0)
        return {"test_accuracy": acc, "test_loss": gt}  # γτ twins end identically

    cell = ("mlp", "clip-sgd", 27.0)
    points = [{**MNIST_BASE, "algorithm": "clip-sgd", **p} for p in MNIST_GRIDS["clip-sgd"]]
    lab = StandInLab(outcome)
    ranked = select(lab, {cell: points}, ladder(((5, 0.25), (15, 3), (150, 1)), 1.0))
    full = [round(c["learning-rate"] * c["clip"], 12) for c in lab.runs if c["num-server-rounds"]
            == 150 * 37]
    assert full == [1e-3, 1e-4, 1e-5, 1e-6, 1e-7]  # 1e-5 won, then 1e-6 won, 1e-7 lost
    best = ranked[cell][0][1]
    assert round(best["learning-rate"] * best["clip"], 12) == 1e-6
    assert [round(a) for a, _ in ranked[cell]] == [80, 70, 60, 40, 20]  # percent


def test_selection_goes_below_the_grid_while_its_smallest_step_wins():
    """When the grid's smallest step wins at full length, the hedge goes on below the grid,
    dividing each step factor at its grid minimum by 10 while that wins (at most BELOW_GRID
    decades), and the selected point is marked as below the grid, not reported as interior."""
    from dpfl_reproductions.clip21 import MNIST_BASE, MNIST_GRIDS, ladder, step_size
    from dpfl_reproductions.selection import BELOW_GRID, edge_axes, select

    def outcome(c, peak, by="step"):
        step = step_size(c)
        if c["num-server-rounds"] < 150 * 37:
            return {"test_accuracy": 0.1 + step, "test_loss": step}  # short runs: big steps lead
        # by="beta-hat": the same law of the step, less 1/3 unless β̂ is at most 1e-3
        acc = 1 / (1 + abs(math.log10(step / peak)) + (by != "step" and c["beta-hat"] > 1e-3))
        return {"test_accuracy": acc, "test_loss": acc + c["learning-rate"]}

    def below(lab, points):
        return [c for c in lab.runs if any(c[k] < min(p[k] for p in points) for k in points[0])]

    # Clip-SGD: γ and τ both at their minima (γτ = 1e-7); γ/10 and τ/10 run, twice, then lose
    cell = ("mlp", "clip-sgd", 27.0)
    points = [{**MNIST_BASE, "algorithm": "clip-sgd", **p} for p in MNIST_GRIDS["clip-sgd"]]
    lab = StandInLab(functools.partial(outcome, peak=1e-9))
    ranked = select(lab, {cell: points}, ladder(((5, 0.25), (15, 3), (150, 1)), 1.0))
    assert [step_size(c) for c in below(lab, points)] == [1e-8, 1e-8, 1e-9, 1e-9, 1e-10, 1e-10]
    best = ranked[cell][0][1]
    assert step_size(best) == 1e-9 and best["learning-rate"] == 1e-5  # γ/10 first, ties
    assert edge_axes(best, points) == ["learning-rate below grid", "clip"]
    # no end in sight: each axis stops BELOW_GRID decades under its grid minimum
    lab = StandInLab(functools.partial(outcome, peak=1e-30))
    ranked = select(lab, {cell: points}, ladder(((5, 0.25), (15, 3), (150, 1)), 1.0))
    assert min(c["learning-rate"] for c in lab.runs) == pytest.approx(1e-3 / 10**BELOW_GRID)
    assert min(c["clip"] for c in lab.runs) == pytest.approx(1e-4 / 10**BELOW_GRID)
    assert edge_axes(ranked[cell][0][1], points) == ["learning-rate below grid (at the limit)",
                                                     "clip below grid (at the limit)"]
    # when the points below lose, the grid's point stays selected
    lab = StandInLab(functools.partial(outcome, peak=1e-7))
    ranked = select(lab, {cell: points}, ladder(((5, 0.25), (15, 3), (150, 1)), 1.0))
    assert [(c["learning-rate"], c["clip"]) for c in below(lab, points)] == [(1e-4, 1e-4),
                                                                             (1e-3, 1e-5)]
    assert edge_axes(ranked[cell][0][1], points) == ["learning-rate", "clip"]
    # α-NormEC (steps γβ̂, best 1e-6): from the corner (1e-3, β̂ = 0.01), β̂/10 beats γ/10
    cell = ("mlp", "alpha-normec", 27.0)
    points = [{**MNIST_BASE, "algorithm": "alpha-normec", **p}
              for p in MNIST_GRIDS["alpha-normec"]]
    lab = StandInLab(functools.partial(outcome, peak=1e-6, by="beta-hat"))
    ranked = select(lab, {cell: points}, ladder(((5, 0.25), (15, 3), (150, 1)), 1.0))
    best = ranked[cell][0][1]
    assert (best["learning-rate"], best["beta-hat"]) == (1e-3, 1e-3)
    assert sorted((c["learning-rate"], c["beta-hat"]) for c in below(lab, points)) == [
        (1e-4, 1e-3), (1e-4, 0.01), (1e-3, 1e-4), (1e-3, 1e-3)]  # then both halves lost
    assert edge_axes(best, points) == ["learning-rate", "beta-hat below grid"]  # α: twins


def test_a_ranking_puts_diverged_points_last_and_breaks_ties_by_its_second_metric_then_order():
    from dpfl_reproductions.selection import Ranking, accuracy, best, ranked

    def run(acc, loss):
        return {"test_accuracy": acc, "test_loss": loss}

    by_accuracy = accuracy()
    assert best([("a", [run(0.5, 1.0)]), ("b", [run(0.7, 2.0)])], by_accuracy) == "b"
    assert best([("a", [run(0.7, 1.0)]), ("b", [run(0.7, 0.5)])], by_accuracy) == "a"  # order
    then_loss = Ranking(by_accuracy.metric, higher=True, then=lambda s: s["test_loss"])
    assert best([("a", [run(0.7, 1.0)]), ("b", [run(0.7, 0.5)])], then_loss) == "b"
    loss = Ranking(lambda s: s["test_loss"])  # lower first; the mean over a point's seeds
    points = [("nan", [run(0.1, math.nan)]), ("one", [run(0, 0.3)]),
              ("two", [run(0, 0.2), run(0, 0.3)]), ("inf", [run(0, math.inf)])]
    assert [name for name, _ in ranked(points, loss)] == ["two", "one", "nan", "inf"]
    assert loss.improves(0.2, 0.3) and not loss.improves(math.nan, 0.3)


def test_halving_passes_each_rungs_best_on_and_keeps_every_run():
    """The benchmark's rungs: every point at a quarter of the rounds, the best 2 at half; ties
    keep the order the points entered the rung in."""
    from dpfl_reproductions.selection import accuracy, grid, halving, top

    points = grid(learning_rate=(0.1, 0.2, 0.3, 0.4))
    ran = []

    def run_many(configs):
        ran.extend(configs)  # short runs favour 0.3 and 0.4 alike; long ones 0.4
        return [{"test_accuracy": min(c["learning-rate"], 0.3 if c["share"] == 4 else 1.0),
                 "test_loss": 1.0} for c in configs]

    rungs = halving(run_many, {"cell": points}, [(4, top(2)), (2, top(1))],
                    lambda cell, point, share: {**point, "share": share}, accuracy())["cell"]
    assert [r.length for r in rungs] == [4, 2] and len(ran) == 4 + 2
    assert [p for p, _ in rungs[0].runs] == points  # in the order they ran
    # 0.3 and 0.4 tie at a quarter of the rounds: the order they ran in decides
    assert [p["learning-rate"] for p, _ in rungs[0].ranked] == [0.3, 0.4, 0.2, 0.1]
    assert rungs[1].ranked[0][0] == {"learning-rate": 0.4}


def test_survivors_rank_within_step_sizes_and_hedge_towards_smaller_steps():
    from dpfl_reproductions.clip21 import step_size
    from dpfl_reproductions.selection import survivors

    def point(gamma, tau, beta_hat, beta=0.5):
        return {"algorithm": "clip21-sgd2m", "learning-rate": gamma, "clip": tau,
                "beta-hat": beta_hat, "beta": beta}

    # 4 points (β) per step size γτβ̂ ∈ {5e-4, 5e-5, 5e-6, 5e-7}
    points = [point(g, t, 0.5, b) for g, t in ((1.0, 1e-3), (0.1, 1e-3), (1.0, 1e-5), (0.1, 1e-5))
              for b in (0.1, 0.5, 0.9, 1.0)]
    ranked = list(points)  # grid order is rank order
    assert step_size(point(0.1, 1e-3, 0.5)) == step_size(point(1.0, 1e-4, 0.5)) == 5e-5
    kept = survivors(ranked, points, 0.25, step_size)  # a quarter of each step size's 4 points
    assert [(p["learning-rate"], p["clip"]) for p in kept] == [(1.0, 1e-3), (0.1, 1e-3),
                                                               (1.0, 1e-5), (0.1, 1e-5)]
    # the leader (5e-4), then the best at ≤ 5e-5 and at ≤ 5e-6 (γ = 1, τ = 1e-5 ranks first)
    assert survivors(ranked, points, 3, step_size) == [points[0], points[4], points[8]]
    assert survivors(ranked, points, 1, step_size) == [points[0]]
    # nothing smaller than the last point's step
    assert survivors(list(reversed(ranked)), points, 3, step_size) == [points[-1]]
    # Clip-SGD has no β̂ and Clip21-SGD fixes β̂ = 1 (neither accepts the key); α-NormEC has
    # no τ (its messages have norm < 1: τ := 1)
    assert step_size({"algorithm": "clip-sgd", "learning-rate": 0.1, "clip": 0.1}) == 0.01
    assert step_size({"algorithm": "clip21-sgd", "learning-rate": 0.1, "clip": 0.1}) == 0.01
    assert step_size({"algorithm": "alpha-normec", "learning-rate": 0.01,
                      "beta-hat": 0.1}) == 1e-3


@pytest.mark.smoke
def test_noise_mapping_compares_the_two_readings_of_t(smoke):
    """T' = epochs gives √(rounds/epochs) = √37 times less noise than T' = rounds."""
    import re

    report = (smoke("noise-mapping") / "report.md").read_text()
    ratios = [float(x) for x in re.findall(r"σ_ω/τ = ([0-9.]+)", report)]
    assert len(ratios) == 4
    assert ratios[0] / ratios[1] == pytest.approx(37 ** 0.5, rel=0.02)
    assert "(paper 88.5)" in report and "(paper 89.2)" in report


def test_logreg_runs_only_the_requested_oracle_and_method(tmp_path):
    assert main(["reproduce", "clip21", "logreg", "--smoke", "--results-dir", str(tmp_path),
                 "--only", "oracle=gaussian", "--only", "method=clip21-sgd2m"]) == 0
    folder = tmp_path / "reproduce-clip21-logreg-smoke"
    report = (folder / "report.md").read_text()
    assert "gaussian oracle" in report and "mini-batch oracle" not in report
    assert "| τ | clip21-sgd2m |" in report and "clip-sgd" not in report
    # γ ∈ {2^-1, 2^1} (one β, τ, seed): the winner is an edge, so 1-3 runs go on past it
    assert 3 <= len(list((folder / "runs").iterdir())) <= 5
    assert "past the grid's edge, gaussian oracle" in report


def test_fig2_check_names_every_comparison_clip21_sgd2m_loses_at_small_tau():
    from dpfl_reproductions.clip21 import fig2_check

    methods = ["clip-sgd", "clip21-sgd", "clip21-sgd2m"]
    norms = {("gaussian", t, m): v for t in (1e-1, 1e-2, 1e-3)
             for m, v in zip(methods, (1.0, 2.0, 0.5), strict=True)}
    assert "**holds**" in fig2_check(norms, ["gaussian"], [1e-1, 1e-2, 1e-3], methods)
    norms[("gaussian", 1e-1, "clip21-sgd2m")] = 9.0  # τ = 0.1 is outside the check
    assert "**holds**" in fig2_check(norms, ["gaussian"], [1e-1, 1e-2, 1e-3], methods)
    norms[("gaussian", 1e-3, "clip21-sgd2m")] = 1.5  # beats Clip21-SGD, loses to Clip-SGD
    text = fig2_check(norms, ["gaussian"], [1e-1, 1e-2, 1e-3], methods)
    assert "**fails** in 1 of 4 comparisons: gaussian, τ = 0.001: 1.5 vs clip-sgd 1" in text
    assert "not applicable" in fig2_check(norms, ["gaussian"], [1e-1], methods)


class _CurveLab:
    """A stand-in lab for E1's hedge: a run's metric is ``metric(log2 γ)``; records the runs."""

    def __init__(self, metric):
        self.metric, self.ran = metric, []

    def run_many(self, configs, derive=None):
        self.ran += configs
        return [{"derived": {"grad_norm_tail": self.metric(math.log2(c["learning-rate"]))}}
                for c in configs]


@pytest.mark.parametrize("metric, expected, label", [
    (lambda k: (k - 3) ** 2, 3, "γ=2^3, above grid"),  # wins twice, loses at 2^4
    (lambda k: -k, 4, "γ=2^4, above grid (at the limit)"),  # still winning after 3 doublings
    (lambda k: k, -4, "γ=2^-4, below grid (at the limit)"),  # the low edge halves
    (lambda k: (k - 1) ** 2 + (k > 1) * 10, 1, "γ=2^1, edge"),  # the first step past loses
])
def test_e1_goes_past_the_gamma_grid_while_its_edge_wins(metric, expected, label):
    from dpfl_reproductions.clip21 import GAMMA_PAST_EDGE, gamma_label, past_the_edge

    gammas = [0.5, 1.0, 2.0]
    point = {"learning-rate": 2.0 if metric(1) < metric(-1) else 0.5}
    inner = {"learning-rate": 1.0}
    lab = _CurveLab(metric)
    best = {"edge": (metric(math.log2(point["learning-rate"])), 0.0, point),
            "interior": (metric(0), 0.0, inner)}
    out = past_the_edge(lab, best, gammas, [0, 1], derive=None)
    assert out["interior"] == best["interior"]  # an interior γ runs nothing more
    assert math.log2(out["edge"][2]["learning-rate"]) == expected
    assert gamma_label(out["edge"][2]["learning-rate"], gammas) == label
    tried = sorted({c["learning-rate"] for c in lab.ran})
    assert len(lab.ran) == 2 * len(tried) <= 2 * GAMMA_PAST_EDGE  # every seed of each trial
    assert all(c["seed"] in (0, 1) for c in lab.ran)


@pytest.mark.smoke
def test_mnist_dp_epochs_calibrates_every_run_with_t_counted_in_epochs(smoke):
    """Selection proxies (noise-multiplier set) and seed runs (practice calibration with
    practice-horizon="epochs") all use σ_ω/τ = (1/ε)√(T ln(1/δ)) at T = 1 epoch, not 37
    rounds."""
    from dpfl.algorithms.clip21 import clip21_practice_noise_std

    expected = clip21_practice_noise_std(epsilon=27.0, delta=1e-3, rounds=1, clip=1.0)
    runs = sorted((smoke("mnist-dp-epochs") / "runs").iterdir())
    kinds = set()
    for run_dir in runs:
        config = json.loads((run_dir / "config.json").read_text())["run_config"]
        releases = json.loads((run_dir / "summary.json").read_text())["releases"]
        (release,) = releases["0"]
        kinds.add(config["noise-multiplier"] < 0)
        assert 2 * release["noise_multiplier"] == pytest.approx(expected, rel=1e-12)
    assert kinds == {True, False}  # both the proxies and the seed runs were checked


def test_an_experiment_that_leaves_a_tuned_key_to_auto_is_refused(tmp_path):
    """An archived run must keep its meaning when the per-algorithm defaults are retuned."""
    from dpfl_reproductions.lab import Lab

    with pytest.raises(ValueError, match="leaves clip, learning-rate to clip-sgd's defaults"):
        Lab(tmp_path, smoke=True).run_many([{"algorithm": "clip-sgd"}])


def test_every_reproduce_command_in_the_docs_names_an_experiment_and_its_axes():
    """The `dpfl reproduce` lines a reader copies from the docs (hours of runs each, so not run
    here) name registered experiments and axes that exist, so they cannot drift."""
    from dpfl.cli import _parser
    from dpfl_reproductions import EXPERIMENTS

    lines = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in bash_blocks(doc):
            lines += [(doc.name, line.split("#")[0]) for line in block.splitlines()
                      if line.startswith("dpfl reproduce ")]
    assert len(lines) >= 8
    for doc, line in lines:
        args = _parser().parse_args(shlex.split(line)[1:])
        name = args.paper if args.experiment is None else f"{args.paper}/{args.experiment}"
        assert name in EXPERIMENTS, f"{doc}: {line}"
        axes = EXPERIMENTS.get(name).axes
        for option in args.only:
            assert option.partition("=")[0] in axes, f"{doc}: {line}"
