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


def streams_drawn(monkeypatch) -> list[tuple[int, int, str]]:
    """Every secure stream (client, round, purpose) drawn from here on, once per draw."""
    drawn: list[tuple[int, int, str]] = []
    source = Randomness.source

    def recorded(self, client: int, server_round: int, purpose: str):
        if self.secure:
            drawn.append((client, server_round, purpose))
        return source(self, client, server_round, purpose)

    monkeypatch.setattr(Randomness, "source", recorded)
    return drawn


def assert_each_stream_drawn_once(drawn: list[tuple[int, int, str]]) -> None:
    """A seeded or keyed stream drawn twice gives the same numbers; a secure one does not. Code
    that reads a stream twice (a subspace drawn by a client and again by the server, a batch
    drawn twice) agrees with itself only when seeded: under secure noise each stream must be
    drawn once."""
    twice = sorted({key for key in drawn if drawn.count(key) > 1})
    assert not twice, f"secure streams drawn more than once: {twice[:5]}"


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_runs_with_no_seeded_draw(name, tmp_path, monkeypatch):
    """A secure Randomness has no seeded stream (``key`` raises): a run that completes drew
    nothing from one. The CSPRNG is also counted, so a noisy algorithm is seen to use it, and
    no secure stream is drawn twice (:func:`assert_each_stream_drawn_once`)."""
    taken = []
    urandom = randomness_module.os.urandom
    monkeypatch.setattr(randomness_module.os, "urandom",
                        lambda n: taken.append(n) or urandom(n))
    drawn = streams_drawn(monkeypatch)
    keys = {"secure-noise": True}
    if "fraction-train" in RunConfig({"algorithm": name}).reads:  # client sampling too
        keys["fraction-train"] = 0.5
    summary = secure_run(name, tmp_path, name, **keys)
    assert summary["rounds_completed"] == ROUNDS
    if not ALGORITHMS.get(name).noise_free:
        assert sum(taken) > 0
    assert_each_stream_drawn_once(drawn)


@pytest.mark.parametrize("name,keys", [
    ("rpdp-sgd", {"random-basis": "rotation"}), ("rpdp-sgd", {"random-basis": "qr"}),
    ("pcdp-sgd", {"public-batching": "ibs", "public-batch-size": 20}),
    ("fedpcdp", {"public-batching": "ibs", "public-batch-size": 20}),
    ("pcdp-sgd", {"public-batch-size": 20}),  # rbs: a random public batch a subspace
    ("dp-ftrl", {"noise-correlation": "banded"}),
    ("dp-ftrl", {"noise-correlation": "banded", "client-sampling": "poisson",
                 "fraction-train": 0.25}),
])
def test_the_variants_that_draw_subspaces_and_schedules_draw_each_secure_stream_once(
        name, keys, tmp_path, monkeypatch):
    """The random subspaces (each drawn by the client that projects with it, once), the
    public batches and DP-FTRL's schedules (drawn from the public seed, not the secure
    source): no secure stream is read twice, where a second read would disagree."""
    drawn = streams_drawn(monkeypatch)
    summary = secure_run(name, tmp_path, name, **{"secure-noise": True, **keys})
    assert summary["rounds_completed"] == ROUNDS
    assert drawn
    assert_each_stream_drawn_once(drawn)


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
