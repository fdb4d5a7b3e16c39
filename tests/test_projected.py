"""The projection family (Sha, Liu, Liu, Chen, arXiv:2312.03792 v1): the public subspace, the
projected, clipped and noised step of PCDP-SGD (eq. (2)) and its baselines, FedPCDP's lossless
k-coordinate upload, the DP-FedAvg baselines (Poisson batches, FedProx, client sampling, γ_g),
the three accountants in the ledger, and Flower = engine."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis

from dpfl.algorithms.base import Batches
from dpfl.algorithms.projected import Basis, top_eigenspace
from dpfl.algorithms.subspace import GradientBasis
from dpfl.datasets import load_dataset
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.models import FlatModel
from dpfl.models.span import GradientSpan
from dpfl.models.zoo import build_model
from dpfl.privacy import Randomness, clip_factors
from dpfl.problem import build_problem
from dpfl.rounds import ClientRuntime
from dpfl.runconfig import RunConfig
from tests.test_per_sample import _Unused

DIGITS = {"algorithm": "pcdp-sgd", "dataset": "digits", "model": "logistic",
          "dataset-options": "num_public=40", "num-partitions": 2, "num-server-rounds": 3,
          "batch-size": 60, "local-steps": 3, "learning-rate": 0.5, "clip": 0.5,
          "projection-dim": 12, "noise-multiplier": 2.0, "seed": 3}


def _config(tmp_path, name="run", **changes):
    values = {**DIGITS, "results-dir": str(tmp_path), "run-name": name}
    values.update({k.replace("_", "-"): v for k, v in changes.items()})
    return RunConfig({k: v for k, v in values.items() if v is not None})  # None: the default


def _rounds(summary):
    with open(f"{summary['results']}/rounds.jsonl") as f:
        return [json.loads(line) for line in f]


def _model(tmp_path, name):
    return torch.cat([p.reshape(-1) for p in torch.load(tmp_path / name / "model.pt").values()])


# ---- the public subspace ---------------------------------------------------------------------

def _materialised_basis(grads, k):
    """V = GᵀR ``[d, k]`` formed from materialised gradients ``G [m, d]`` (float64 Gram)."""
    g = grads.double()
    r, rank = top_eigenspace(g @ g.t(), k)
    return (g.t() @ r).to(grads.dtype), rank


def test_the_subspace_is_orthonormal_and_the_top_k_singular_space_of_the_gradients():
    """Gradients with singular values 9, 4, 2, 1, 0.5 along known directions: V spans the top
    three left singular vectors of Gᵀ (VVᵀ = U₃U₃ᵀ), VᵀV = I, and no d×d matrix is formed."""
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(300, 5, generator=gen, dtype=torch.float64))
    w, _ = torch.linalg.qr(torch.randn(8, 5, generator=gen, dtype=torch.float64))
    grads = (w @ torch.diag(torch.tensor([9.0, 4, 2, 1, 0.5], dtype=torch.float64)) @ u.t())
    v, rank = _materialised_basis(grads.float(), 3)
    assert rank == 3 and v.shape == (300, 3)
    assert torch.allclose(v.t() @ v, torch.eye(3), atol=1e-6)
    assert torch.allclose((v @ v.t()).double(), u[:, :3] @ u[:, :3].t(), atol=1e-6)


def test_the_basis_does_not_depend_on_the_signs_the_eigensolver_picks(monkeypatch):
    """The noise is drawn in the basis' coordinates, so a column's sign changes the update:
    LAPACK and cuSOLVER pick different signs (a GPU run differed by 1e-2 from the CPU run)."""
    grads = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)).double()
    v, _ = top_eigenspace(grads @ grads.t(), 4)
    eigh = torch.linalg.eigh

    def flipped(a):
        values, vectors = eigh(a)
        return values, vectors * torch.tensor([1.0, -1, -1, 1, -1, 1], dtype=vectors.dtype)

    monkeypatch.setattr(torch.linalg, "eigh", flipped)
    w, _ = top_eigenspace(grads @ grads.t(), 4)
    assert torch.equal(w, v)
    largest = v.gather(0, v.abs().argmax(dim=0, keepdim=True))
    assert bool((largest > 0).all())


def test_a_k_above_the_rank_leaves_zero_columns_that_project_nothing():
    grads = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    v, rank = _materialised_basis(torch.cat([grads, grads.sum(0, keepdim=True)]), 6)
    assert rank == 2
    assert torch.equal(v[:, 2:], torch.zeros(50, 4))
    g = torch.randn(50)
    basis = Basis(v)
    assert torch.allclose(basis.lift(basis.coords(basis.lift(basis.coords(g)))),
                          basis.lift(basis.coords(g)), atol=1e-6)  # idempotent
    assert torch.linalg.vector_norm(basis.coords(g)) == pytest.approx(
        float(torch.linalg.vector_norm(basis.lift(basis.coords(g)))), rel=1e-5)


# ---- one step --------------------------------------------------------------------------------

def _step(problem, rng_seed=0, server_round=1):
    runtime = ClientRuntime(problem.algorithm, problem.releases, Randomness(rng_seed))
    broadcast = {"x": problem.x0, "radius": torch.tensor([problem.algorithm.hp.clip])}
    states = problem.algorithm.init_client_state(problem.num_clients)
    return runtime.step("train", server_round, broadcast, states, problem.full_cohort())[0]["x"]


def _by_hand(problem, after_clipping=False):
    """One PCDP-SGD (or PDP-SGD) step of each client without noise, from the paper's formulas:
    V from the public gradients at x0, the client's Poisson batch of stream batch-0, and
    (1/B)·V Σ clip_c(Vᵀg_i) (PDP: (1/B)·VVᵀ Σ clip_c(g_i))."""
    hp, model, x0 = problem.algorithm.hp, problem.model, problem.x0
    px, py = problem.algorithm.public
    public = model.per_sample_gradients(x0, px.unsqueeze(0), py.unsqueeze(0))[0]
    v, _ = _materialised_basis(public, hp.projection_dim)
    cohort = problem.full_cohort()
    steps, coords = [], []
    rates = [hp.batch_size / n for n in cohort.sizes]  # the releases' sample rate b/n
    for (xb, yb) in Batches(hp.batch_size, *cohort.poisson(Randomness(0), 1, "batch-0", rates)):
        g = model.per_sample_gradients(x0, xb.unsqueeze(0), yb.unsqueeze(0))[0]
        if after_clipping:
            clipped = g * clip_factors(torch.linalg.vector_norm(g, dim=1), hp.clip)[:, None]
            a = clipped.sum(0) @ v
        else:
            a = g @ v
            a = (a * clip_factors(torch.linalg.vector_norm(a, dim=1), hp.clip)[:, None]).sum(0)
        coords.append(a / hp.batch_size)
        steps.append(v @ coords[-1])
    return v, torch.stack(steps), torch.stack(coords)


@pytest.mark.cpu_only("a reference by hand on the CPU (test_cuda compares GPU runs with CPU runs)")
@pytest.mark.parametrize("algorithm", ["pcdp-sgd", "pdp-sgd"])
def test_a_step_is_the_projected_clipped_sum_plus_noise_drawn_in_k_coordinates(tmp_path,
                                                                                algorithm):
    """The noise-free step is the formula's (eq. (2); PDP-SGD: clip, then project); the noisy
    model differs from it by exactly −γ·V z, z the client's draw from stream noise-0 with std
    σc/B in the k coordinates, so the difference lies in span V."""
    values = dict(algorithm=algorithm, local_steps=1)
    noisy = build_problem(_config(tmp_path, "n", **values))
    clean = build_problem(_config(tmp_path, "c", noise_multiplier=0.0, **values))
    v, steps, _ = _by_hand(clean, after_clipping=algorithm == "pdp-sgd")
    lr = 0.5
    assert torch.allclose(_step(clean), clean.x0 - lr * steps, atol=1e-6)
    diff = _step(noisy) - _step(clean)
    z = Randomness(0).normal([0, 1], 1, "noise-0", (12,), torch.full((2,), 2.0 * 0.5 / 60))
    assert torch.allclose(diff, -lr * z @ v.t(), atol=1e-6)
    assert torch.allclose(diff @ v @ v.t(), diff, atol=1e-6)


@pytest.mark.cpu_only("a reference by hand on the CPU (test_cuda compares GPU runs with CPU runs)")
def test_the_noise_in_the_k_coordinates_has_the_declared_std(tmp_path):
    """80 clients × 12 coordinates: the noise of one step, read in V's coordinates, has std
    σc/B (σ = 2, c = 0.5, B = 60) and mean 0."""
    values = dict(local_steps=1, num_partitions=20, batch_size=20)
    noisy = build_problem(_config(tmp_path, "n", **values))
    clean = build_problem(_config(tmp_path, "c", noise_multiplier=0.0, **values))
    draws = []
    for seed in range(4):
        v, _, _ = _by_hand(clean)
        diff = _step(noisy, seed) - _step(clean, seed)
        draws.append(diff @ v / -0.5)
    draws = torch.cat(draws).flatten()
    assert draws.std().item() == pytest.approx(2.0 * 0.5 / 20, rel=0.06)
    assert abs(draws.mean().item()) < 3 * 2.0 * 0.5 / 20 / math.sqrt(len(draws))


@pytest.mark.parametrize("algorithm", ["pcdp-sgd", "pdp-sgd"])
def test_the_projected_clipped_sum_moves_by_at_most_c_when_a_record_is_removed(tmp_path,
                                                                              algorithm):
    """Each Vᵀg_i is clipped to norm c (PDP-SGD: each g_i, and Vᵀ shrinks it), so removing any
    one record of a batch moves the released sum by at most c (the add/remove sensitivity the
    release declares)."""
    problem = build_problem(_config(tmp_path, clip=0.05, algorithm=algorithm))
    algorithm, x0 = problem.algorithm, problem.x0.to(problem.device)
    space = algorithm.source.at(x0, torch.arange(len(algorithm.public[1])))
    xb, yb = problem.dataset.train_x[:30], problem.dataset.train_y[:30]
    ctx = type("Ctx", (), {"device": problem.device})()
    xb, yb = xb.to(problem.device), yb.to(problem.device)
    whole, fraction = algorithm.projected_clipped_sum(x0, xb, yb, space, 0.05, ctx)
    assert fraction.item() > 0.5  # clipping is active
    for i in range(30):
        keep = torch.arange(30) != i
        part, _ = algorithm.projected_clipped_sum(x0, xb[keep], yb[keep], space, 0.05, ctx)
        assert torch.linalg.vector_norm(whole - part).item() <= 0.05 * (1 + 1e-5)
    assert algorithm.queries(100)[0].sensitivity(0.05 / 60) == pytest.approx(0.05 / 60)


def test_random_sparsification_drops_its_fraction_and_adds_no_noise_there(tmp_path):
    """RSDP-SGD: a step changes only the round(0.7·d) kept coordinates of its mask."""
    problem = build_problem(_config(tmp_path, algorithm="rsdp-sgd", local_steps=1,
                                    projection_dim=None, dataset_options=""))
    moved = (_step(problem) != problem.x0).sum(dim=1)
    d = problem.model.d
    assert moved.tolist() == [round(0.7 * d)] * 2


def test_a_random_qr_subspace_is_orthonormal_and_the_step_lies_in_it(tmp_path):
    problem = build_problem(_config(tmp_path, algorithm="rpdp-sgd", local_steps=1,
                                    dataset_options="", random_basis="qr"))
    space = problem.algorithm.source.subspace(problem.x0, Randomness(0), 0, 1, 0)
    assert torch.allclose(space.v.t() @ space.v, torch.eye(12), atol=1e-5)
    step = _step(problem)[0] - problem.x0
    assert torch.allclose(space.lift(space.coords(step)), step, atol=1e-6)


@pytest.mark.parametrize("d", [1, 3, 37, 1000])
def test_the_rotations_rows_are_orthonormal_and_coords_and_lift_are_v(d):
    """k rows of Q = Π H·D_r·P_r (any d: Hadamard blocks of d's binary expansion): VᵀV = I,
    coords(g) = Vᵀg, lift(a) = Va, in float64 to rounding."""
    from dpfl.algorithms.rotation import RotatedRows, Rotation

    gen = torch.Generator().manual_seed(d)
    rotation = Rotation([torch.randperm(d, generator=gen) for _ in range(3)],
                        [torch.randint(0, 2, (d,), generator=gen) * 2.0 - 1 for _ in range(3)])
    k = max(1, d // 3)
    space = RotatedRows(rotation, torch.randperm(d, generator=gen)[:k])
    v = space.lift(torch.eye(k, dtype=torch.float64)).t()  # [d, k]
    torch.testing.assert_close(v.t() @ v, torch.eye(k, dtype=torch.float64), rtol=0, atol=1e-12)
    g, a = torch.randn(4, 2, d, dtype=torch.float64), torch.randn(5, k, dtype=torch.float64)
    torch.testing.assert_close(space.coords(g), g @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(space.lift(a), a @ v.t(), rtol=0, atol=1e-12)


def test_a_rotated_subspace_keeps_a_gradients_share_as_a_haar_one_does():
    """A fixed unit vector keeps ‖Vᵀu‖² of mean k/d and the spread of a Haar-random subspace
    (about √(2(k/d)(1 − k/d)/(d + 2))) over independent draws from the keyed streams."""
    from dpfl.algorithms.projected import RandomRotation

    d, k = 2000, 100
    source = RandomRotation(type("A", (), {"model": type("M", (), {"d": d}),
                                           "hp": type("H", (), {"projection_dim": k})})())
    u = torch.zeros(d, dtype=torch.float64)
    u[7] = 1.0
    shares = torch.tensor([source.subspace(u, Randomness(s), 0, 1, 0).coords(u).square().sum()
                           for s in range(200)])
    haar = math.sqrt(2 * (k / d) * (1 - k / d) / (d + 2))
    assert abs(shares.mean().item() - k / d) < 4 * haar / math.sqrt(200)
    assert 0.7 * haar < shares.std().item() < 1.3 * haar


def test_rpdp_with_the_rotation_steps_in_its_subspace_and_learns(tmp_path):
    """``random-basis="rotation"``: the step lies in the drawn subspace (seeded from the same
    streams on every run), and a short run lowers the test loss."""
    problem = build_problem(_config(tmp_path, algorithm="rpdp-sgd", local_steps=1,
                                    dataset_options="", random_basis="rotation"))
    assert problem.algorithm.hp.random_basis == "rotation"
    space = problem.algorithm.source.subspace(problem.x0, Randomness(0), 0, 1, 0)
    step = _step(problem)[0] - problem.x0
    torch.testing.assert_close(space.lift(space.coords(step)), step, rtol=0, atol=1e-6)
    assert torch.equal(_step(problem), _step(problem))
    summary = run(_config(tmp_path, algorithm="rpdp-sgd", dataset_options="",
                          random_basis="rotation", num_server_rounds=4), echo=False)
    assert summary["test_loss"] < summary["initial_test_loss"]


def _kronecker_source(model, k):
    from dpfl.algorithms.projected import KroneckerRotation

    return KroneckerRotation(type("A", (), {"model": model,
                                            "hp": type("H", (), {"projection_dim": k})})())


@pytest.mark.cpu_only("a float64 reference on the CPU")
@pytest.mark.parametrize("name, shape, reg, chunk", [("mlp", (1, 8, 8), 0.0, 256),
                                                     ("mlp", (1, 8, 8), 0.3, 7),
                                                     ("logistic", (1, 8, 8), 0.3, 7),
                                                     ("pcdp-cnn", (1, 28, 28), 0.0, 256)])
def test_the_kronecker_rows_are_orthonormal_and_read_from_the_tapes_in_float64(name, shape,
                                                                                 reg, chunk):
    """``random-basis="kronecker"``: V = the rows of diag(R_out ⊗ R_in) kept is orthonormal;
    coords(g) = Vᵀg and lift(a) = Va; the private records' coordinates from the tapes ((R_out
    δ)_i·(R_in ã)_j per Linear layer, materialised conv layers, the regulariser's term, a linear
    model's closed-form tapes), in chunks or not, equal Vᵀ of their materialised gradients to
    1e-10 of their scale; each layer keeps within one of its share k'·d_ℓ/d, k' in all."""
    model = _float64_model(name, shape, reg, chunk)
    gen = torch.Generator().manual_seed(5)
    point = model.initial_params().double() + 0.05 * torch.randn(model.d, generator=gen,
                                                                 dtype=torch.float64)
    xb, yb = torch.randn(45, *shape, generator=gen, dtype=torch.float64), torch.arange(45) % 7
    h = model.per_sample_gradients(point[None], xb[None], yb[None])[0]
    k = 57
    space = _kronecker_source(model, k).subspace(point, Randomness(2), 1, 3, 0)
    counts = [len(block.kept) for block in space.blocks]
    sizes = [sum(s.numel() for s in layer.shapes) for layer in model.flat.layers]
    assert sum(counts) == k and len(counts) == len(sizes)
    assert all(abs(c - k * n / model.d) < 1 for c, n in zip(counts, sizes, strict=True))
    v = space.lift(torch.eye(k, dtype=torch.float64)).t()  # [d, k]
    torch.testing.assert_close(v.t() @ v, torch.eye(k, dtype=torch.float64), rtol=0, atol=1e-12)
    g, a = torch.randn(3, model.d, dtype=torch.float64), torch.randn(4, k, dtype=torch.float64)
    torch.testing.assert_close(space.coords(g), g @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(space.lift(a), a @ v.t(), rtol=0, atol=1e-12)
    coords = torch.cat(list(space.sample_coords(model, point, xb, yb)))
    torch.testing.assert_close(coords, h @ v, rtol=0, atol=1e-10 * float(h.abs().max()))


def test_a_kronecker_subspace_keeps_a_gradients_share_on_average_and_a_bounded_spread():
    """Every row of Q is kept with probability k'/d, so a fixed vector keeps ‖Vᵀu‖² of mean k'/d
    over draws, whatever Q. The spread: a dense vector's about a Haar V's; a per-sample gradient
    (rank one in each layer: entries are products of two rotated vectors', and the small last
    layer keeps few rows) spreads wider, 4.0× Haar's std here (3.4-4.7× on the MNIST MLP at
    k' = 800, docs/algorithms.md), bounded at 6×, as is a single coordinate's (which rows of an
    unrotated Q would keep whole or not at all)."""
    model = _float64_model("mlp", (1, 8, 8))
    gen = torch.Generator().manual_seed(6)
    point = model.initial_params().double()
    x, y = torch.randn(1, 1, 8, 8, generator=gen, dtype=torch.float64), torch.tensor([3])
    rank_one = model.per_sample_gradients(point[None], x[None], y[None])[0, 0]
    dense = torch.randn(model.d, generator=gen, dtype=torch.float64)
    one_hot = torch.zeros(model.d, dtype=torch.float64)
    one_hot[100] = 1.0  # unrotated rows would keep all of it or none: a spread ~100× Haar's
    d, k, draws = model.d, 200, 150
    source = _kronecker_source(model, k)
    haar = math.sqrt(2 * (k / d) * (1 - k / d) / (d + 2))
    for u, widest in ((rank_one, 6.0), (one_hot, 6.0), (dense, 1.3)):
        u = u / torch.linalg.vector_norm(u)
        shares = torch.tensor([source.subspace(point, Randomness(s), 0, 1, 0).coords(u)
                               .square().sum() for s in range(draws)])
        assert abs(shares.mean().item() - k / d) < 4 * shares.std().item() / math.sqrt(draws)
        assert shares.std().item() < widest * haar


def test_rpdp_with_kronecker_rows_steps_in_its_subspace_and_learns(tmp_path):
    """``random-basis="kronecker"``: the step lies in the drawn subspace, repeats from the same
    streams, and a short run lowers the test loss."""
    values = dict(algorithm="rpdp-sgd", dataset_options="", random_basis="kronecker",
                  model="mlp")
    problem = build_problem(_config(tmp_path, local_steps=1, **values))
    space = problem.algorithm.source.subspace(problem.x0, Randomness(0), 0, 1, 0)
    step = _step(problem)[0] - problem.x0
    torch.testing.assert_close(space.lift(space.coords(step)), step, rtol=0, atol=1e-6)
    assert torch.equal(_step(problem), _step(problem))
    summary = run(_config(tmp_path, num_server_rounds=4, **values), echo=False)
    assert summary["test_loss"] < summary["initial_test_loss"]


def test_a_client_recomputes_its_subspace_every_beta_steps_and_at_each_round_start(tmp_path):
    problem = build_problem(_config(tmp_path, local_steps=5, projection_interval=2))
    algorithm, calls = problem.algorithm, []
    original = algorithm.source.rows

    def spy(rng, owner, server_round, index):
        calls.append((owner, server_round, index))
        return original(rng, owner, server_round, index)

    algorithm.source.rows = spy
    for server_round in (1, 2):
        ClientRuntime(algorithm, problem.releases, Randomness(0)).step(
            "train", server_round, {"x": problem.x0, "radius": torch.tensor([0.5])}, {},
            problem.full_cohort())
    assert calls == [(c, r, i) for r in (1, 2) for i in (0, 1, 2) for c in (0, 1)]



@pytest.mark.parametrize("changes, shared", [({}, True),
                                             ({"public_batching": "ibs", "public_batch_size": 6},
                                              True),
                                             ({"public_batch_size": 20}, False)])
def test_clients_at_one_point_on_the_same_public_records_share_one_eigenspace(
        tmp_path, monkeypatch, changes, shared):
    """At the round's first step every client is at the broadcast model: on all m public
    records (or one IBS block) their eigenspaces are one computation, the same subspace each
    client computes alone; RBS batches (per-client draws) and later steps (each client's own
    iterate) are computed per client."""
    import dpfl.algorithms.projected as projected

    problem = build_problem(_config(tmp_path, num_partitions=4, local_steps=2, **changes))
    source, rng = problem.algorithm.source, Randomness(0)
    decompositions = []
    real = projected.top_eigenspace
    monkeypatch.setattr(projected, "top_eigenspace",
                        lambda gram, k: decompositions.append(k) or real(gram, k))
    points = problem.x0.expand(4, -1).clone()
    spaces = source.subspaces(points, rng, [0, 1, 2, 3], 1, 0)
    assert len(decompositions) == (1 if shared else 4)
    alone = [source.subspace(points[c], rng, c, 1, 0) for c in range(4)]
    for space, own in zip(spaces, alone, strict=True):
        assert torch.equal(space.r, own.r)
    decompositions.clear()
    points[1] += 1e-3  # one client moved: its own eigenspace
    source.subspaces(points, rng, [0, 1, 2, 3], 1, 0)
    assert len(decompositions) == (2 if shared else 4)

def test_momentum_adds_beta_times_the_previous_step(tmp_path):
    """Two noise-free steps of one client with heavy-ball β = 0.6: the second step is
    γ(βg₁ + g₂), so the result differs from plain SGD's by β times the first step."""
    values = dict(num_partitions=1, noise_multiplier=0.0, batch_size=1397)
    plain1, plain2, heavy = (
        _step(build_problem(_config(tmp_path, local_steps=k, momentum=m, **values)))[0]
        for k, m in ((1, 0.0), (2, 0.0), (2, 0.6)))
    x0 = build_problem(_config(tmp_path, **values)).x0
    assert torch.allclose(heavy - plain2, 0.6 * (plain1 - x0), atol=1e-6)


