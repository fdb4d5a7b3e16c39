"""The Clip21 family (Islamov et al., arXiv:2502.11682): fixed points, the non-convergence
construction, reductions, the update rules of Alg. 3, partial participation, calibration,
Flower == engine."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from dpfl.algorithms import ALGORITHMS, Cohort, ServerContext
from dpfl.algorithms.clip21 import clip21_paper_noise_std, clip21_practice_noise_std
from dpfl.client.node_ledger import NodeLedger
from dpfl.errors import ConfigError
from dpfl.models import FlatModel, build_model
from dpfl.privacy import PrivacyLedger, Randomness, Release, clip_by_norm, stds
from dpfl.problem import build_problem
from dpfl.rounds import ClientRuntime, sum_rows
from dpfl.runconfig import RunConfig
from tests.inprocess_grid import InProcessGrid, run_flower_code_path

CPU = torch.device("cpu")


def _manual(alg, cohort, multiplier):
    """Releases of ``alg`` for ``cohort``'s clients at a given ``noise-multiplier``."""
    return lambda c: [Release.of(q, q.multiplier_of(multiplier))
                      for q in alg.queries(cohort.sizes[cohort.ids.index(c)])]


def _drive(alg, cohort, x0, rounds, *, seed=0, releases=None):
    """Run ``alg`` as the engine does (participants' rows only, the real client runtime adding
    the noise, the server stepping on the sums); one record per round."""
    rng = Randomness(seed)
    runtime = ClientRuntime(alg, releases or _manual(alg, cohort, 0.0), rng, diagnostics=True)
    server = alg.init_server_state(x0)
    states = alg.init_client_state(len(cohort))
    history = []
    for r in range(1, rounds + 1):
        ids = alg.participants(r, list(cohort.ids), rng)
        pos = torch.tensor([cohort.ids.index(c) for c in ids])
        before = {k: v.clone() for k, v in states.items()}
        uploads, rows, metrics = runtime.step("train", r, alg.broadcast("train", server, r),
                                              {k: v[pos] for k, v in states.items()},
                                              cohort.select(pos.tolist()))
        for k, v in rows.items():
            states[k][pos] = v
        server = alg.server_step("train", server, sum_rows(uploads, CPU),
                                 ServerContext(r, rng, ids, len(cohort)))
        history.append({"ids": ids, "before": before, "states": {k: v.clone() for k, v in
                                                                 states.items()},
                        "server": server, "uploads": uploads, "metrics": metrics})
    return history


def _algorithm(name, model, **values):
    config = RunConfig({"algorithm": name, "noise-multiplier": 0.0,
                        **{k.replace("_", "-"): v for k, v in values.items()}})
    return ALGORITHMS.get(name)(config.hyperparameters, model,
                                num_clients=int(config["num-partitions"]))


def _digits(small_config, name, **changes):
    problem = build_problem(small_config(algorithm=name, **changes))
    return problem, problem.full_cohort()


def _run(problem, cohort, rounds=3):
    """``_drive`` on a built problem (digits, 4 clients by default)."""
    return _drive(problem.algorithm, cohort, problem.x0, rounds, releases=problem.releases)


# ---- Example 2.1 (§3.1): n = 2, d = 1, f_1 = ½(x−3)², f_2 = ½(x+3)², τ = 1 -------------------

@pytest.fixture
def example_2_1():
    """Client i holds one record (a = 1, y = ±3) of the least-squares model, so its full-batch
    gradient is x ∓ 3 (batch = the whole local set: the GD versions)."""
    model = FlatModel(build_model("least-squares", input_shape=(1,), num_classes=1, seed=0),
                      "squared")
    cohort = Cohort([0, 1], torch.ones(2, 1), torch.tensor([3.0, -3.0]),
                    [torch.tensor([0]), torch.tensor([1])])
    return model, cohort


@pytest.mark.parametrize("x0", [-2.0, -0.7, 1.5, 2.0])
def test_example_2_1_clip_gd_stays_at_any_point_of_minus_2_2(example_2_1, x0):
    model, cohort = example_2_1
    alg = _algorithm("clip-sgd", model, num_partitions=2, batch_size=1, clip=1.0,
                     learning_rate=0.1)
    history = _drive(alg, cohort, torch.tensor([x0]), 50)
    assert all(abs(h["server"]["x"].item() - x0) < 1e-6 for h in history)
    assert history[0]["metrics"]["clip-active"].sum() >= 1  # clipping is what stalls it


