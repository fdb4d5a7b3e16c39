"""``engine-mode``: "exact" (per-client noise, Flower's numbers) and "fast" (pooled noise).

The fast mode may only change how the noise of an average is drawn: the law of what reaches
the model must be that of independent per-client draws, noise-free paths must not move, state
that the noise feeds (Clip21-SGD2M+) must keep per-client noise, and Flower must refuse it.
"""

from __future__ import annotations

import math

import pytest
import torch

from dpfl.algorithms import Cohort, StepContext
from dpfl.config import check_runtime
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.privacy import Randomness
from dpfl.problem import build_problem
from dpfl.server.runtime import ServerRuntime

D = 200_000
STD = torch.tensor([1.0, 2.0, 0.5, 3.0])
COHORT = Cohort([3, 5, 8, 9], torch.zeros(1), torch.zeros(1), [torch.zeros(1)] * 4)


def _noise(pooled: bool, poolable: bool, round: int = 1) -> torch.Tensor:
    ctx = StepContext(round=round, rng=Randomness(7), releases=[], device=torch.device("cpu"),
                      pooled_noise=pooled)
    return ctx.add_noise(torch.zeros(4, D), COHORT, STD, poolable=poolable)


def test_exact_noise_is_per_client_with_each_clients_std():
    noise = _noise(pooled=False, poolable=True)
    for row, std in zip(noise, STD, strict=True):
        assert row.std().item() == pytest.approx(std.item(), rel=0.01)
    assert torch.equal(noise, _noise(pooled=False, poolable=True))  # keyed streams


def test_pooled_noise_has_the_law_of_the_sum_of_independent_draws():
    pooled = _noise(pooled=True, poolable=True)
    assert torch.count_nonzero(pooled[1:]) == 0  # one draw, carried by the first row
    total = pooled.sum(dim=0)
    assert total.mean().item() == pytest.approx(0.0, abs=0.05)
    assert total.std().item() == pytest.approx(math.sqrt(float(STD.square().sum())), rel=0.01)
    exact_total = _noise(pooled=False, poolable=True).sum(dim=0)
    assert total.std().item() == pytest.approx(exact_total.std().item(), rel=0.02)
    assert not torch.equal(total, exact_total)  # other numbers, same law
    assert not torch.equal(pooled, _noise(pooled=True, poolable=True, round=2))


def test_noise_that_feeds_client_state_is_never_pooled():
    assert torch.equal(_noise(pooled=True, poolable=False), _noise(pooled=False, poolable=True))


def _fast_and_exact(small_config, **changes):
    runs = {}
    for mode in ("exact", "fast"):
        summary = run(small_config(engine_mode=mode, run_name=mode, **changes), echo=False)
        runs[mode] = torch.load(summary["results"] + "/model.pt")
    return runs["exact"], runs["fast"]


@pytest.mark.parametrize("algorithm", ["dpsgd-gc", "clip21-sgd2m"])
def test_without_noise_fast_is_exact(small_config, algorithm):
    exact, fast = _fast_and_exact(small_config, algorithm=algorithm, noise_multiplier=0.0)
    assert all(torch.equal(exact[k], fast[k]) for k in exact)


def test_clip21_sgd2m_plus_keeps_per_client_noise_in_fast_mode(small_config):
    exact, fast = _fast_and_exact(small_config, algorithm="clip21-sgd2m-plus",
                                  noise_multiplier=2.0, clip_inner=0.5)
    assert all(torch.equal(exact[k], fast[k]) for k in exact)


@pytest.mark.parametrize("algorithm", ["dpsgd-gc", "clip-sgd", "clip21-sgd2m"])
def test_fast_mode_moves_the_model_by_noise_of_the_right_size(small_config, algorithm):
    """One round from the same x: the server's step differs between the modes only by the
    noise of the average, std σ/√C per coordinate in each mode, so their difference has std
    γ·σ·√(2/C)."""
    config = small_config(algorithm=algorithm, noise_multiplier=4.0, num_server_rounds=1,
                          learning_rate=0.5, clip=0.1, beta_hat=1.0)
    models = {}
    for mode in ("exact", "fast"):
        problem = build_problem(config.replace(**{"engine-mode": mode, "run-name": mode}))
        summary = run(problem.config, echo=False)
        models[mode] = torch.cat([v.reshape(-1) for v in
                                  torch.load(summary["results"] + "/model.pt").values()])
    diff = models["fast"] - models["exact"]
    sigma = 4.0 * 0.1 / (16 if algorithm == "dpsgd-gc" else 1)  # nm·clip, per sample: /b
    expected = 0.5 * sigma * math.sqrt(2 / 4)
    assert diff.std().item() == pytest.approx(expected, rel=0.1)


def test_flower_refuses_fast_mode(small_config):
    config = small_config(engine_mode="fast")
    check_runtime(config, "engine")
    with pytest.raises(ConfigError, match="'engine-mode'.*allowed: exact"):
        check_runtime(config, "flower")
    with pytest.raises(ConfigError, match="engine-mode"):
        ServerRuntime(build_problem(config), "flower")
