"""Flower runtime: `flwr run` (Ray simulation) gives the engine's model, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from dpfl.engine import run
from dpfl.launch import flwr_run, started_processes
from dpfl.runconfig import RunConfig

pytestmark = pytest.mark.flower


CASES = {
    # stateless, per-sample clipping: DPSGD-GC, 3 rounds, 4 clients
    "dpsgd-gc": {"algorithm": "dpsgd-gc", "num-partitions": 4, "num-server-rounds": 3,
                 "batch-size": 16, "seed": 3},
    # stateful clients (v_i, g_i in Context.state), 25 virtual clients, sampling
    "clip21-sgd2m": {"algorithm": "clip21-sgd2m", "num-partitions": 25, "num-server-rounds": 3,
                     "batch-size": 16, "seed": 4, "beta": 0.5, "beta-hat": 0.5, "clip": 0.1,
                     "fraction-train": 0.8, "calibration": "practice", "learning-rate": 0.5},
    # a first round of its own, then x^t and x^{t-1} broadcast, the noisy v_i in Context.state
    # (server-clip stays at its default, inf, through Flower's run config)
    "prisma": {"algorithm": "prisma", "num-partitions": 4, "num-server-rounds": 3,
               "batch-size": 16, "seed": 5, "gamma": 0.3, "clip-diff": 0.2,
               "learning-rate": 0.5},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flower_simulation_equals_engine_bitwise(tmp_path, case):
    overrides = {**CASES[case], "results-dir": str(tmp_path / "results")}
    home = tmp_path / "flwr-home"
    code = flwr_run({**overrides, "run-name": "flower"}, flwr_home=home, timeout=600)
    assert code == 0
    assert started_processes(home) == []  # the managed SuperLink was stopped
    run(RunConfig({**overrides, "run-name": "engine"}), echo=False)
    flower = torch.load(tmp_path / "results" / "flower" / "model.pt")
    engine = torch.load(tmp_path / "results" / "engine" / "model.pt")
    assert flower.keys() == engine.keys()
    for k in flower:
        assert torch.equal(flower[k], engine[k]), k
    f_rounds = (tmp_path / "results" / "flower" / "rounds.jsonl").read_text().splitlines()
    e_rounds = (tmp_path / "results" / "engine" / "rounds.jsonl").read_text().splitlines()
    for f, e in zip(f_rounds, e_rounds, strict=True):
        f, e = json.loads(f), json.loads(e)
        f.pop("seconds"), e.pop("seconds")
        assert f == e  # losses, accuracy, ε per client, clipped fraction: all identical