@pytest.mark.parametrize("name, extra", [("clip21-sgd", {}),
                                         ("clip21-sgd2m", {"beta": 0.5}),
                                         ("clip21-sgd2m", {"beta": 0.9, "beta_hat": 0.5})])
def test_example_2_1_clip21_gd_and_clip21_sgd2m_converge_to_the_optimum(example_2_1, name, extra):
    model, cohort = example_2_1
    alg = _algorithm(name, model, num_partitions=2, batch_size=1, clip=1.0, learning_rate=0.1,
                     **extra)
    history = _drive(alg, cohort, torch.tensor([1.5]), 300)
    assert abs(history[-1]["server"]["x"].item()) < 1e-4
    assert any(h["metrics"]["clip-active"].sum() >= 1 for h in history)


# ---- Theorem 2.2 (§3.3): idealized stochastic Clip21, eq. (6) ----------------------------------

def test_theorem_2_2_idealized_clip21_mean_iterate_is_biased():
    """n = 1, f = (L/2)||x||², gradient Lx + ξ, ξ uniform on {z1, z2, z3}, τ < 3√3σ/10: the
    time-average of x^t under eq. (6) tends to −(τ/(15L))·(2, 1) = (−0.0667, −0.0333)."""
    L, tau, sigma, gamma, steps = 2.0, 1.0, 5.0, 0.1, 40_000
    z = torch.tensor([[3.0, 0.0], [0.0, 4.0], [-3.0, -4.0]], dtype=torch.float64) * math.sqrt(
        3 * sigma**2 / 100)
    assert tau < 3 * math.sqrt(3) * sigma / 10
    assert torch.allclose(clip_by_norm(z, tau).mean(dim=0),
                          tau / 15 * torch.tensor([2.0, 1.0], dtype=torch.float64))
    xi = z[torch.randint(3, (steps,), generator=torch.Generator().manual_seed(0))]
    clipped = clip_by_norm(xi, tau)  # clip_τ(∇f(x, ξ) − ∇f(x)) = clip_τ(ξ)
    x = torch.tensor([0.0, -0.07], dtype=torch.float64)
    g = L * x + clipped[0]
    total = torch.zeros(2, dtype=torch.float64)
    for t in range(1, steps):
        x = x - gamma * g                       # x^{t+1} = x^t − γ g^t
        g = L * x + clipped[t]                  # g^{t+1} = ∇f(x^{t+1}) + clip_τ(ξ^{t+1})
        total += x
    mean = total / (steps - 1)
    expected = -tau / (15 * L) * torch.tensor([2.0, 1.0], dtype=torch.float64)
    assert torch.allclose(mean, expected, atol=0.006)
    assert expected.norm() > 0.07


# ---- Reductions (§2.4) ------------------------------------------------------------------------

def test_beta_and_beta_hat_one_is_clip21_sgd_step_for_step(small_config):
    kw = dict(noise_multiplier=1.0, clip=0.5, learning_rate=0.3)
    sgd2m, cohort = _digits(small_config, "clip21-sgd2m", beta=1.0, beta_hat=1.0, **kw)
    sgd, _ = _digits(small_config, "clip21-sgd", **kw)
    for a, b in zip(_run(sgd2m, cohort), _run(sgd, cohort), strict=True):
        assert torch.equal(a["uploads"]["c"], b["uploads"]["c"])
        assert torch.equal(a["server"]["x"], b["server"]["x"])
        assert torch.equal(a["states"]["g"], b["states"]["g"])


@pytest.mark.parametrize("name, beta, beta_hat", [("clip21-sgd2m", 0.5, 0.7),
                                                  ("clip21-sgd", 1.0, 1.0)])
