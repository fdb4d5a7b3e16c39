"""Data by reference (``dataset="package.module:callable"``): every form the callable may return,
integer inputs kept as integers, the clients' natural split, a Hugging Face dataset from a
local CSV partitioned by flwr-datasets, and every bad reference one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpfl.datasets import partition
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.problem import build_problem, dataset_of
from dpfl.runconfig import RunConfig

USER = "tests.fixtures.user_code"


def _config(tmp_path, **values: object) -> RunConfig:
    return RunConfig({"num-partitions": 4, "num-server-rounds": 2, "batch-size": 8,
                      "results-dir": str(tmp_path / "results"), **values})


def test_arrays_train_through_the_engine(tmp_path):
    summary = run(_config(tmp_path, dataset=f"{USER}:blobs", **{"run-name": "blobs"}),
                  echo=False)
    assert summary["rounds_completed"] == 2
    dataset = dataset_of(_config(tmp_path, dataset=f"{USER}:blobs"))
    assert (dataset.num_train, dataset.input_shape, dataset.num_classes) == (300, (5,), 3)
    assert dataset.train_x.dtype == torch.float32 and dataset.train_y.dtype == torch.int64


def test_dataset_options_reach_the_callable_and_held_out_splits_are_dpfls(tmp_path):
    dataset = dataset_of(_config(tmp_path, dataset=f"{USER}:blobs",
                                 **{"dataset-options": "rows=200 num_validation=20"}))
    assert (dataset.num_train, dataset.num_validation, len(dataset.test_y)) == (130, 20, 50)


def test_torch_datasets_are_materialised_once_into_tensors(tmp_path):
    dataset = dataset_of(_config(tmp_path, dataset=f"{USER}:torch_sets"))
    assert dataset.train_x.shape == (200, 2, 3) and dataset.test_x.shape == (50, 2, 3)
    assert dataset.num_classes == 2 and dataset.task == "classification"


def test_token_ids_stay_integers_through_the_engine(tmp_path):
    """The engine's cohort and a node's rows hold the ids as int64, the model built for them
    (probed with an int64 zero record) takes them, and a run trains on them."""
    config = _config(tmp_path, dataset=f"{USER}:tokens", model=f"{USER}:one_hot",
                     **{"run-name": "tokens"})
    problem = build_problem(config)
    cohort = problem.full_cohort()
    assert problem.dataset.train_x.dtype == cohort.x.dtype == torch.int64
    assert problem.node_data([0, 1])["train_x"].dtype == torch.int64
    assert problem.model.load_into(problem.x0)(cohort.x[:5]).shape == (5, 2)
    assert run(config, echo=False)["rounds_completed"] == 2


@pytest.mark.parametrize("by", ["ids", "lists"])
def test_the_natural_split_gives_each_client_its_own_rows(tmp_path, by):
    from tests.fixtures.user_code import tokens

    given = tokens(seed=0, by=by)
    config = _config(tmp_path, dataset=f"{USER}:tokens", model=f"{USER}:one_hot",
                     partitioner="natural", **{"dataset-options": f"by={by}"})
    problem = build_problem(config)
    ids = np.asarray(given["clients"]) if by == "ids" else None
    for client, rows in enumerate(problem.partitions):
        if ids is not None:
            want = given["train_x"][ids == client]
        else:
            want = given["train_x"][given["clients"][client]]
        assert np.array_equal(problem.dataset.train_x[rows].numpy(), want)


def test_a_natural_split_of_another_count_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="has 4 natural partitions, not 3"):
        build_problem(_config(tmp_path, dataset=f"{USER}:tokens", model=f"{USER}:one_hot",
                              partitioner="natural", **{"num-partitions": 3}))


def _csv(tmp_path) -> str:
    rng = np.random.default_rng(0)
    lines = ["a,b,c,label"]
    for _ in range(400):
        label = int(rng.integers(0, 3))
        lines.append(",".join(f"{v:.4f}" for v in rng.normal(size=3) + label) + f",{label}")
    file = tmp_path / "table.csv"
    file.write_text("\n".join(lines) + "\n")
    return str(file)


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet"])
def test_a_hugging_face_dataset_from_a_local_csv_is_partitioned(tmp_path, partitioner,
                                                                 monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    config = _config(tmp_path, dataset=f"{USER}:csv_table", partitioner=partitioner,
                     **{"dataset-options": f"path={_csv(tmp_path)}", "run-name": partitioner})
    dataset = dataset_of(config)
    assert (dataset.num_train, len(dataset.test_y), dataset.input_shape) == (300, 100, (3,))
    assert dataset.num_classes == 3
    parts = partition(dataset, partitioner=partitioner, num_partitions=4, seed=0)
    rows = np.sort(np.concatenate(parts))
    assert np.array_equal(rows, np.arange(300))
    sizes = sorted(len(p) for p in parts)
    assert (sizes[-1] - sizes[0] <= 1) == (partitioner == "iid")
    assert run(config, echo=False)["rounds_completed"] == 2


BAD = {
    "module_not_found": ('dataset="nosuch:data"', "module 'nosuch' is not on the Python path"),
    "raises": (f'dataset="{USER}:broken"', "failed: RuntimeError: the data server is down"),
    "returns_a_model": (f'dataset="{USER}:small_mlp"', "failed: TypeError:"),
    "returns_no_dataset": (f'dataset="{USER}:text"', "returned a str (allowed: "),
    "unknown_option": (f'dataset="{USER}:blobs" dataset-options="colour=red"',
                       "has no option 'colour' (allowed: rows, num_public"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_dataset_reference_gives_one_line_naming_the_key(name, tmp_path, capsys):
    from dpfl.cli import main

    override, fragment = BAD[name]
    results = tmp_path / "results"
    code = main(["run", "--run-config", f'{override} num-server-rounds=1 '
                 f'results-dir="{results}"'])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("dpfl: error: run config key 'dataset") and fragment in lines[0]
    assert not results.exists()


def test_an_automatic_results_folder_name_holds_no_colon():
    """The reference's colon is not portable in a folder name (Windows refuses it)."""
    from dpfl.results import run_name

    name = run_name(RunConfig({"dataset": "tests.fixtures.user_code:blobs"}), "engine")
    assert name.startswith("dpsgd-gc-tests.fixtures.user_code-blobs-s0-engine-") and ":" not in name
