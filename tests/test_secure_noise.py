"""``secure-noise=true``: every draw from the OS CSPRNG, none from a seeded generator, Gaussian
noise with Opacus' floating-point mitigation; secure runs differ, seeded runs repeat. (A real
node draws securely whatever the run says: tests/test_node_policy.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from dpfl.algorithms import ALGORITHMS
from dpfl.engine import run
from dpfl.privacy import Randomness
from dpfl.privacy import randomness as randomness_module
from dpfl.runconfig import RunConfig

ROUNDS = 2


def secure_run(name: str, tmp_path, run_name: str, **keys) -> dict:
    return run(RunConfig({"algorithm": name, "num-server-rounds": ROUNDS,
                          "results-dir": str(tmp_path), "run-name": run_name, **keys}),
               echo=False)


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_runs_with_no_seeded_draw(name, tmp_path, monkeypatch):
    """A secure Randomness has no seeded stream (``key`` raises): a run that completes drew
    nothing from one. The CSPRNG is also counted, so a noisy algorithm is seen to use it."""
    taken = []
    urandom = randomness_module.os.urandom
    monkeypatch.setattr(randomness_module.os, "urandom",
                        lambda n: taken.append(n) or urandom(n))
    keys = {"secure-noise": True}
    if "fraction-train" in RunConfig({"algorithm": name}).reads:  # client sampling too
        keys["fraction-train"] = 0.5
    summary = secure_run(name, tmp_path, name, **keys)
    assert summary["rounds_completed"] == ROUNDS
    if not ALGORITHMS.get(name).noise_free:
        assert sum(taken) > 0


def test_secure_mode_refuses_seeded_streams():
    with pytest.raises(RuntimeError, match="no seeded streams"):
        Randomness(0, secure=True).generator(0, 1, "noise")


def test_two_secure_runs_differ_and_two_seeded_runs_repeat(tmp_path):
    def model(run_name: str, secure: bool) -> dict[str, torch.Tensor]:
        secure_run("clip21-sgd2m", tmp_path, run_name, **{"secure-noise": secure})
        return torch.load(tmp_path / run_name / "model.pt")

    seeded = model("seeded-a", False), model("seeded-b", False)
    secure = model("secure-a", True), model("secure-b", True)
    assert all(torch.equal(seeded[0][k], seeded[1][k]) for k in seeded[0])
    assert not all(torch.equal(secure[0][k], secure[1][k]) for k in secure[0])
    assert not all(torch.equal(seeded[0][k], secure[0][k]) for k in seeded[0])


def test_secure_gaussians_sum_four_normals_drawn_from_the_csprng(monkeypatch):
    """Opacus' floating-point mitigation: each sample is the sum of four standard normals
    (Box-Muller: two 64-bit words per pair), halved; all bytes come from os.urandom."""
    taken = []
    urandom = randomness_module.os.urandom
    monkeypatch.setattr(randomness_module.os, "urandom",
                        lambda n: taken.append(n) or urandom(n))
    n = 1000
    randomness_module.secure_standard_normal(n)
    assert sum(taken) == 8 * 2 * (randomness_module.SECURE_SUMMANDS * n // 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_secure_noise_has_the_declared_std(dtype):
    """Mean, variance and tails of 4·10⁵ draws of std 3 (bounds at > 6 standard errors: a false
    alarm is below 10⁻⁸)."""
    n, std = 400_000, 3.0
    rng = Randomness(0, secure=True)
    z = rng.normal([0, 1], 1, "noise", (n // 2,), torch.tensor([std, std]), dtype=dtype)
    assert z.dtype == dtype and z.shape == (2, n // 2)
    x = z.double().flatten() / std
    assert abs(float(x.mean())) < 6 / math.sqrt(n)
    assert abs(float(x.var()) - 1) < 6 * math.sqrt(2 / n)
    # the two-sided 3σ tail holds 0.27% of a standard normal
    tail, p = float((x.abs() > 3).double().mean()), math.erfc(3 / math.sqrt(2))
    assert abs(tail - p) < 6 * math.sqrt(p * (1 - p) / n)


def test_secure_sampling_draws_valid_batches():
    rng = Randomness(0, secure=True)
    picks = rng.sample_without_replacement([0, 1], [50, 10], 1, "batch", 10)
    assert len(set(picks[0].tolist())) == 10 and max(picks[0]) < 50
    assert sorted(picks[1].tolist()) == list(range(10))
    kept = rng.bernoulli_rows([0], [100_000], 1, "batch", [0.01])[0]
    assert abs(len(kept) - 1000) < 6 * math.sqrt(1000)
    assert bool((kept[1:] > kept[:-1]).all())
    assert sorted(rng.permutation(0, 1, "order", 20).tolist()) == list(range(20))