def test_the_algorithm_is_the_box_of_algorithm_3(small_config, name, beta, beta_hat):
    """Alg. 3 (DP version) written out line by line (§2.2) with g⁰ = v⁰ = 0, initialisation (a):
    round r is iteration t = r − 1 and leaves the server at x^{t+2} = x^{t+1} − γg^{t+1}. Its
    first iteration (x¹ = x⁰) is also initialisation (b) of §2.5: v_i⁰ = β∇f_i(x⁰, ξ),
    g_i⁰ = β̂·clip_τ(v_i⁰), g⁰ = β̂·mean_i(c_i⁰)."""
    tau, gamma, z = 0.05, 0.3, 1.0
    momentum = {"beta": beta, "beta_hat": beta_hat} if name == "clip21-sgd2m" else {}
    problem, cohort = _digits(small_config, name, noise_multiplier=z, clip=tau,
                              learning_rate=gamma, **momentum)
    assert (problem.algorithm.hp.beta, problem.algorithm.hp.beta_hat) == (beta, beta_hat)
    history = _run(problem, cohort, rounds=4)
    rng, d = Randomness(0), problem.model.d
    x, g = problem.x0.clone(), torch.zeros(d)
    v, gi = torch.zeros(4, d), torch.zeros(4, d)
    for t, h in enumerate(history):
        x = x - gamma * g                                                         # line 3
        xb, yb = cohort.sample(rng, t + 1, "batch", 16)
        v = (1 - beta) * v + beta * problem.model.batch_gradients(x, xb, yb)     # line 5
        omega = rng.normal(cohort.ids, t + 1, "noise", (d,), torch.full((4,), z * tau))
        u = clip_by_norm(v - gi, tau)
        c = u + omega                                                             # line 7
        gi = gi + beta_hat * u                                                    # line 8
        g = g + beta_hat * c.mean(dim=0)                                          # line 10
        if t == 0:
            assert torch.equal(x, problem.x0)  # x¹ = x⁰
        assert torch.allclose(h["uploads"]["c"], c, atol=1e-6)
        assert torch.allclose(h["states"]["g"], gi, atol=1e-6)
        assert torch.allclose(h["server"]["x"], x - gamma * g, atol=1e-6)
    assert history[-1]["metrics"]["clip-active"].sum() >= 1


def test_plus_clips_per_sample_inside_the_momentum_and_sends_no_fresh_noise(small_config):
    """Alg. 5 round 1 from zero state: v = β((1/b)Σ_j clip_{τ_in}(∇f_ij(x⁰)) + ω), c = clip_τ(v)."""
    tau_in, tau, beta, z, b = 4.8, 0.02, 0.5, 2.0, 16  # per-sample norms ≈ 4–5.4 at x⁰
    problem, cohort = _digits(small_config, "clip21-sgd2m-plus", noise_multiplier=z, clip=tau,
                              clip_inner=tau_in, beta=beta)
    (h,) = _run(problem, cohort, rounds=1)
    rng = Randomness(0)
    xb, yb = cohort.sample(rng, 1, "batch", b)
    grads = problem.model.per_sample_gradients(problem.x0, xb, yb)
    omega = rng.normal(cohort.ids, 1, "noise", (problem.model.d,),
                       torch.full((4,), z * tau_in / b))  # std = nm·τ_in/b on the mean
    v = beta * (clip_by_norm(grads, tau_in).mean(dim=1) + omega)
    assert torch.allclose(h["states"]["v"], v, atol=1e-6)
    assert torch.allclose(h["uploads"]["c"], clip_by_norm(v, tau), atol=1e-7)
    assert h["metrics"]["clip-active"].tolist() == [1.0] * 4
    assert 0 < h["metrics"]["clipped-fraction"].mean() < 1


def test_no_noise_no_clipping_beta_one_is_heavy_ball_sgd(small_config):
    """σ_ω = 0, τ = ∞, β = 1: g^{t+1} = (1 − β̂) g^t + (β̂/n) Σ_i ∇f_i(x^{t+1}, ξ_i)."""
    problem, cohort = _digits(small_config, "clip21-sgd2m", noise_multiplier=0.0, clip=1e9,
                              beta=1.0, beta_hat=0.3, learning_rate=0.5)
    history = _run(problem, cohort, rounds=4)
    rng, x, g = Randomness(0), problem.x0.clone(), torch.zeros(problem.model.d)
    for r, h in enumerate(history, start=1):
        xb, yb = cohort.sample(rng, r, "batch", 16)
        g = 0.7 * g + 0.3 * problem.model.batch_gradients(x, xb, yb).mean(dim=0)
        x = x - 0.5 * g
        assert torch.allclose(h["server"]["x"], x, atol=1e-6)
    assert h["metrics"]["clip-active"].sum() == 0


