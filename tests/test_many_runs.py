"""Runs batched as one (dpfl.engine.many) equal the same runs done one by one, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpfl.engine import run
from dpfl.engine.many import fold, run_fold, run_many
from dpfl.errors import ConfigError, NonFiniteError
from dpfl_reproductions.clip21 import LOGREG_BASE, LOGREG_MODES
from dpfl_reproductions.prisma import LS_BASE
from dpfl.runconfig import RunConfig

# E1's logistic regression on duke (4 clients), 12 rounds, two seeds × two step sizes
E1 = {**LOGREG_BASE, **LOGREG_MODES["mini-batch"], "clip": 1e-2, "num-server-rounds": 12,
      "eval-every": 4}
# PriSMA's least squares (10 clients, a synthetic instance per seed), calibrated noise
LS = {**LS_BASE, "batch-size": 20, "num-server-rounds": 6, "eval-every": 3}
TIMES = ("seconds", "wall_seconds", "seconds_per_round", "cpu_seconds", "results")


def grid(base: dict, changes: list[dict], where: Path, name: str) -> list[RunConfig]:
    return [RunConfig({**base, **change, "results-dir": str(where / name), "run-name": f"r{i}"})
            for i, change in enumerate(changes)]


def without_times(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMES}


def assert_same_runs(alone: list[RunConfig], batched: list[RunConfig]) -> None:
    """Each batched run's model, round records, ledger and summary are the lone run's (bit for
    bit; only times and the folder's name differ)."""
    singles = [run(c, echo=False) for c in alone]
    batch = fold(batched)
    summaries = run_fold(batch)
    assert batch.folded_calls > 0 and batch.alone_calls == 0
    for single, summary in zip(singles, summaries, strict=True):
        one, many = Path(single["results"]), Path(summary["results"])
        assert without_times(single) == without_times(summary)
        models = [torch.load(p / "model.pt") for p in (one, many)]
        assert models[0].keys() == models[1].keys()
        assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
        rounds = [[without_times(json.loads(line)) for line in (p / "rounds.jsonl").open()]
                  for p in (one, many)]
        assert rounds[0] == rounds[1]
        written = json.loads((many / "summary.json").read_text())
        assert all(summary[k] == written[k] for k in ("wall_seconds", "cpu_seconds"))


def test_clip21_runs_batched_equal_runs_alone(tmp_path):
    changes = [{"algorithm": "clip21-sgd2m", "beta": 0.5, "seed": s, "learning-rate": lr}
               for s in (0, 1) for lr in (0.5, 2.0)]
    assert_same_runs(grid(E1, changes, tmp_path, "alone"), grid(E1, changes, tmp_path, "many"))


def test_clip_sgd_fast_mode_pools_each_runs_noise_alone(tmp_path):
    changes = [{"algorithm": "clip-sgd", "noise-multiplier": 0.5, "engine-mode": "fast",
                "non-private-diagnostics": False, "eval-train": False, "seed": s,
                "learning-rate": 1.0} for s in (3, 4)]
    assert_same_runs(grid(E1, changes, tmp_path, "alone"), grid(E1, changes, tmp_path, "many"))


@pytest.mark.parametrize("algorithm", ["prisma", "dpsgd-gc"])
def test_prisma_runs_batched_equal_runs_alone(tmp_path, algorithm):
    extra = {"gamma": 0.05, "clip-diff": 0.01, "server-clip": 1.0} if algorithm == "prisma" \
        else {}
    changes = [{"algorithm": algorithm, "clip": 1.0, "seed": s, "learning-rate": lr, **extra}
               for s, lr in ((0, 0.1), (1, 0.1), (1, 0.3))]
    assert_same_runs(grid(LS, changes, tmp_path, "alone"), grid(LS, changes, tmp_path, "many"))


def test_a_failing_run_fails_alone_and_the_others_finish(tmp_path):
    """A run whose model turns inf (noise of std inf: the server's step, which stops a run; a
    client's own inf or NaN does not) fails with the lone run's message; its batch mate runs
    to its end."""
    changes = [{"algorithm": "clip21-sgd", "clip": 1e3, "seed": 0, "noise-multiplier": sigma}
               for sigma in (0.0, 1e37)]
    batch = fold(grid(E1, changes, tmp_path, "many"))
    with pytest.raises(NonFiniteError, match="the server's step made the model inf") as failed:
        run_fold(batch)
    alone = grid(E1, changes, tmp_path, "alone")
    with pytest.raises(NonFiniteError) as expected:
        run(alone[1], echo=False)
    assert str(failed.value) == str(expected.value)
    assert json.loads((tmp_path / "many" / "r0" / "summary.json").read_text())[
        "rounds_completed"] == E1["num-server-rounds"]


@pytest.mark.parametrize(("change", "key"), [
    ({"clip": 0.1}, "clip"),
    ({"batch-size": 3}, "batch-size"),
    ({"algorithm": "clip-sgd"}, "algorithm"),
])
def test_runs_that_differ_in_a_client_key_are_refused(tmp_path, change, key):
    base = {**E1, "algorithm": "clip21-sgd"}
    with pytest.raises(ConfigError) as refused:
        run_many(grid(base, [{}, change], tmp_path, "many"))
    assert refused.value.key == key
    assert not (tmp_path / "many").exists()


def test_an_algorithm_without_per_client_broadcast_is_refused(tmp_path):
    configs = [RunConfig({"algorithm": "adaptdp-fedavg", "seed": s, "results-dir": str(tmp_path)})
               for s in (0, 1)]
    with pytest.raises(ConfigError, match="cannot be batched") as refused:
        run_many(configs)
    assert refused.value.key == "algorithm"