def test_the_learning_rate_is_divided_by_ten_after_each_milestone(tmp_path):
    hp = build_problem(_config(tmp_path, lr_milestones="2,3")).algorithm.hp
    assert [hp.learning_rate_at(r) for r in (1, 2, 3, 4)] == pytest.approx(
        [0.5, 0.5, 0.05, 0.005])
    with pytest.raises(ConfigError, match="lr-milestones"):
        _config(tmp_path, lr_milestones="3,2")


# ---- FedPCDP --------------------------------------------------------------------------------

def test_fedpcdp_uploads_k_numbers_and_the_server_restores_the_update_losslessly(tmp_path):
    """One client, every round, γ_g = 1: the k coordinates the client uploads restore its local
    model exactly (the update lies in span V); the uplink carries k floats instead of d."""
    values = dict(algorithm="fedpcdp", num_partitions=1, num_server_rounds=2)
    fed = run(_config(tmp_path, "fed", **values), echo=False)
    plain = run(_config(tmp_path, "plain", algorithm="dp-sgd", num_partitions=1,
                        num_server_rounds=2, projection_dim=None), echo=False)
    problem = build_problem(_config(tmp_path, "check", **values))
    state = problem.algorithm.begin_round(problem.algorithm.init_server_state(problem.x0),
                                          _server_ctx(problem))
    runtime = ClientRuntime(problem.algorithm, problem.releases, Randomness(3))
    cohort = problem.full_cohort()
    u = runtime.step("train", 1, problem.algorithm.broadcast("train", state, 1), {},
                     cohort)[0]["u"]
    local, _ = problem.algorithm.local_steps(state["x"], cohort, {}, problem.algorithm.broadcast(
        "train", state, 1), _client_ctx(problem))
    space = problem.algorithm.upload_space(state, torch.device("cpu"))
    assert torch.allclose(state["x"] - space.lift(u), local[0], atol=1e-6)
    # the steps' own coordinates summed are the update's projection Vᵀ(w_g − w_K)
    assert torch.allclose(u[0], space.coords(state["x"] - local[0]), atol=1e-6)
    d = problem.model.d
    assert [r["uplink_bytes"] for r in _rounds(fed)] == [12 * 4] * 2
    assert [r["uplink_bytes"] for r in _rounds(plain)] == [d * 4] * 2
    # x, the clip, V's weights R (float64), the point V was computed at, its 40 public records
    assert _rounds(fed)[0]["downlink_bytes"] == (d + 1) * 4 + 40 * 12 * 8 + d * 4 + 40 * 8