@pytest.mark.parametrize("name, changes, equal", [
    ("clip21-sgd2m", {}, True),
    ("clip21-sgd2m", {"fraction_train": 0.5, "pp_scaling": "n"}, True),
    ("clip21-sgd2m", {"fraction_train": 0.5}, False),  # β̂/s as printed: g ≠ ḡ (§2.8)
    ("clip21-sgd2m-plus", {"noise_multiplier": 2.0}, True),  # no fresh noise in the message
])
def test_without_message_noise_server_direction_is_the_mean_client_shift(small_config, name,
                                                                        changes, equal):
    values = {"noise_multiplier": 0.0, "clip": 0.05, "beta": 0.5, "beta_hat": 0.7,
              "num_partitions": 4, **changes}
    problem, cohort = _digits(small_config, name, **values)
    history = _run(problem, cohort, rounds=4)
    gaps = [((h["server"]["g"] - h["states"]["g"].mean(dim=0)).abs().max()
             / h["server"]["g"].abs().max()).item() for h in history]
    assert max(gaps) < 1e-5 if equal else min(gaps[1:]) > 0.1
    assert history[-1]["metrics"]["clip-active"].sum() >= 1


def test_clip_sgd_depends_only_on_gamma_times_tau(small_config):
    """Every client vector clipped and σ_ω ∝ τ: the update is γτ·(unit vector + ω/τ) (§3.1)."""
    def run(tau, gamma):
        problem, cohort = _digits(small_config, "clip-sgd", clip=tau, learning_rate=gamma,
                                  noise_multiplier=2.0)
        history = _run(problem, cohort, rounds=3)
        assert all(h["metrics"]["clip-active"].all() for h in history)
        return history[-1]["server"]["x"]

    a, b, c = run(1e-3, 2.0), run(2e-3, 1.0), run(2e-3, 2.0)
    assert torch.allclose(a, b, atol=1e-7, rtol=1e-5)
    assert not torch.allclose(a, c, atol=1e-5)


def test_per_sample_clip_sgd_is_dpsgd_gc(small_config):
    """§3.5's per-sample Clip-SGD is DP-SGD with client noise: DPSGD-GC, bit for bit."""
    kw = dict(noise_multiplier=1.5, clip=0.2, learning_rate=0.5)
    clip_sgd, cohort = _digits(small_config, "clip-sgd", clipping="per-sample", **kw)
    dpsgd, _ = _digits(small_config, "dpsgd-gc", **kw)
    assert clip_sgd.releases(0) == dpsgd.releases(0)
    a, b = _run(clip_sgd, cohort), _run(dpsgd, cohort)
    assert torch.equal(a[-1]["server"]["x"], b[-1]["server"]["x"])


# ---- The rules of Alg. 3 (§2.2) ---------------------------------------------------------------

def test_noise_enters_the_message_only_and_one_clipped_vector_updates_the_shift(small_config):
    tau, beta, beta_hat = 0.05, 0.5, 0.7
    clean, cohort = _digits(small_config, "clip21-sgd2m", noise_multiplier=0.0, clip=tau,
                            beta=beta, beta_hat=beta_hat)
    noisy, _ = _digits(small_config, "clip21-sgd2m", noise_multiplier=3.0, clip=tau, beta=beta,
                       beta_hat=beta_hat)
    state = _run(clean, cohort, rounds=2)[-1]  # a non-zero (v, g) to start from
    ids = cohort.ids

    def step(problem):
        runtime = ClientRuntime(problem.algorithm, problem.releases, Randomness(0),
                                diagnostics=True)
        return runtime.step("train", 3, {"x": state["server"]["x"]}, state["states"], cohort)

    (up0, new0, _), (up1, new1, metrics) = step(clean), step(noisy)
    assert all(torch.equal(new0[k], new1[k]) for k in ("v", "g"))  # g_i (and v_i) noise-free
    u = up0["c"]
    assert torch.allclose(new0["g"], state["states"]["g"] + beta_hat * u)  # the same u_i ...
    assert torch.allclose(u, clip_by_norm(new0["v"] - state["states"]["g"], tau))  # ... = clip
    assert (torch.linalg.vector_norm(u, dim=1) <= tau * (1 + 1e-6)).all()
    assert metrics["clip-active"].tolist() == [1.0] * 4
    noise = up1["c"] - u
    assert torch.allclose(noise.std(dim=1), torch.full((4,), 3.0 * tau), rtol=0.03)  # σ = nm·τ

    ctx = ServerContext(3, Randomness(0), list(ids), 4)
    server = noisy.algorithm.server_step("train", state["server"], sum_rows(up1, CPU), ctx)
    g = state["server"]["g"] + beta_hat * up1["c"].mean(dim=0)  # line 10, not a mean of g_i
    assert torch.allclose(server["g"], g)
    assert torch.allclose(server["x"], state["server"]["x"] - noisy.algorithm.hp.learning_rate * g)


