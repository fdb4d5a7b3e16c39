"""The PCDP paper's federated baselines FedLRS (Cheng et al., CVPR 2022: BLUR + LUS) and
simplified PFA (Liu et al., VLDB 2021; "projection only when communication"), both around local
DP-SGD: BLUR's gradient, LUS's top-p entries, PFA's k-coordinate upload and server step, the
ledger's ε recomputed with Opacus, and Flower = engine bit for bit."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from opacus.accountants import RDPAccountant

from dpfl.algorithms import ClientContext, ServerContext
from dpfl.algorithms.fedlrs import blur_gradient, sparsify
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.privacy import Randomness
from dpfl.problem import build_problem
from dpfl.rounds import ClientRuntime
from dpfl.runconfig import RunConfig

DIGITS = {"dataset": "digits", "model": "logistic", "num-partitions": 3,
          "num-server-rounds": 3, "batch-size": 40, "local-steps": 3, "learning-rate": 0.5,
          "clip": 0.5, "noise-multiplier": 1.0, "seed": 2, "sampling": "poisson"}
FEDLRS = {**DIGITS, "algorithm": "fedlrs", "blur-weight": 0.7, "blur-bound": 0.05}
PFA = {**DIGITS, "algorithm": "pfa-simplified", "dataset-options": "num_public=40",
       "projection-dim": 12, "server-learning-rate": 0.5}
del PFA["sampling"]  # the projection family always samples Poisson


def _config(tmp_path, values, name="run", **changes):
    return RunConfig({**values, **changes, "results-dir": str(tmp_path), "run-name": name})


def _model(path):
    return torch.cat([p.reshape(-1) for p in torch.load(path / "model.pt").values()])


def _contexts(problem, server_round=1):
    clients = list(range(problem.num_clients))
    releases = [{r.name: r for r in problem.releases(c)} for c in clients]
    client = ClientContext(server_round, Randomness(2), clients, releases, torch.device("cpu"),
                           drawn=Counter())
    server = ServerContext(server_round, Randomness(2), clients, problem.num_clients,
                           num_rounds=3, client_releases=problem.releases)
    return client, server


# ---- FedLRS ------------------------------------------------------------------------------------

def test_blurs_gradient_is_lambda_times_the_unit_update_above_the_bound_and_zero_within():
    x = torch.zeros(4)
    params = torch.tensor([[3.0, 4.0, 0.0, 0.0],  # ‖u‖ = 5 > 2: λu/5
                           [1.0, 1.0, 0.0, 0.0],  # √2 < 2: inside
                           [0.0, 0.0, 2.0, 0.0],  # on the bound: inside
                           [0.0, 0.0, 0.0, 0.0]])  # at w_g
    g = blur_gradient(params, x, 0.5, 2.0)
    assert torch.allclose(g[0], 0.5 * torch.tensor([0.6, 0.8, 0.0, 0.0]))
    assert torch.equal(g[1:], torch.zeros(3, 4))


def test_lus_keeps_exactly_the_top_p_entries_of_each_row():
    update = torch.randn(3, 101, generator=torch.Generator().manual_seed(0))
    sparse = sparsify(update, 0.3)
    for row, kept in zip(update, sparse, strict=True):
        nonzero = kept != 0
        assert int(nonzero.sum()) == 30  # round(0.3 · 101)
        assert torch.equal(kept[nonzero], row[nonzero])
        assert row[nonzero].abs().min() >= row[~nonzero].abs().max()
    # ties go to the earlier position; p = 1 uploads everything; at least one entry is kept
    assert torch.equal(sparsify(torch.tensor([[1.0, -2.0, 2.0, 0.5]]), 0.25),
                       torch.tensor([[0.0, -2.0, 0.0, 0.0]]))
    assert torch.equal(sparsify(update, 1.0), update)
    assert int((sparsify(update, 1e-9) != 0).sum()) == 3


def test_fedlrs_steps_add_blurs_gradient_before_clipping_and_upload_the_sparse_update(tmp_path):
    """From w_g, each step is DP-FedAvg's noisy gradient (the same draws) with λ(w − w_g)/‖w −
    w_g‖ added to each per-sample gradient where ‖w − w_g‖ > C_u; the upload is LUS of w_g −
    w_K."""
    fedlrs = build_problem(_config(tmp_path, FEDLRS))
    plain = build_problem(_config(tmp_path, {**DIGITS, "algorithm": "dp-fedavg"}))
    x = fedlrs.x0
    broadcast = {"x": x, "radius": torch.tensor([0.5])}
    uploads, _, _ = ClientRuntime(fedlrs.algorithm, fedlrs.releases, Randomness(2)).step(
        "train", 1, broadcast, {}, fedlrs.full_cohort())
    local, cohort = plain.algorithm.local, plain.full_cohort()
    ctx, _ = _contexts(plain)
    params = x.unsqueeze(0).repeat(3, 1)
    for k in range(3):
        u = params - x
        norms = u.norm(dim=1, keepdim=True)
        offset = torch.where(norms > 0.05, 0.7 * u / norms.clamp(min=1e-30), 0.0)
        g, _ = local.noisy_gradient(params, x, local.batches(cohort, k, ctx), 0.5, k, ctx,
                                    offset=offset)
        params = params - 0.5 * g
    delta = x - params
    assert (delta.norm(dim=1) > 0.05).all()  # BLUR acted
    d = fedlrs.model.d
    kept = uploads["delta"] != 0
    assert kept.sum(dim=1).tolist() == [round(0.5 * d)] * 3
    assert torch.allclose(uploads["delta"], torch.where(kept, delta, 0.0), atol=1e-6)
    assert all(delta[i][kept[i]].abs().min() >= delta[i][~kept[i]].abs().max() - 1e-6
               for i in range(3))


def test_fedlrs_server_steps_by_the_mean_sparse_update():
    from dpfl.algorithms.fedlrs import FedLRS

    algorithm = FedLRS.__new__(FedLRS)
    algorithm.hp = type("HP", (), {"server_learning_rate": 0.5})()
    x = torch.arange(4.0)
    ctx = ServerContext(1, Randomness(0), [0, 1], 3, num_rounds=1, client_releases=None)
    state = algorithm.server_step("train", {"x": x, "radius": torch.ones(1)},
                                  {"delta": torch.tensor([2.0, 0.0, -4.0, 0.0])}, ctx)
    assert torch.equal(state["x"], x - 0.5 * torch.tensor([1.0, 0.0, -2.0, 0.0]))


def test_fedlrs_refuses_a_fraction_outside_zero_one(tmp_path):
    with pytest.raises(ConfigError, match="lus-fraction"):
        _config(tmp_path, FEDLRS, **{"lus-fraction": 0.0})
    with pytest.raises(ConfigError, match="blur-bound"):
        _config(tmp_path, FEDLRS, **{"blur-bound": 0.0})


# ---- simplified PFA ----------------------------------------------------------------------------

def test_pfa_uploads_the_plain_updates_coordinates_and_the_server_lifts_their_mean(tmp_path):
    """The client takes DP-SGD's unprojected steps (as dp-sgd, the same draws) and uploads
    u_i = Vᵀ(w_g − w_K) in the round's public subspace; the server sets w_g − γ_g·V·mean_i u_i."""
    problem = build_problem(_config(tmp_path, PFA))
    plain = build_problem(_config(tmp_path, {**{k: v for k, v in PFA.items() if k != "projection-dim"},
                                              "algorithm": "dp-sgd"}))
    algorithm = problem.algorithm
    client, server = _contexts(problem)
    state = algorithm.begin_round(algorithm.init_server_state(problem.x0), server)
    broadcast = algorithm.broadcast("train", state, 1)
    uploads, _, _ = ClientRuntime(algorithm, problem.releases, Randomness(2)).step(
        "train", 1, broadcast, {}, problem.full_cohort())
    local, _ = plain.algorithm.local_steps(state["x"], plain.full_cohort(), {}, broadcast,
                                           client)
    space = algorithm.upload_space(broadcast, torch.device("cpu"))
    assert uploads["u"].shape == (3, 12)
    assert torch.allclose(uploads["u"], space.coords(state["x"] - local), atol=1e-6)
    # V is orthonormal: its coordinates' lift is the update's projection, not the update
    lifted = space.lift(uploads["u"])
    assert torch.allclose(space.coords(lifted), uploads["u"], atol=1e-5)
    assert (lifted - (state["x"] - local)).norm() > 1e-3
    after = algorithm.server_step("train", state, {"u": uploads["u"].sum(dim=0)}, server)
    assert torch.allclose(after["x"], state["x"] - 0.5 * space.lift(uploads["u"].mean(dim=0)),
                          atol=1e-6)