def test_fedpcdp_uploads_nothing_beyond_the_public_gradients_rank(tmp_path):
    """k = 50 over 40 public records: V's last 10 columns are zero, and so are those of the
    upload (the steps' noise drawn there projects to nothing)."""
    problem = build_problem(_config(tmp_path, algorithm="fedpcdp", num_partitions=1,
                                    projection_dim=50))
    state = problem.algorithm.begin_round(problem.algorithm.init_server_state(problem.x0),
                                          _server_ctx(problem))
    runtime = ClientRuntime(problem.algorithm, problem.releases, Randomness(3))
    u = runtime.step("train", 1, problem.algorithm.broadcast("train", state, 1), {},
                     problem.full_cohort())[0]["u"][0]
    assert bool((u[:40] != 0).all()) and torch.equal(u[40:], torch.zeros(10))


def test_fedpcdp_clients_form_no_point_in_r_d_on_a_model_of_linear_layers(tmp_path,
                                                                           monkeypatch):
    """The K local steps lie in span V: on the MLP a client takes the forward pass at
    x − Gᵀc as x's with each layer's output moved (no lift, no d-vector); on a model whose
    span cannot move a pass (the closed-form logistic model) it forms the point, one lift of
    c per client and step after the first. Both give the upload to float32 rounding (the
    noise is the same draw; a wrong move would change the later steps' clipped sums by a
    step's size)."""
    from dpfl.models.span import GradientSpan

    combines = []
    combine = GradientSpan.combine
    monkeypatch.setattr(GradientSpan, "combine",
                        lambda self, w, dtype: (combines.append(1), combine(self, w, dtype))[1])

    def upload(model):
        problem = build_problem(_config(tmp_path, algorithm="fedpcdp", num_partitions=3,
                                        model=model, local_steps=3))
        algorithm = problem.algorithm
        state = algorithm.begin_round(algorithm.init_server_state(problem.x0),
                                      _server_ctx(problem))
        runtime = ClientRuntime(algorithm, problem.releases, Randomness(3))
        combines.clear()
        return runtime.step("train", 1, algorithm.broadcast("train", state, 1), {},
                            problem.full_cohort())[0]["u"]

    u = upload("mlp")
    assert not combines
    assert len(upload("logistic")) == 3 and len(combines) == 3 * (3 - 1)
    monkeypatch.setattr(GradientSpan, "shiftable", property(lambda self: False))
    formed = upload("mlp")
    assert len(combines) == 3 * (3 - 1)
    torch.testing.assert_close(u, formed, rtol=1e-4, atol=1e-5 * float(u.abs().max()))