def test_alpha_normec_sends_norm_alpha_with_sensitivity_two_and_has_no_clip(small_config):
    problem, cohort = _digits(small_config, "alpha-normec", noise_multiplier=0.0,
                              normec_alpha=0.5, beta_hat=0.5)
    history = _run(problem, cohort, rounds=2)
    first = history[0]
    fresh = first["states"]["g"] / 0.5  # g_i¹ = β̂·Norm_α(∇f_i − 0)
    norms = torch.linalg.vector_norm(first["uploads"]["c"], dim=1)
    assert torch.allclose(first["uploads"]["c"], fresh)
    assert torch.allclose(norms, (first["metrics"]["clip-input-norm"] / (0.5 + first["metrics"][
        "clip-input-norm"])).float())
    assert (norms < 1).all() and (norms > 1e-3).all()
    (release,) = problem.releases(0)
    assert release.sensitivity() == 2.0
    noisy, _ = _digits(small_config, "alpha-normec", noise_multiplier=3.0)
    assert stds(noisy.releases(0)).tolist() == [3.0]  # nm·1: the message norm is below 1
    with pytest.raises(ConfigError, match="'clip': not used by algorithm 'alpha-normec'"):
        build_problem(small_config(algorithm="alpha-normec", clip=1e-4))


def test_alpha_normec_with_alpha_to_zero_is_clip21_sgd_with_tau_beta_hat(small_config):
    """With α ≪ ‖∇f_i − g_i‖, Norm_α(u) → u/‖u‖, so β̂·Norm_α(u) = clip_τ(u) for τ = β̂ < ‖u‖, and
    the noise (σ·1 on the message, then β̂ at the server) is Clip21-SGD's σ·τ: α-NormEC below
    the paper's grid (β̂ ≤ 1e-3) is Clip21-SGD with τ = β̂, same draws, step for step
    (docs/reproductions.md, "Below the grid": the two methods' seeds end within 0.2 points at
    ε = 3)."""
    kw = dict(noise_multiplier=1.5, learning_rate=0.3)
    normec, cohort = _digits(small_config, "alpha-normec", normec_alpha=1e-12, beta_hat=1e-3,
                             **kw)
    clip21, _ = _digits(small_config, "clip21-sgd", clip=1e-3, **kw)
    reference = _run(clip21, cohort)
    for a, b in zip(_run(normec, cohort), reference, strict=True):
        assert b["metrics"]["clip-active"].all()  # ‖u‖ > τ: every vector clipped to τ
        assert torch.allclose(1e-3 * a["uploads"]["c"], b["uploads"]["c"], rtol=1e-5, atol=1e-9)
        assert torch.allclose(a["states"]["g"], b["states"]["g"], rtol=1e-5, atol=1e-9)
        assert torch.allclose(a["server"]["x"], b["server"]["x"], rtol=1e-5, atol=1e-7)
    moved = reference[-1]["server"]["x"] - reference[0]["server"]["x"]
    assert moved.abs().max() > 1e-5  # the models moved: the comparison is not of two zeros


