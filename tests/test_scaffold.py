"""DP-SCAFFOLD (Karimireddy et al. 2020, option II, with local DP-SGD): the control-variate
update by hand, the server's c, and Flower = engine with client state across rounds."""

from __future__ import annotations

import torch

from dpfl.algorithms import ClientContext
from dpfl.engine import run
from dpfl.privacy import Randomness
from dpfl.problem import build_problem
from dpfl.rounds import ClientRuntime
from dpfl.runconfig import RunConfig

VALUES = {"algorithm": "dp-scaffold", "dataset": "digits", "model": "logistic",
          "num-partitions": 3, "num-server-rounds": 3, "batch-size": 40, "local-steps": 3,
          "learning-rate": 0.5, "clip": 0.5, "noise-multiplier": 1.0, "seed": 2,
          "sampling": "poisson", "partitioner": "shards", "shards-per-partition": 1}


def _model(path):
    return torch.cat([p.reshape(-1) for p in torch.load(path / "model.pt").values()])


def test_the_local_steps_are_corrected_by_c_minus_c_i_and_c_i_follows_option_ii(tmp_path):
    """From c_i = a, c = b: each step is y − η(g̃ + b − a) with g̃ DP-FedAvg's noisy gradient
    (the same draws), and c_i⁺ = a − b + (x − y_K)/(Kη)."""
    scaffold = build_problem(RunConfig({**VALUES, "results-dir": str(tmp_path)}))
    plain = build_problem(RunConfig({**VALUES, "algorithm": "dp-fedavg",
                                     "results-dir": str(tmp_path)}))
    x = scaffold.x0
    d = scaffold.model.d
    a = torch.randn(3, d, generator=torch.Generator().manual_seed(0)) * 0.01
    b = torch.randn(d, generator=torch.Generator().manual_seed(1)) * 0.01
    broadcast = {"x": x, "radius": torch.tensor([0.5]), "c": b}
    uploads, states, _ = ClientRuntime(scaffold.algorithm, scaffold.releases, Randomness(2)).step(
        "train", 1, broadcast, {"c": a}, scaffold.full_cohort())
    local, cohort = plain.algorithm.local, plain.full_cohort()
    releases = [{r.name: r for r in plain.releases(c)} for c in range(3)]
    ctx = ClientContext(1, Randomness(2), [0, 1, 2], releases, torch.device("cpu"))
    params = x.unsqueeze(0).repeat(3, 1)
    for k in range(3):
        g, _ = local.noisy_gradient(params, x, local.batches(cohort, k, ctx), 0.5, k, ctx)
        params = params - 0.5 * (g + b - a)
    assert torch.allclose(uploads["dy"], params - x, atol=1e-6)
    y = x + uploads["dy"]
    assert torch.allclose(states["c"], a - b + (x - y) / 1.5, atol=1e-5)
    assert torch.allclose(uploads["dc"], states["c"] - a, atol=1e-6)


def test_flower_code_path_equals_engine_with_client_state_and_sampling(tmp_path):
    from tests.inprocess_grid import run_flower_code_path

    values = {**VALUES, "fraction-train": 0.67, "results-dir": str(tmp_path)}
    engine = run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": i} for i in range(3)])
    assert torch.equal(_model(tmp_path / "engine"), _model(tmp_path / "flower"))
    assert engine["rounds_completed"] == 3
