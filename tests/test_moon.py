"""MOON (Li, He, Song, CVPR 2021) with local DP-SGD: the per-sample gradient of the
model-contrastive loss by hand, the reduction to DP-FedAvg at μ = 0, the clip, the previous
local model kept per client, and Flower = engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpfl.algorithms.moon import ModelContrastive
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.models import FlatModel
from dpfl.privacy import Randomness
from dpfl.privacy.clipping import FLAT, clipping_function
from dpfl.problem import build_problem
from dpfl.rounds import ClientRuntime
from dpfl.runconfig import RunConfig

VALUES = {"algorithm": "moon", "dataset": "digits", "model": "mlp",
          "model-options": "hidden=16", "num-partitions": 3, "num-server-rounds": 3,
          "batch-size": 20, "local-steps": 2, "learning-rate": 0.5, "clip": 0.5,
          "noise-multiplier": 1.0, "seed": 2, "partitioner": "shards",
          "shards-per-partition": 1}


def small_mlp(mu: float = 1.0, temperature: float = 0.5) -> tuple[FlatModel, ModelContrastive]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model = FlatModel(module, "cross-entropy")
    return model, ModelContrastive(model, mu, temperature)


def points(d: int, n: int = 3, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [scale * torch.randn(d, generator=g, dtype=torch.float64) for _ in range(n)]


def records(n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,),
                                                                              generator=g)


def test_the_per_sample_gradient_is_autograd_of_one_records_loss_in_float64():
    """∇ℓ_j = ∇[CE(f(x_j; w), y_j) + μ·(logsumexp(s_g/τ, s_p/τ) − s_g/τ)], s the cosine
    similarities of z_j = tanh(W₁x_j + b₁) under w to z_j under w_g and w_prev."""
    mu, tau = 0.7, 0.3
    model, moon = small_mlp(mu, tau)
    w, w_g, w_prev = points(model.d)
    x, y = records()

    def z(point, xj):
        w1, b1, _, _ = model.flat.params(point)
        return torch.tanh(xj @ w1.T + b1)

    rows = moon.per_sample_gradients(w, x, y, w_g, w_prev)
    for j in range(len(x)):
        point = w.clone().requires_grad_()
        _, _, w2, b2 = model.flat.params(point)
        zj = z(point, x[j])
        sim_g = zj @ z(w_g, x[j]) / (zj.norm() * z(w_g, x[j]).norm())
        sim_p = zj @ z(w_prev, x[j]) / (zj.norm() * z(w_prev, x[j]).norm())
        contrastive = -torch.log(torch.exp(sim_g / tau)
                                 / (torch.exp(sim_g / tau) + torch.exp(sim_p / tau)))
        loss = F.cross_entropy((zj @ w2.T + b2)[None], y[j:j + 1]) + mu * contrastive
        expected, = torch.autograd.grad(loss, point)
        assert torch.allclose(rows[j], expected, rtol=0, atol=1e-10)


def test_at_mu_zero_the_clipped_mean_is_the_per_sample_engines():
    """(The engine rounds a radius to float32: 0.25 is one.)"""
    model, moon = small_mlp(mu=0.0)
    w, w_g, w_prev = points(model.d)
    x, y = records()
    ours, fraction = moon.clipped_means(w[None], w_g, w_prev[None], x[None], y[None], 0.25, FLAT,
                                        lengths=None, divisor=len(x))
    engine, norms = model.clipped_mean(w[None], x[None], y[None], 0.25)
    assert torch.allclose(ours, engine, rtol=0, atol=1e-12)
    assert torch.equal(fraction, (norms > 0.25).double().mean(dim=1))


def test_at_mu_zero_a_run_is_dp_fedavgs_bit_for_bit(tmp_path):
    values = {**VALUES, "moon-mu": 0.0, "results-dir": str(tmp_path)}
    run(RunConfig({**values, "run-name": "moon"}), echo=False)
    del values["moon-mu"]
    run(RunConfig({**values, "algorithm": "dp-fedavg", "run-name": "fedavg"}), echo=False)
    a, b = (torch.load(tmp_path / name / "model.pt") for name in ("moon", "fedavg"))
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("function", ["flat", "auto-s", "psac"])
def test_every_clipped_per_sample_gradient_has_norm_at_most_c(function):
    model, moon = small_mlp()
    w, w_g, w_prev = points(model.d, scale=5.0)
    x, y = records()
    clip, clipping = 1e-4, clipping_function(function)
    assert (moon.per_sample_gradients(w, x, y, w_g, w_prev).norm(dim=1) > clip).all()
    for j in range(len(x)):
        term, _ = moon.clipped_sum(w, x[j:j + 1], y[j:j + 1], w_g, w_prev, clip, clipping)
        assert term.norm() <= clip * (1 + 1e-12)


def test_each_client_keeps_its_own_previous_local_model(tmp_path):
    """After a round each participant's w_prev is the local model it uploaded (before noise
    is added: the runtime noises nothing here, the steps are noised inside); an idle client
    keeps its own; a client that never took part starts from w_g (its stored row unused)."""
    problem = build_problem(RunConfig({**VALUES, "results-dir": str(tmp_path)}))
    algorithm, cohort = problem.algorithm, problem.full_cohort()
    runtime = ClientRuntime(algorithm, problem.releases, Randomness(2))
    broadcast = {"x": problem.x0, "radius": torch.tensor([0.5])}
    states = algorithm.init_client_state(3)
    uploads, new, _ = runtime.step("train", 1, broadcast, states, cohort.select([0, 2]))
    assert torch.equal(new["previous"], uploads["x"]) and torch.equal(new["joined"],
                                                                        torch.ones(2))
    garbage = {"previous": torch.full((2, problem.model.d), 7.0), "joined": torch.zeros(2)}
    again, _, _ = runtime.step("train", 1, broadcast, garbage, cohort.select([0, 2]))
    assert torch.equal(again["x"], uploads["x"])  # never joined: w_prev = w_g
    # round 2: client 0 reads its own w_prev; another w_prev gives another step
    kept = {"previous": new["previous"][:1], "joined": new["joined"][:1]}
    broadcast = {"x": uploads["x"].mean(dim=0), "radius": torch.tensor([0.5])}
    own, _, _ = runtime.step("train", 2, broadcast, kept, cohort.select([0]))
    other, _, _ = runtime.step("train", 2, broadcast, {"previous": new["previous"][1:],
                                                       "joined": new["joined"][1:]},
                               cohort.select([0]))
    assert not torch.equal(own["x"], other["x"])


def test_a_model_whose_output_is_not_its_last_linear_layers_is_refused():
    model = FlatModel(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), "cross-entropy")
    moon = ModelContrastive(model, 1.0, 0.5)
    x, y = records()
    w = model.initial_params()
    with pytest.raises(ConfigError) as caught:
        moon.per_sample_gradients(w, x.float(), y, w, w)
    assert caught.value.key == "model" and "resnet20" in str(caught.value)
    conv = FlatModel(nn.Sequential(nn.Conv2d(1, 3, 2), nn.Flatten()), "cross-entropy")
    with pytest.raises(ConfigError, match="no Linear layer"):
        ModelContrastive(conv, 1.0, 0.5)


def test_flower_code_path_equals_engine_with_client_state_and_sampling(tmp_path):
    from tests.inprocess_grid import run_flower_code_path

    values = {**VALUES, "fraction-train": 0.67, "sampling": "poisson",
              "results-dir": str(tmp_path)}
    engine = run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": i} for i in range(3)])
    e, f = (torch.load(tmp_path / name / "model.pt") for name in ("engine", "flower"))
    assert all(torch.equal(e[key], f[key]) for key in e)
    assert engine["rounds_completed"] == 3