def test_alpha_normec_server_normalisation_keeps_g_unit_and_steps_gamma(small_config):
    """``normec-normalize``: g ← (g + β̂·mean c)/||·|| is kept, x moves by exactly γ; off, the
    same messages give the unnormalised g of line 10 (the option is the only difference)."""
    runs = {flag: _run(*_digits(small_config, "alpha-normec", noise_multiplier=1.0,
                                normec_alpha=0.1, beta_hat=0.5, normec_normalize=flag), rounds=3)
            for flag in (False, True)}
    gamma = small_config(algorithm="alpha-normec", noise_multiplier=1.0)["learning-rate"]
    previous = torch.zeros_like(runs[True][0]["server"]["g"])
    for plain, normed in zip(runs[False], runs[True], strict=True):
        g = normed["server"]["g"]
        assert torch.linalg.vector_norm(g).item() == pytest.approx(1.0, rel=1e-6)
        expected = previous + 0.5 * normed["uploads"]["c"].mean(dim=0)
        assert torch.allclose(g, expected / torch.linalg.vector_norm(expected))
        previous = g
        assert plain["uploads"]["c"].shape == normed["uploads"]["c"].shape
    first_plain, first_normed = runs[False][0], runs[True][0]
    assert torch.equal(first_plain["uploads"]["c"], first_normed["uploads"]["c"])  # same round 1
    assert torch.linalg.vector_norm(first_plain["server"]["g"]).item() != pytest.approx(1.0)
    steps = [torch.linalg.vector_norm(b["server"]["x"] - a["server"]["x"]).item()
             for a, b in zip(runs[True], runs[True][1:])]
    assert steps == pytest.approx([gamma, gamma], rel=1e-5)

# ---- Partial participation (Alg. 4, §2.8) -----------------------------------------------------

def test_partial_participation_samples_s_clients_and_freezes_the_idle_ones(small_config):
    problem, cohort = _digits(small_config, "clip21-sgd2m", num_partitions=6, fraction_train=0.5,
                              noise_multiplier=1.0, beta=0.5)
    history = _run(problem, cohort, rounds=4)
    assert len({tuple(h["ids"]) for h in history}) > 1
    for h in history:
        assert len(h["ids"]) == 3 and h["ids"] == sorted(set(h["ids"]))
        for c in range(6):
            for k in ("v", "g"):
                same = torch.equal(h["states"][k][c], h["before"][k][c])
                assert same == (c not in h["ids"])


# ---- Calibration (App. G, the experiments' mapping, Opacus) ------------------------------------

EPSILONS = [3.0, 5.2, 9.0, 15.6, 27.0]
CLIP_KEYS = {"clip21-sgd2m": {"clip": 0.3}, "clip-sgd": {"clip": 0.3}, "alpha-normec": {},
             "clip21-sgd2m-plus": {"clip": 0.3, "clip_inner": 0.05}}


def test_practice_and_paper_formulas_match_the_spec():
    practice = [clip21_practice_noise_std(epsilon=e, delta=1e-3, rounds=5625, clip=1.0)
                for e in EPSILONS]
    paper = [clip21_paper_noise_std(epsilon=e, delta=1e-3, rounds=5625, clip=1.0)
             for e in EPSILONS]
    assert practice == pytest.approx([65.7, 37.9, 21.9, 12.6, 7.30], rel=3e-3)
    assert paper == pytest.approx([2087, 1204, 696, 401, 232], rel=3e-3)
    assert clip21_practice_noise_std(epsilon=3.0, delta=1e-3, rounds=5625, clip=0.01) == \
        pytest.approx(0.657, rel=3e-3)


@pytest.mark.parametrize("name, radius, per_sample", [
    ("clip21-sgd2m", 0.3, False), ("clip-sgd", 0.3, False), ("alpha-normec", 1.0, False),
    ("clip21-sgd2m-plus", 0.05, True)])
@pytest.mark.parametrize("calibration", ["paper", "practice"])
def test_release_is_the_formula_noise_over_the_replace_one_sensitivity(small_config, name, radius,
                                                                       per_sample, calibration):
    problem = build_problem(small_config(algorithm=name, calibration=calibration, epsilon=3.0,
                                         delta=1e-3, num_server_rounds=5625,
                                         **CLIP_KEYS[name]))
    m, b = len(problem.partitions[0]), 16
    (release,) = problem.releases(0)
    formula = clip21_paper_noise_std if calibration == "paper" else clip21_practice_noise_std
    if per_sample:  # query (1/b)Σ clip_{τ_in}: sensitivity 2τ_in/b, sample rate b/m
        assert release.sample_rate == pytest.approx(b / m)
        sigma = (formula(epsilon=3.0, delta=1e-3, rounds=5625, clip=radius / b)
                 if calibration == "paper" else
                 b / m * formula(epsilon=3.0, delta=1e-3, rounds=5625, clip=radius))
        assert release.noise_multiplier == pytest.approx(sigma / (2 * radius / b))
    else:
        assert release.sample_rate == 1.0
        sigma = formula(epsilon=3.0, delta=1e-3, rounds=5625, clip=radius)
        assert release.noise_multiplier == pytest.approx(sigma / (2 * radius))
    if calibration == "practice" and not per_sample:
        assert release.noise_multiplier == pytest.approx(65.7 / 2, rel=3e-3)