def test_fedpcdp_builds_the_rounds_public_span_once_on_the_engine(tmp_path, monkeypatch):
    """The server's begin_round, its clients and its server step ask for the same span (the
    public records' tapes at the broadcast model): made once a round, not three times; a point
    written in place since is not taken for the span's."""
    from dpfl.models.span import GradientSpan

    made = []
    init = GradientSpan.__init__
    monkeypatch.setattr(GradientSpan, "__init__",
                        lambda self, *args: (made.append(1), init(self, *args))[1])
    run(_config(tmp_path, algorithm="fedpcdp", model="mlp", num_server_rounds=2), echo=False)
    assert len(made) == 2
    problem = build_problem(_config(tmp_path, "alone", algorithm="fedpcdp", model="mlp"))
    source, x = problem.algorithm.source, problem.x0.clone()
    rows = torch.arange(len(problem.algorithm.public[1]))
    made.clear()
    first = source.span(x, rows)
    assert source.span(x.clone(), rows) is first and len(made) == 1
    x.add_(1.0)
    assert source.span(x, rows) is not first and len(made) == 2


def _server_ctx(problem, server_round=1):
    from dpfl.algorithms import ServerContext

    return ServerContext(server_round, Randomness(3), list(range(problem.num_clients)),
                         problem.num_clients, num_rounds=3, client_releases=problem.releases)


