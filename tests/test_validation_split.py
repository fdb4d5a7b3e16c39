"""The validation split (dataset option ``num_validation``): held out of the training rows,
disjoint from the clients' data, the public records and the test set; evaluated by the server
beside the test set; what a selection can rank by instead of the test set."""

from __future__ import annotations

import inspect
import json
from collections import Counter

import numpy as np
import pytest
import torch

from dpfl.datasets import DATASETS, Dataset
from dpfl.datasets.base import hold_out
from dpfl.datasets.loading import data_folder, user_cache
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl_reproductions.selection import (
    StepLadder,
    final_accuracy,
    seed_runs,
    select,
    walk_past_edge,
)
from dpfl.problem import build_problem, dataset_of
from dpfl.runconfig import RunConfig

TENSORS = ("train_x", "train_y", "test_x", "test_y", "public_x", "public_y", "validation_x",
           "validation_y")


def fresh(name: str, seed: int = 0, **options) -> Dataset:
    """A load that bypasses load_dataset's in-process cache (a second load is a second draw)."""
    loader = DATASETS.get(name)
    provided = {"seed": seed, "data_dir": data_folder(), "cache_dir": user_cache(),
                "download": False}
    accepted = inspect.signature(loader).parameters
    return loader(**{k: v for k, v in provided.items() if k in accepted}, **options)


def rows(*tensors: torch.Tensor) -> Counter[bytes]:
    """The rows of ``tensors`` as a multiset."""
    return Counter(r.numpy().tobytes() for t in tensors for r in t)


def assert_same(a: Dataset, b: Dataset) -> None:
    for field in TENSORS:
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), field
    assert a.client_sizes == b.client_sizes


def indexed(n: int = 50, test: int = 10) -> Dataset:
    """Training rows 0..n-1 and test rows n..n+test-1, each row's feature its own id."""
    ids = torch.arange(n + test)
    return Dataset("ids", ids[:n, None].float(), ids[:n], ids[n:, None].float(), ids[n:],
                   task="classification", num_classes=n + test)


# ---- the split --------------------------------------------------------------------------------

def test_the_split_partitions_the_training_rows_with_the_public_records():
    base = indexed()
    held = hold_out(base, 3, num_public=5, num_validation=7)
    train, public, validation = (set(held.train_y.tolist()), set(held.public_y.tolist()),
                                 set(held.validation_y.tolist()))
    assert (held.num_train, held.num_public, held.num_validation) == (38, 5, 7)
    assert train | public | validation == set(range(50))
    assert not (train & public or train & validation or public & validation)
    assert not validation & set(held.test_y.tolist())
    for x, y in ((held.train_x, held.train_y), (held.public_x, held.public_y),
                 (held.validation_x, held.validation_y)):
        assert torch.equal(x[:, 0].long(), y) and bool((y.diff() > 0).all())  # stored order
    assert held.test_x is base.test_x and held.client_sizes is None
    assert hold_out(base, 3) is base and hold_out(base, 3, num_validation=0) is base


def test_the_split_is_drawn_from_the_candidates_when_given():
    """A training subset's left-over records (mnist's num_train): the training rows stay."""
    base, pool = indexed(), indexed(20, 0)
    held = hold_out(base, 3, num_public=5, num_validation=7, candidates=(pool.train_x,
                                                                          pool.train_y))
    assert held.train_x is base.train_x
    assert not set(held.public_y.tolist()) & set(held.validation_y.tolist())
    assert set(held.public_y.tolist()) | set(held.validation_y.tolist()) <= set(range(20))


@pytest.mark.parametrize("name, options", [
    ("digits", {}), ("digits", {"num_public": 40}), ("a9a", {}), ("synthetic-cifar10", {}),
])
def test_a_loaders_split_takes_m_of_its_training_rows(name, options):
    base = fresh(name, 2, **options)
    held = fresh(name, 2, num_validation=100, **options)
    assert held.num_validation == 100 and held.num_train == base.num_train - 100
    assert rows(held.train_x, held.validation_x) == rows(base.train_x)  # as multisets
    assert torch.equal(held.test_x, base.test_x) and torch.equal(held.test_y, base.test_y)
    if base.public_x is not None:
        assert torch.equal(held.public_x, base.public_x)


