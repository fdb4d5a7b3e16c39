"""A population (``leaf-synthetic`` with ``lazy=true``): the clients' rows made per round equal
the in-memory split bit for bit, a run makes only the clients its rounds sample, a million
clients fit, the results stay one number for the population, what needs every client's data
or state is refused, and Flower's cohort SuperNodes equal the engine on a 10⁴-client slice."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from dpfl.datasets import leaf_synthetic
from dpfl.datasets.population import KEPT, LazyPartitions
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.problem import build_problem
from dpfl.runconfig import RunConfig

VALUES = {"algorithm": "dp-fedavg-user", "dataset": "leaf-synthetic", "model": "logistic",
          "partitioner": "natural", "num-server-rounds": 4, "epsilon": 4.0, "delta": 1e-4,
          "batch-size": 10, "local-steps": 2, "learning-rate": 0.3, "clip": 0.5, "seed": 6}


def _values(clients: int, lazy: bool, **changes) -> dict:
    options = f"num_clients={clients} max_samples=120 lazy={'true' if lazy else 'false'}"
    values = {**VALUES, "num-partitions": clients, "dataset-options": options}
    values.update({k.replace("_", "-"): v for k, v in changes.items()})
    return values


def _hash(folder) -> str:
    model = torch.load(folder / "model.pt")
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.values())).hexdigest()


def test_a_population_equals_the_in_memory_split_bit_for_bit(tmp_path):
    """200 clients, Poisson-sampled at q = 0.1: the same model and ε whether the clients'
    rows are made per round or held in memory (with every client's test rows evaluated)."""
    for lazy in (False, True):
        run(RunConfig({**_values(200, lazy, fraction_train=0.1), "results-dir": str(tmp_path),
                       "run-name": f"lazy-{lazy}"}), echo=False)
    eager, lazy = (json.loads((tmp_path / f"lazy-{k}" / "summary.json").read_text())
                   for k in (False, True))
    assert _hash(tmp_path / "lazy-False") == _hash(tmp_path / "lazy-True")
    assert eager["epsilon_max"] == lazy["epsilon_max"]
    assert eager["test_accuracy"] == lazy["test_accuracy"]


def test_a_run_makes_only_the_clients_it_samples(tmp_path, monkeypatch):
    """A million clients, 3 rounds of about 50: the clients made are the evaluation clients
    and the sampled ones, the population keeps at most KEPT of them, and the results hold one
    ε for the population and the clients' releases by their rule, not a million entries."""
    made: list[int] = []
    real = leaf_synthetic.client_samples

    def counted(seed, client, **shape):
        made.append(client)
        return real(seed, client, **shape)

    monkeypatch.setattr(leaf_synthetic, "client_samples", counted)
    values = _values(10**6, True, fraction_train=5e-5, num_server_rounds=3,
                     dataset_options="num_clients=1000000 max_samples=120 lazy=true "
                                     "eval_clients=20")
    summary = run(RunConfig({**values, "results-dir": str(tmp_path), "run-name": "m"}),
                  echo=False)
    rounds = [json.loads(line) for line in (tmp_path / "m" / "rounds.jsonl").read_text()
              .splitlines()]
    sampled = sum(r["participants"] for r in rounds)
    assert 50 < sampled < 250
    # the evaluation clients, the sampled ones (once each, however often sampled), and client
    # 0 once more, whose releases the run's statements read
    assert len(made) <= 21 + sampled and len(set(made) - set(range(20))) <= sampled
    assert summary["epsilon"] == {} and 0 < summary["epsilon_population"] <= 4.0 * 1.0001
    assert set(summary["releases"]) == {"clients", "server"}
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config.get("client_sizes", {"population": 10**6})["population"] == 10**6
    assert KEPT >= 1000  # a round's cohort of about a thousand stays made within the round


def test_what_needs_every_client_is_refused(tmp_path):
    problem = build_problem(RunConfig(_values(50, True)))
    assert isinstance(problem.partitions, LazyPartitions)
    with pytest.raises(TypeError, match="every client"):
        list(problem.partitions)
    with pytest.raises(ValueError, match="gather a cohort"):
        problem.full_cohort()
    with pytest.raises(ConfigError, match="num-partitions"):
        build_problem(RunConfig({**_values(50, True), "num-partitions": 40}))
    with pytest.raises(ConfigError, match="partitioner"):
        build_problem(RunConfig({**_values(50, True), "partitioner": "iid"}))
    stateful = {k: v for k, v in _values(50, True).items() if k != "local-steps"}
    with pytest.raises(ConfigError, match="GiB over a population"):
        build_problem(RunConfig({**stateful, "algorithm": "clip21-sgd2m"}))


def test_cohort_supernodes_equal_the_engine_on_a_ten_thousand_client_slice(tmp_path):
    """10⁴ clients over 4 cohort SuperNodes of 2,500 (each makes its own clients' rows), about
    50 sampled a round: the engine's model and rounds, bit for bit."""
    from tests.inprocess_grid import run_flower_code_path

    values = {**_values(10**4, True, fraction_train=0.005, num_server_rounds=3),
              "results-dir": str(tmp_path)}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": p, "num-partitions": 4} for p in range(4)])
    assert _hash(tmp_path / "engine") == _hash(tmp_path / "flower")
    e_rounds, f_rounds = ([json.loads(line) for line in
                           (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
                          for name in ("engine", "flower"))
    for e, f in zip(e_rounds, f_rounds, strict=True):
        e.pop("seconds"), f.pop("seconds")
        assert e == f


def test_a_resumed_population_run_equals_the_uninterrupted_one(tmp_path):
    """The ledger (one shared history, each participant's count) and the model come back from
    the checkpoint: 2 rounds then 2 more equal 4."""
    from dpfl.cli import main
    from tests.test_resume import assert_same_run

    values = {**_values(10**5, True, fraction_train=2e-4), "noise-multiplier": 1.0,
              "checkpoint-every": 1, "results-dir": str(tmp_path)}
    run(RunConfig({**values, "num-server-rounds": 2, "run-name": "short"}), echo=False)
    assert main(["run", "-q", "--resume", str(tmp_path / "short"), "-c",
                 "num-server-rounds=4"]) == 0
    run(RunConfig({**values, "num-server-rounds": 4, "run-name": "long"}), echo=False)
    assert_same_run(tmp_path / "short", tmp_path / "long")