def _client_ctx(problem):
    from collections import Counter

    from dpfl.algorithms import ClientContext

    releases = [{r.name: r for r in problem.releases(c)} for c in range(problem.num_clients)]
    return ClientContext(1, Randomness(3), list(range(problem.num_clients)), releases,
                         torch.device("cpu"), drawn=Counter())


def test_fedpcdp_samples_clients_and_recomputes_v_every_beta_rounds(tmp_path):
    summary = run(_config(tmp_path, algorithm="fedpcdp", num_partitions=5, fraction_train=0.8,
                          num_server_rounds=4, projection_interval=2), echo=False)
    assert [r["participants"] for r in _rounds(summary)] == [4] * 4
    problem = build_problem(_config(tmp_path, "p", algorithm="fedpcdp", num_partitions=5,
                                    projection_interval=2))
    algorithm = problem.algorithm
    state = algorithm.begin_round(algorithm.init_server_state(problem.x0), _server_ctx(problem))
    moved = {**state, "x": state["x"] + 0.1}
    assert algorithm.begin_round(moved, _server_ctx(problem, 2))["basis"] is state["basis"]
    assert not torch.equal(algorithm.begin_round(moved, _server_ctx(problem, 3))["basis"],
                           state["basis"])


# ---- the DP-FedAvg baselines --------------------------------------------------------------------

def test_poisson_batches_take_each_record_with_probability_b_over_n(tmp_path):
    problem = build_problem(_config(tmp_path, num_partitions=1))
    cohort = problem.full_cohort()
    n = cohort.sizes[0]
    counts = torch.zeros(n)
    for server_round in range(300):
        picks = Randomness(0).bernoulli_rows([0], [n], server_round, "batch-0", [60 / n])[0]
        counts[picks] += 1
    assert counts.sum().item() / 300 == pytest.approx(60, rel=0.03)
    assert counts.mean().item() / 300 == pytest.approx(60 / n, rel=0.03)


def test_dp_fedprox_clips_the_gradient_plus_the_proximal_term(tmp_path):
    """Two local steps of DP FedProx (μ = 3) without noise: the second step clips each
    ∇ℓ_i(x₁) + μ(x₁ − x₀), by hand."""
    problem = build_problem(_config(tmp_path, algorithm="dp-fedavg", sampling="poisson",
                                    proximal_mu=3.0, noise_multiplier=0.0, local_steps=2,
                                    num_partitions=1, projection_dim=None))
    model, x0, lr = problem.model, problem.x0, 0.5
    cohort = problem.full_cohort()
    point = x0
    for k in range(2):
        (xb, yb), = Batches(60, *cohort.poisson(Randomness(0), 1, f"batch-{k}",
                                                [60 / cohort.sizes[0]]))
        g = model.per_sample_gradients(point, xb.unsqueeze(0), yb.unsqueeze(0))[0]
        g = g + 3.0 * (point - x0)
        g = g * clip_factors(torch.linalg.vector_norm(g, dim=1), 0.5)[:, None]
        point = point - lr * g.sum(0) / 60
    assert torch.allclose(_step(problem)[0], point, atol=1e-6)