@pytest.mark.parametrize("name", ["clip21-sgd2m", "clip21-sgd2m-plus"])
def test_practice_horizon_epochs_counts_passes_over_the_local_data(small_config, name):
    """T = rounds/⌊m/b⌋ under practice-horizon="epochs": √⌊m/b⌋ times less noise."""
    config = small_config(algorithm=name, calibration="practice", epsilon=3.0, delta=1e-3,
                          num_server_rounds=5625, **CLIP_KEYS[name])
    by_rounds = build_problem(config).releases(0)[0]
    by_epochs = build_problem(config.replace(practice_horizon="epochs")).releases(0)[0]
    m, b = len(build_problem(config).partitions[0]), 16
    assert m // b > 1 and by_epochs.sample_rate == by_rounds.sample_rate
    assert by_epochs.noise_multiplier == pytest.approx(
        by_rounds.noise_multiplier / math.sqrt(m // b), rel=1e-12)


@pytest.mark.parametrize("name, extra", [("clip21-sgd2m", {}), ("clip21-sgd2m-plus", {}),
                                         ("clip-sgd", {"clipping": "per-sample"})])
def test_accountant_calibration_reaches_the_target_epsilon(small_config, name, extra):
    problem = build_problem(small_config(algorithm=name, epsilon=2.0, delta=1e-5,
                                         num_server_rounds=50, **extra))
    (release,) = problem.releases(0)
    assert release.sample_rate == (1.0 if name == "clip21-sgd2m" else
                                   16 / len(problem.partitions[0]))
    ledger = PrivacyLedger(accountant="rdp", relation=problem.algorithm.relation)
    for _ in range(50):
        ledger.record(release)
    assert 1.98 <= ledger.epsilon(1e-5) <= 2.0


def test_noise_multiplier_follows_the_opacus_convention(small_config):
    for name in ("clip21-sgd2m", "alpha-normec", "clip21-sgd2m-plus"):
        problem = build_problem(small_config(algorithm=name, noise_multiplier=3.0))
        assert problem.releases(0)[0].noise_multiplier == 1.5  # std / (2·radius) replace-one


# ---- Flower's code path == the engine ---------------------------------------------------------

class SnapshotGrid(InProcessGrid):
    """Records every client's saved state after each exchange."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.snapshots: list[dict[int, dict[str, torch.Tensor]]] = []

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        if any(m.metadata.message_type == "train" for m in messages):
            snap = {}
            for node, ctx in self.contexts.items():
                record = ctx.state.get(f"dpfl.state.{node - 1}")
                if record is not None:
                    snap[node - 1] = {k: torch.from_numpy(record[k].numpy().copy())
                                      for k in record}
            self.snapshots.append(snap)
        return replies


def _flower(values, num_clients):
    return run_flower_code_path(values, [{"partition-id": i} for i in range(num_clients)],
                                grid_class=SnapshotGrid)

def _rounds(path):
    rounds = [json.loads(x) for x in (path / "rounds.jsonl").read_text().splitlines()]
    for r in rounds:
        r.pop("seconds")
    return rounds


@pytest.mark.parametrize("name, clients, rounds, extra", [
    ("clip21-sgd2m", 6, 4, {"fraction-train": 0.5, "beta": 0.5, "beta-hat": 0.5}),
    ("clip21-sgd2m-plus", 4, 3, {"clip-inner": 0.5, "beta": 0.5}),
])
def test_flower_code_path_equals_the_engine(tmp_path, name, clients, rounds, extra):
    from dpfl.engine import run

    values = {"algorithm": name, "num-partitions": clients, "num-server-rounds": rounds,
              "batch-size": 8, "learning-rate": 0.5, "clip": 0.1, "noise-multiplier": 1.0,
              "seed": 3, "results-dir": str(tmp_path), "non-private-diagnostics": True, **extra}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    grid, problem = _flower({**values, "run-name": "flower"}, clients)
    engine = torch.load(tmp_path / "engine" / "model.pt")
    flower = torch.load(tmp_path / "flower" / "model.pt")
    assert all(torch.equal(engine[k], flower[k]) for k in engine)
    e_rounds, f_rounds = _rounds(tmp_path / "engine"), _rounds(tmp_path / "flower")
    assert e_rounds == f_rounds
    assert "clip_active" in e_rounds[0] and "train_loss" in e_rounds[0]

    # Exactly s participants per round; idle clients keep (v, g); ledger steps = participations.
    rng = Randomness(3)
    picks = [problem.algorithm.participants(r, list(range(clients)), rng)
             for r in range(1, rounds + 1)]
    s = round(float(values.get("fraction-train", 1.0)) * clients)
    assert [r["participants"] for r in e_rounds] == [s] * rounds
    previous: dict[int, dict[str, torch.Tensor]] = {}
    for ids, snap in zip(picks, grid.snapshots, strict=True):
        for c, state in snap.items():
            if c not in ids:
                assert all(torch.equal(state[k], previous[c][k]) for k in state)
        assert set(ids) <= set(snap)
        previous = snap
    for node, context in grid.contexts.items():
        c = node - 1
        taken = sum(c in ids for ids in picks)
        record = context.state.get(f"dpfl.node.{c}")
        steps = 0 if record is None else sum(
            e[3] for e in NodeLedger.from_json(str(record["json"])).events)
        assert steps == taken


# ---- Fig. 1 (§5 E0): stochastic Clip21-SGD stalls, Clip21-SGD2M does not -----------------------

def test_clip21_sgd2m_beats_clip21_sgd_on_the_theorem_2_2_quadratic():
    """The Thm 2.2 construction (L = 2, σ = 5, τ = 1, x⁰ = (0, −0.07)) as a model: one client
    with three records whose gradients are 2x + z_k, batch size 1."""
    L, sigma = 2.0, 5.0
    z = torch.tensor([[3.0, 0.0], [0.0, 4.0], [-3.0, -4.0]]) * math.sqrt(3 * sigma**2 / 100)
    first, second = nn.Linear(1, 2), nn.Linear(2, 2, bias=False)  # x = first.bias
    with torch.no_grad():
        first.weight.zero_(), first.bias.zero_(), second.weight.copy_(math.sqrt(L) * torch.eye(2))
    first.weight.requires_grad_(False), second.weight.requires_grad_(False)
    model = FlatModel(nn.Sequential(first, second), "squared")  # ½||√L·x − y||², y = −z/√L
    cohort = Cohort([0], torch.zeros(3, 1), -z / math.sqrt(L), [torch.arange(3)])
    x0 = torch.tensor([0.0, -0.07])

    def mean_sq_grad(name, **kw):
        alg = _algorithm(name, model, num_partitions=1, batch_size=1, clip=1.0,
                         learning_rate=0.05, **kw)
        xs = torch.stack([h["server"]["x"] for h in _drive(alg, cohort, x0, 1500)])
        return (L * xs[500:]).square().sum(dim=1).mean().item()

    assert mean_sq_grad("clip21-sgd2m", beta=0.02) < 0.5 * mean_sq_grad("clip21-sgd")


def test_gaussian_added_oracle_adds_the_requested_gradient_noise(small_config):
    """The Gaussian-added oracle: message − clean message ~ N(0, σ²) when nothing is clipped."""
    clean, cohort = _digits(small_config, "clip-sgd", clip=1e9, noise_multiplier=0.0)
    noisy, _ = _digits(small_config, "clip-sgd", clip=1e9, noise_multiplier=0.0,
                       gradient_noise=0.05)

    def message(problem):
        runtime = ClientRuntime(problem.algorithm, problem.releases, Randomness(0))
        return runtime.step("train", 1, {"x": problem.x0}, {}, cohort)[0]["c"]

    assert torch.allclose((message(noisy) - message(clean)).std(dim=1),
                          torch.full((4,), 0.05), rtol=0.03)


def test_the_unit_pixel_variant_of_e3_changes_the_scaling_alone():
    from dpfl_reproductions.clip21 import e3_base

    standard, unit = e3_base("epochs"), e3_base("epochs", "unit")
    assert "dataset-options" not in standard  # the archived runs keep their keys
    assert {k: v for k, v in unit.items() if k != "dataset-options"} == standard
    assert unit["dataset-options"] == 'scaling="unit"'
    RunConfig({**unit, "algorithm": "clip-sgd", "model": "mlp", "epsilon": 15.6})