def test_digits_validation_rows_are_not_test_rows():
    """By position in sklearn's 1,797 images (the features alone repeat: some digits do)."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().data / 16.0, dtype=torch.float32)
    held = fresh("digits", 4, num_public=40, num_validation=100)

    def positions(x: torch.Tensor) -> set[int]:
        return {int(i) for r in x for i in torch.nonzero((images == r).all(dim=1))}

    assert len(positions(held.test_x)) == 360  # no test image repeats a training one here
    assert not positions(held.validation_x) & positions(held.test_x)


def test_mnist_with_a_training_subset_draws_the_split_outside_it():
    subset = fresh("mnist", 1, num_train=500, num_public=50)
    held = fresh("mnist", 1, num_train=500, num_public=50, num_validation=200)
    assert torch.equal(held.train_x, subset.train_x) and torch.equal(held.public_x,
                                                                     subset.public_x)
    assert held.num_validation == 200
    inside = rows(held.train_x, held.public_x)
    assert not rows(held.validation_x) & inside


def test_the_split_is_deterministic_in_the_seed():
    a, b = fresh("digits", 5, num_validation=100), fresh("digits", 5, num_validation=100)
    assert a is not b
    assert_same(a, b)
    assert not torch.equal(fresh("digits", 6, num_validation=100).validation_y, a.validation_y)


@pytest.mark.parametrize("name, options", [
    ("digits", {}), ("digits", {"num_public": 40}), ("a9a", {}), ("synthetic-cifar10", {}),
    ("mnist", {"num_train": 500, "num_public": 50}),
])
def test_no_split_leaves_the_dataset_as_it_was(name, options):
    assert_same(fresh(name, 3, num_validation=0, **options), fresh(name, 3, **options))


def test_the_public_records_do_not_move_when_a_split_is_added():
    public = fresh("digits", 7, num_public=40)
    both = fresh("digits", 7, num_public=40, num_validation=100)
    assert torch.equal(both.public_x, public.public_x) and torch.equal(both.public_y,
                                                                       public.public_y)
    assert rows(both.train_x, both.validation_x) == rows(public.train_x)


@pytest.mark.parametrize("options, allowed", [
    ({"num_validation": -1}, "1..1436"),
    ({"num_validation": 1437}, "1..1436"),
    ({"num_validation": 1.5}, "1..1436"),
    ({"num_public": 40, "num_validation": 1397}, "1..1396"),
])
def test_bad_sizes_are_refused_naming_the_range(options, allowed):
    with pytest.raises(ConfigError) as error:
        fresh("digits", 0, **options)
    assert error.value.key == "dataset-options" and allowed in str(error.value)
    assert "num_validation" in str(error.value)


@pytest.mark.parametrize("text, fragment", [
    ("num_validation=1.5", "option num_validation must be int"),
    ("num_validation=-3", "allowed: 1..1436"),
])
def test_bad_sizes_in_the_run_config_are_refused(text, fragment):
    with pytest.raises(ConfigError) as error:
        dataset_of(RunConfig({"dataset": "digits", "dataset-options": text}))
    assert error.value.key == "dataset-options" and fragment in str(error.value)


@pytest.mark.parametrize("dataset, fragment", [
    ("duke", "duke tests on its training set"),
    ("w8a", "w8a tests on its training set"),
    ("bank-marketing", "has no option 'num_validation'"),
    ("quadratic", "has no option 'num_validation'"),
    ("prisma-least-squares", "has no option 'num_validation'"),
    ("cifar10", "has no option 'num_validation'"),
])
def test_datasets_without_a_split_refuse_one(dataset, fragment):
    with pytest.raises(ConfigError) as error:
        dataset_of(RunConfig({"dataset": dataset, "dataset-options": "num_validation=10"}))
    assert error.value.key == "dataset-options" and fragment in str(error.value)
    assert "allowed:" in str(error.value)


def test_no_client_holds_the_split():
    problem = build_problem(RunConfig({"num-partitions": 4,
                                       "dataset-options": "num_validation=100"}))
    assert sum(len(p) for p in problem.partitions) == problem.dataset.num_train == 1337
    node = problem.node_data([0, 1, 2, 3])
    assert not any("validation" in key for key in node)
    assert not rows(problem.dataset.validation_x) & rows(node["train_x"])


# ---- evaluation and outputs -------------------------------------------------------------------

def _run(tmp_path, name: str, **changes) -> tuple[list[dict], dict]:
    run(RunConfig({"num-partitions": 4, "num-server-rounds": 2, "batch-size": 16,
                   "results-dir": str(tmp_path), "run-name": name, **changes}), echo=True)
    folder = tmp_path / name
    records = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
    return records, json.loads((folder / "summary.json").read_text())


def test_a_run_reports_the_validation_metrics_only_with_a_split(tmp_path, capsys):
    records, summary = _run(tmp_path, "validation", **{"dataset-options": "num_validation=100"})
    with_split = capsys.readouterr().out
    for values in (*records, summary):
        assert 0.0 <= values["validation_accuracy"] <= 1.0 and values["validation_loss"] > 0
        assert values["validation_loss"] != values["test_loss"]
    keys = list(records[-1])
    assert keys.index("validation_accuracy") == keys.index("test_accuracy") + 2
    assert with_split.count("validation loss") == 2
    records, summary = _run(tmp_path, "none")
    assert not any("validation" in key for values in (*records, summary) for key in values)
    assert "validation" not in capsys.readouterr().out


def test_the_flower_code_path_reports_what_the_engine_does(tmp_path):
    """The clients' nodes hold no validation rows; the ServerApp evaluates on them as the engine
    does, and its Flower Result carries the validation metrics beside the test ones."""
    from dpfl.client.app import app as client_app
    from dpfl.problem import cached_problem
    from dpfl.strategies import AlgorithmStrategy
    from dpfl.strategies.algorithm import to_record
    from tests.inprocess_grid import InProcessGrid

    values = {"num-partitions": 4, "num-server-rounds": 2, "batch-size": 16,
              "dataset-options": "num_validation=100", "results-dir": str(tmp_path)}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    config = RunConfig({**values, "run-name": "flower"})
    grid = InProcessGrid(client_app, config.as_dict(), [{"partition-id": i} for i in range(4)])
    problem = cached_problem(tuple(sorted(config.as_dict().items())))
    result = AlgorithmStrategy(problem, echo=False).start(
        grid=grid, initial_arrays=to_record({"x": problem.x0}), num_rounds=2)
    engine, flower = ([json.loads(line) for line in (tmp_path / name / "rounds.jsonl")
                       .read_text().splitlines()] for name in ("engine", "flower"))
    for e, f in zip(engine, flower, strict=True):
        e.pop("seconds"), f.pop("seconds")
        assert e == f and "validation_accuracy" in f
    assert dict(result.evaluate_metrics_serverapp[2]) == {
        k: flower[-1][k] for k in ("test_loss", "test_accuracy", "validation_loss",
                                   "validation_accuracy")}


# ---- selection --------------------------------------------------------------------------------

POINTS = [{"algorithm": "clip-sgd", "learning-rate": lr} for lr in (0.1, 0.01, 0.001)]
LADDER = StepLadder(((10, 1),), lambda p: p["learning-rate"], ("learning-rate",),
                    lambda p, epochs: {**p, "epochs": epochs})


def outcome(config: dict) -> dict:
    """The test set favours γ = 0.1, the validation split γ = 0.01."""
    lr = config["learning-rate"]
    test = {0.1: 0.9, 0.01: 0.8}.get(lr, 0.5)
    validation = {0.1: 0.7, 0.01: 0.85}.get(lr, 0.5)
    return {"test_accuracy": test, "test_loss": 1 - test, "validation_accuracy": validation,
            "validation_loss": 1 - validation, "epsilon_max": 1.0}


class StandInLab:
    def run_many(self, configs, **kwargs):
        return [outcome(c) for c in configs]

    def summary(self, config):
        return outcome(config)


def test_final_accuracy_reads_the_split_asked_for():
    summary = outcome({"learning-rate": 0.01})
    assert final_accuracy(summary) == pytest.approx(80.0)
    assert final_accuracy(summary, "validation") == pytest.approx(85.0)
    with pytest.raises(ValueError, match="num_validation"):
        final_accuracy({"test_loss": 0.1, "test_accuracy": 0.9}, "validation")
    assert final_accuracy({}, "validation") == 0.0  # a run that never evaluated


def test_selection_ranks_by_the_validation_split_when_asked():
    cell = ("mlp", "clip-sgd", 1.0)
    by_test = select(StandInLab(), {cell: POINTS}, LADDER)
    by_validation = select(StandInLab(), {cell: POINTS}, LADDER, split="validation")
    assert by_test[cell][0] == (pytest.approx(90.0), POINTS[0])
    assert [acc for acc, _ in by_validation[cell]] == pytest.approx([85.0, 70.0, 50.0])
    assert by_validation[cell][0][1] == POINTS[1]
    # the selected point's reruns report its test accuracy, whatever it was selected by
    cells = seed_runs(StandInLab(), by_validation, {"clip-sgd": POINTS}, [1, 2],
                      LADDER.step)
    assert cells[cell]["selected"]["learning-rate"] == 0.01
    assert cells[cell]["accuracy"] == (pytest.approx(80.0), 0.0)


def test_walking_past_the_edge_by_validation_accuracy():
    cell = ("mlp", "clip-sgd", 1.0)

    class Lab:
        def run_many(self, configs):
            return [{"test_loss": 0.0, "validation_loss": 0.0,
                     "validation_accuracy": 1 - abs(np.log10(c["learning-rate"] / 0.4))}
                    for c in configs]

    best = {cell: (0.0, 0.0, POINTS[0])}
    walked = walk_past_edge(Lab(), best, "learning-rate", [0.001, 0.01, 0.1], [1],
                            lambda s: -final_accuracy(s, "validation"))
    assert walked[cell][2]["learning-rate"] == pytest.approx(0.4)