def test_the_server_learning_rate_moves_part_of_the_way_to_the_mean(tmp_path):
    values = dict(algorithm="dp-fedavg", num_server_rounds=1, projection_dim=None)
    run(_config(tmp_path, "full", **values), echo=False)
    run(_config(tmp_path, "half", server_learning_rate=0.5, **values), echo=False)
    x0 = build_problem(_config(tmp_path, **values)).x0.cpu()  # model.pt is on the CPU
    assert torch.allclose(_model(tmp_path, "half"), x0 + 0.5 * (_model(tmp_path, "full") - x0),
                          atol=1e-6)


# ---- accounting ---------------------------------------------------------------------------------

def test_the_ledger_reports_opacus_rdp_the_papers_conversion_and_prv(tmp_path):
    """Recomputed independently from the releases and the rounds each client took part in:
    Opacus' RDP accountant stepped by hand, the classical conversion over orders 2–256 from
    Opacus' RDP curve, and Opacus' PRV accountant; the classical value is never below RDP's."""
    summary = run(_config(tmp_path, algorithm="fedpcdp", num_partitions=5, fraction_train=0.6,
                          num_server_rounds=4), echo=False)
    rounds = _rounds(summary)
    taken = {c: 0 for c in range(5)}
    problem = build_problem(_config(tmp_path, "p", algorithm="fedpcdp", num_partitions=5,
                                    fraction_train=0.6))
    for r in range(1, 5):
        for c in problem.algorithm.participants(r, list(range(5)), Randomness(3)):
            taken[c] += 1

    def epsilons(c: int) -> tuple[float, float, float]:
        """Client c's ε by the three accountants: its own release (its sample rate b/n_c) for
        each of its local steps of the rounds it took part in."""
        release = summary["releases"][str(c)][0]
        z, q, steps = release["noise_multiplier"], release["sample_rate"], \
            release["steps"] * taken[c]
        rdp = RDPAccountant()
        for _ in range(steps):
            rdp.step(noise_multiplier=z, sample_rate=q)
        orders = np.arange(2, 257)
        curve = np.asarray(rdp_analysis.compute_rdp(q=q, noise_multiplier=z, steps=steps,
                                                    orders=list(orders)))
        prv = PRVAccountant()
        prv.history = [(z, q, steps)]
        return (rdp.get_epsilon(1e-5), float(np.min(curve + math.log(1e5) / (orders - 1))),
                prv.get_epsilon(1e-5))

    rdp_eps, classical, prv_eps = (max(column) for column in
                                   zip(*(epsilons(c) for c in range(5) if taken[c])))
    by = rounds[-1]["epsilon_by_accountant"]
    assert by["rdp"] == pytest.approx(rdp_eps, rel=1e-6)
    assert by["rdp-classical"] == pytest.approx(classical, rel=1e-9)
    assert by["prv"] == pytest.approx(prv_eps, rel=1e-3)
    assert by["rdp-classical"] >= by["rdp"]
    assert summary["epsilon_max"] == pytest.approx(by["rdp"])


@pytest.mark.parametrize("sigma, paper, classical", [
    (4, 1.30, 1.287), (6, 0.83, 0.835), (8, 0.62, 0.619), (10, 0.50, 0.492)])
def test_the_federated_epsilons_of_the_paper_under_its_conversion(sigma, paper, classical):
    """Table 2's ε: q = 250/5,000, 5 local steps × 80 rounds charged to every client, the
    classical conversion: within the paper's rounding (our reading of the omitted B, T)."""
    from dpfl.privacy.ledger import _epsilon

    value = _epsilon("rdp-classical", ((float(sigma), 0.05, 400),), 1e-5)
    assert value == pytest.approx(classical, abs=1e-3)
    assert value == pytest.approx(paper, abs=0.015)


# ---- runtimes and bad input ---------------------------------------------------------------------

@pytest.mark.parametrize("algorithm, extra", [("fedpcdp", {}), ("fedpcdp", {"model": "mlp"}),
                                              ("pcdp-sgd", {}),
                                              ("rpdp-sgd", {"random-basis": "kronecker",
                                                            "dataset-options": ""})])
def test_flower_code_path_equals_engine_with_client_sampling(tmp_path, algorithm, extra, device):
    """Bit for bit on the CPU. On a GPU FedPCDP's two paths differ in the last bits (seen on an
    H100: the engine steps the sampled clients as one batch, each node its own client, and the
    GPU's kernels round by the shape), so there they agree to rounding, as in test_cuda."""
    from tests.inprocess_grid import run_flower_code_path

    values = {**DIGITS, "algorithm": algorithm, "num-partitions": 3, "fraction-train": 0.67,
              "results-dir": str(tmp_path), **extra}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": i} for i in range(3)])
    engine, flower = _model(tmp_path, "engine"), _model(tmp_path, "flower")
    if device == "cpu":
        assert torch.equal(engine, flower)
    else:
        torch.testing.assert_close(flower, engine, rtol=1e-4, atol=1e-5)


def test_public_records_are_disjoint_from_the_private_ones():
    mnist = load_dataset("mnist", seed=1, num_train=500, num_public=50)
    rows = {tuple(r.flatten().tolist()) for r in mnist.train_x[:, :, 10:18, 10:18]}
    assert mnist.num_public == 50 and mnist.num_train == 500
    assert not any(tuple(r.flatten().tolist()) in rows
                   for r in mnist.public_x[:, :, 10:18, 10:18] if r.abs().sum() > 0)
    digits = load_dataset("digits", seed=1, num_public=40)
    assert digits.num_train == 1437 - 40


@pytest.mark.parametrize("changes, key", [
    (dict(dataset_options=""), "dataset-options"),
    (dict(public_batch_size=41), "public-batch-size"),
    (dict(public_batching="ibs", public_batch_size=10), "public-batching"),
])
def test_a_run_the_public_records_cannot_serve_is_refused(tmp_path, changes, key):
    with pytest.raises(ConfigError) as err:
        build_problem(_config(tmp_path, **changes))
    assert err.value.key == key


# ---- the reproduction -----------------------------------------------------------------------