def test_pfa_refuses_a_dataset_without_public_records(tmp_path):
    with pytest.raises(ConfigError, match="public"):
        run(_config(tmp_path, {**PFA, "dataset-options": ""}), echo=False)


# ---- both -------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [FEDLRS, PFA], ids=["fedlrs", "pfa-simplified"])
def test_the_ledger_is_opacus_rdp_of_the_steps_each_client_ran(values, tmp_path):
    """Recomputed independently: Opacus' RDP accountant stepped by hand with each client's own
    release (noise multiplier, its sample rate b/n_c) for K steps in each round it took part
    in."""
    values = {**values, "num-partitions": 5, "fraction-train": 0.6, "num-server-rounds": 4}
    summary = run(_config(tmp_path, values), echo=False)
    problem = build_problem(_config(tmp_path, values, "p"))
    taken = Counter(c for r in range(1, 5)
                    for c in problem.algorithm.participants(r, list(range(5)), Randomness(2)))
    epsilons = []
    for c in taken:
        release = summary["releases"][str(c)][0]
        rdp = RDPAccountant()
        for _ in range(release["steps"] * taken[c]):
            rdp.step(noise_multiplier=release["noise_multiplier"],
                     sample_rate=release["sample_rate"])
        epsilons.append(rdp.get_epsilon(1e-5))
    assert summary["epsilon_max"] == pytest.approx(max(epsilons), rel=1e-6)


@pytest.mark.parametrize("values", [FEDLRS, PFA], ids=["fedlrs", "pfa-simplified"])
def test_flower_code_path_equals_engine(values, tmp_path):
    from tests.inprocess_grid import run_flower_code_path

    values = {**values, "fraction-train": 0.67, "results-dir": str(tmp_path)}
    engine = run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": i} for i in range(3)])
    assert torch.equal(_model(tmp_path / "engine"), _model(tmp_path / "flower"))
    assert engine["rounds_completed"] == 3
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert summary["epsilon_max"] == pytest.approx(engine["epsilon_max"])
