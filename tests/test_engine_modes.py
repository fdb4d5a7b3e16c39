"""``engine-mode``: "exact" (per-client noise, Flower's numbers) and "fast" (pooled noise).

The fast mode may only change how the noise of an upload's sum is drawn (the law of the pooled
draw is tested with the noise itself, in test_privacy): noise-free paths must not move, noise
drawn inside a client step (Clip21-SGD2M+'s momentum: an upload declared post-processing) must
stay per client, and Flower must refuse it.
"""

from __future__ import annotations

import math

import pytest
import torch

from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.problem import build_problem
from dpfl.rounds import RoundLoop
from dpfl.runconfig import check_runtime


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
        RoundLoop(build_problem(config), runtime="flower")