def test_the_centralized_protocol_gives_the_papers_epsilon():
    """centralized-mnist at σ = 10: 10,000 private and 100 public images, B = 250 (q = 0.025),
    40 steps a round for 80 rounds; the classical conversion of that history is the paper's
    0.69 for σ = 10."""
    from dpfl_reproductions.pcdp import SETTINGS, config_of
    from dpfl.privacy.ledger import _epsilon

    problem = build_problem(RunConfig(config_of(SETTINGS["centralized-mnist"], "pcdp-sgd", 10,
                                                0, "code")))
    assert problem.dataset.num_train == 10_000 and problem.dataset.num_public == 100
    (release,) = problem.releases(0)
    assert (release.sample_rate, release.steps, release.noise_multiplier) == (0.025, 40, 10.0)
    history = ((release.noise_multiplier, release.sample_rate, release.steps * 80),)
    assert _epsilon("rdp-classical", history, 1e-5) == pytest.approx(0.69, abs=0.005)
    assert problem.model.d == 26_010 and problem.algorithm.hp.lr_milestones == "40,60"


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["centralized-mnist", "federated-mnist", "noniid"])
def test_the_smoke_reproduction_reports_accuracy_epsilon_and_orderings(tmp_path, name):
    from dpfl.cli import main

    assert main(["reproduce", "pcdp", name, "--smoke", "--results-dir", str(tmp_path)]) == 0
    folder = tmp_path / f"reproduce-pcdp-{name}-smoke"
    report = (folder / "report.md").read_text()
    for text in ("classical RDP (the paper's)", "Opacus PRV", "§6.4", "dpfl run --run-config",
                 "uplink bytes", "wall time"):
        assert text in report, text
    assert (folder / "accuracy-vs-epsilon.png").exists()
    if name == "centralized-mnist":
        assert "[89.30 ± 0.41]" in report  # the paper's PCDP-SGD cell at σ = 6


# ---- the projection without materialised gradients ---------------------------------------------

def _float64_model(name, input_shape, reg=0.0, chunk_size=256):
    module = build_model(name, input_shape=input_shape, num_classes=10, seed=0).double()
    return FlatModel(module, "cross-entropy", nonconvex_reg=reg, chunk_size=chunk_size)


@pytest.mark.cpu_only("a float64 reference on the CPU")
@pytest.mark.parametrize("name, shape, reg, chunk", [("mlp", (1, 8, 8), 0.0, 256),
                                                     ("mlp", (1, 8, 8), 0.3, 7),
                                                     ("logistic", (1, 8, 8), 0.3, 7),
                                                     ("pcdp-cnn", (1, 28, 28), 0.0, 256)])
def test_the_projection_from_tapes_equals_the_materialised_one_in_float64(name, shape, reg,
                                                                          chunk):
    """V = GᵀR over 30 public records and the coordinates Vᵀh_j of 45 private ones at another
    point, the lift Va and Vᵀg of a vector: from the tapes (no [m, d] or [b, d] matrix:
    (δ_i·δ_j)(a_i·a_j) per Linear layer, materialised conv layers, the regulariser's terms;
    a linear model's tapes in closed form) equal to the materialised gradients' to 1e-10 of
    their scale, in chunks or not; and each private record's whole norm ‖h_j‖ from the same
    tapes (PDP-SGD clips by it), to 1e-10."""
    model = _float64_model(name, shape, reg, chunk)
    assert (model.linear is not None) == (name == "logistic")  # the closed-form tapes' case
    gen = torch.Generator().manual_seed(4)
    public_point = model.initial_params().double()
    point = public_point + 0.05 * torch.randn(model.d, generator=gen, dtype=torch.float64)
    px, py = torch.randn(30, *shape, generator=gen, dtype=torch.float64), torch.arange(30) % 10
    xb, yb = torch.randn(45, *shape, generator=gen, dtype=torch.float64), torch.arange(45) % 7
    g_pub = model.per_sample_gradients(public_point[None], px[None], py[None])[0]
    h = model.per_sample_gradients(point[None], xb[None], yb[None])[0]
    v, rank = _materialised_basis(g_pub, 40)
    assert rank == 30

    span = GradientSpan(model, public_point, px, py)
    scale = float(g_pub.abs().max())
    assert torch.allclose(span.gram(), g_pub @ g_pub.t(), rtol=0, atol=1e-10 * scale ** 2)
    r, _ = top_eigenspace(span.gram(), 40)
    space = GradientBasis(span, r)
    coords = torch.cat(list(space.sample_coords(model, point, xb, yb)))
    assert coords.shape == (45, 40)
    assert torch.allclose(coords, h @ v, rtol=0, atol=1e-10 * float(h.abs().max()))
    pairs = list(space.sample_coords_and_norms(point, xb, yb))  # PDP-SGD's: each whole norm
    assert torch.equal(torch.cat([c for c, _ in pairs]), coords)
    norms = torch.cat([n for _, n in pairs])
    assert torch.allclose(norms, torch.linalg.vector_norm(h, dim=1), rtol=1e-10, atol=0)
    a = torch.randn(40, generator=gen, dtype=torch.float64)
    assert torch.allclose(space.lift(a), v @ a, rtol=0, atol=1e-10)
    assert torch.allclose(space.coords(h[3]), h[3] @ v, rtol=0, atol=1e-10 * scale)
    assert torch.allclose(v.t() @ v, torch.diag((torch.arange(40) < 30).double()), atol=1e-10)


@pytest.mark.cpu_only("a float64 reference on the CPU")
def test_a_pass_at_a_point_moved_within_the_span_is_the_pass_at_that_point_in_float64():
    """x − Gᵀc (c over 30 public records' gradients) taken as x with each Linear layer's
    output moved by ((hAᵀ)∘c)Δ + Δᵀc: the coordinates and whole norms of 45 private records
    equal those at the point formed in R^d, to 1e-10 of their scale. A span of a conv layer, of
    a closed-form linear model or with a regulariser cannot move a pass."""
    model = _float64_model("mlp", (1, 8, 8))
    gen = torch.Generator().manual_seed(5)
    x = model.initial_params().double()
    px, py = torch.randn(30, 1, 8, 8, generator=gen, dtype=torch.float64), torch.arange(30) % 10
    xb, yb = torch.randn(45, 1, 8, 8, generator=gen, dtype=torch.float64), torch.arange(45) % 7
    span = GradientSpan(model, x, px, py)
    assert span.shiftable
    r, _ = top_eigenspace(span.gram(), 20)
    space = GradientBasis(span, r)
    c = space.weights(torch.randn(20, generator=gen, dtype=torch.float64))
    moved = x - span.combine(c, torch.float64)
    assert float((moved - x).abs().max()) > 1e-2  # a step that changes the pass
    shifted = list(space.sample_coords_and_norms(x, xb, yb, span.shifts(c, torch.float64)))
    formed = list(space.sample_coords_and_norms(moved, xb, yb))
    for (a, n), (a2, n2) in zip(shifted, formed, strict=True):
        assert torch.allclose(a, a2, rtol=0, atol=1e-10 * float(a2.abs().max()))
        assert torch.allclose(n, n2, rtol=1e-10, atol=0)
    coords = torch.cat(list(space.sample_coords(model, x, xb, yb,
                                                   span.shifts(c, torch.float64))))
    assert torch.equal(coords, torch.cat([a for a, _ in shifted]))
    for name, shape, reg in (("pcdp-cnn", (1, 28, 28), 0.0), ("logistic", (1, 8, 8), 0.0),
                             ("mlp", (1, 8, 8), 0.3)):
        other = _float64_model(name, shape, reg)
        inputs = torch.randn(4, *shape, generator=gen, dtype=torch.float64)
        assert not GradientSpan(other, other.initial_params().double(), inputs,
                                torch.arange(4)).shiftable


@pytest.mark.cpu_only("a float64 reference on the CPU")
def test_a_pass_moved_within_one_span_is_read_by_another_as_the_point_it_reaches():
    """Shifts keep their pass's inputs' products with their own span; another span's products
    with that pass are its own (no reuse across spans): its coordinates equal those at the point
    formed in R^d, to 1e-10."""
    model = _float64_model("mlp", (1, 8, 8))
    gen = torch.Generator().manual_seed(6)
    x = model.initial_params().double()
    px, py = torch.randn(30, 1, 8, 8, generator=gen, dtype=torch.float64), torch.arange(30) % 10
    qx, qy = torch.randn(25, 1, 8, 8, generator=gen, dtype=torch.float64), torch.arange(25) % 10
    xb, yb = torch.randn(20, 1, 8, 8, generator=gen, dtype=torch.float64), torch.arange(20) % 7
    moving, reading = GradientSpan(model, x, px, py), GradientSpan(model, x, qx, qy)
    c = torch.randn(30, generator=gen, dtype=torch.float64) / 10
    moved = x - moving.combine(c, torch.float64)
    space = GradientBasis(reading, top_eigenspace(reading.gram(), 10)[0])
    shifted = torch.cat(list(space.sample_coords(model, x, xb, yb,
                                                 moving.shifts(c, torch.float64))))
    formed = torch.cat(list(space.sample_coords(model, moved, xb, yb)))
    assert torch.allclose(shifted, formed, rtol=0, atol=1e-10 * float(formed.abs().max()))


def test_a_lift_is_zero_on_a_layer_the_forward_pass_does_not_use():
    """The lift writes every used layer's positions and zeroes the others' (its memory is not
    zeroed first)."""
    model = FlatModel(_Unused(), "cross-entropy")
    span = GradientSpan(model, model.initial_params(), torch.randn(5, 6), torch.arange(5) % 3)
    for _ in range(3):  # fresh memory each time, likely where the last result lay
        torch.full((model.d,), float("nan"), dtype=torch.float64)
        out = span.combine(torch.randn(5, dtype=torch.float64), torch.float64)
        assert torch.equal(out[21:], torch.zeros(21, dtype=torch.float64))
        assert bool(torch.isfinite(out).all()) and bool((out[:21] != 0).any())


def test_a_non_finite_private_record_gets_zero_coordinates_and_is_counted(tmp_path):
    problem = build_problem(_config(tmp_path))
    algorithm, x0 = problem.algorithm, problem.x0
    space = algorithm.source.at(x0, torch.arange(len(algorithm.public[1])))
    xb, yb = problem.dataset.train_x[:20].clone(), problem.dataset.train_y[:20]
    xb[4] = float("nan")
    problem.model.take_dropped()
    coords = torch.cat(list(space.sample_coords(problem.model, x0, xb, yb)))
    assert torch.equal(coords[4], torch.zeros(12)) and torch.isfinite(coords).all()
    assert problem.model.take_dropped() == 1


def test_the_products_run_in_the_models_dtype_only_where_the_public_gradients_are_well_conditioned(
        tmp_path):
    """R's column c has norm 1/σ_c: float32 products where σ_1/σ_k ≤ 100, else float64. On the
    digits model at its start (κ ≈ 20) the float32 coordinates and lift equal the float64 ones
    to float32 rounding amplified at most 100×; public records whose gradients nearly coincide
    make the projection run in float64."""
    from dpfl.algorithms.projected import products_dtype

    r = torch.diag(torch.tensor([1.0, 10.0, 100.0, 0.0], dtype=torch.float64))
    assert products_dtype(r, torch.float32) is torch.float32
    r[2, 2] = 101.0
    assert products_dtype(r, torch.float32) is torch.float64
    assert products_dtype(torch.zeros(3, 2, dtype=torch.float64), torch.float32) is torch.float32

    problem = build_problem(_config(tmp_path))
    algorithm, model, x0 = problem.algorithm, problem.model, problem.x0
    rows = torch.arange(len(algorithm.public[1]))
    space = algorithm.source.at(x0, rows)
    assert space.dtype is torch.float32
    exact = GradientBasis(space.span, space.r, torch.float64)
    xb, yb = problem.dataset.train_x[:50], problem.dataset.train_y[:50]
    fast = torch.cat(list(space.sample_coords(model, x0, xb, yb)))
    slow = torch.cat(list(exact.sample_coords(model, x0, xb, yb)))
    assert torch.allclose(fast, slow, rtol=0, atol=1e-5 * float(slow.abs().max()))
    a = torch.randn(12, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(space.lift(a), exact.lift(a), rtol=0, atol=1e-5 * float(a.abs().max()))
    for basis in (space, exact):  # in the products' dtype, then into the row
        w = (a.reshape(1, -1).double() @ basis.r.t())[0]
        alone = basis.span.combine(w, basis.dtype).float()
        # a row of a stack starts wherever its index times d puts it: every float offset
        # within 64 bytes, whatever d is
        buffer = torch.full((model.d + 16,), float("nan"))
        for offset in range(16):
            row = buffer[offset:offset + model.d]
            basis.lift_into(a, row)
            assert torch.equal(row, alone), offset  # wherever the row lies in memory
        assert buffer[model.d + 15:].isnan().all()

    every = build_problem(_config(tmp_path, "k40", projection_dim=40)).algorithm  # k = m
    px, py = every.public
    near, labels = px.clone(), py.clone()
    near[1], labels[1] = px[0] + 1e-4 * px[1], py[0]  # two records' gradients nearly coincide
    every.public = (near, labels)
    assert every.source.at(x0, rows).dtype is torch.float64
