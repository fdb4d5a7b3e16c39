"""Per-sample clipping functions (``clipping-function``): flat, auto-s, nsgd and psac.

Each maps a per-sample gradient g to φ_C(g) = w_C(‖g‖)·g with ‖φ_C(g)‖ < C (flat: ≤ C), so a
release's sensitivity, its noise σC and the ledger are flat clipping's at the same C
(docs/privacy.md, "Clipping functions"). Stated here: the norm bound on random and adversarial
norms and through the per-sample engine's paths, the factor as its formula, a non-finite record
dropped as under flat clipping, the same ledger as the flat run's and dp-accounting's, a
neighbour moving each release by at most its sensitivity, which algorithms offer the option and
which refuse it with one line, and the gradient canary's tight audit of a non-flat function.
"""

from __future__ import annotations

import math

import pytest
import torch

from dpfl.algorithms import ALGORITHMS
from dpfl.config import CLIPPING_FUNCTION, FLOAT32_MAX, FLOAT32_TINY
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.models import FlatModel, build_model
from dpfl.privacy import clip_factors, independent
from dpfl.privacy.clipping import CLIPPING_FUNCTIONS, FLAT, clipping_function
from dpfl.runconfig import RunConfig

NAMES = CLIPPING_FUNCTIONS.names()
OTHERS = [name for name in NAMES if name != "flat"]
#: each function's own stability constant r
OWN_R = {"flat": 0.0, "auto-s": 1e-2, "nsgd": 1e-2, "psac": 1e-4}
#: the algorithms that clip per sample, which offer the option (clip-sgd with clipping
#: "per-sample"); the others clip a client's whole message and refuse it
PER_SAMPLE = {"adaptdp-fedavg", "clip-sgd", "clip21-sgd2m-plus", "dp-fedavg", "dp-scaffold", "moon",
              "dp-sgd", "dpsgd-gc", "fedlrs", "fedpcdp", "fedpdp", "non-prisma", "pcdp-sgd",
              "pdp-sgd", "pfa-simplified", "prisma", "rpdp-sgd", "rsdp-sgd"}


def formula(name: str, norm: float, clip: float, r: float) -> float:
    """w_C(‖g‖) as the papers write it, in Python's float64."""
    if name == "flat":
        return 1.0 if norm <= clip else clip / norm
    if name == "psac":
        return clip / (norm + r / (norm + r))
    return clip / (norm + r)


# ---- the function ------------------------------------------------------------------------------

def test_the_run_config_offers_exactly_the_registered_functions():
    assert sorted(CLIPPING_FUNCTION.choices) == NAMES == ["auto-s", "flat", "nsgd", "psac"]
    assert CLIPPING_FUNCTION.default == "flat" and clipping_function("flat") is FLAT
    assert {name: CLIPPING_FUNCTIONS.get(name).stability for name in NAMES} == OWN_R


def test_auto_s_and_nsgd_are_one_function_under_two_names_and_citations():
    auto_s, nsgd = CLIPPING_FUNCTIONS.get("auto-s"), CLIPPING_FUNCTIONS.get("nsgd")
    assert auto_s.weight is nsgd.weight and auto_s.stability == nsgd.stability
    assert "2206.07136" in auto_s.reference and "2206.13033" in nsgd.reference
    assert "2212.00328" in CLIPPING_FUNCTIONS.get("psac").reference


@pytest.mark.parametrize("name", NAMES)
def test_the_factor_is_the_papers_formula_in_float64(name):
    gen = torch.Generator().manual_seed(0)
    norms = torch.cat([torch.tensor([0.0, 1e-300, 1e-4, 0.0099, 1.0, 3.0, 1e30]),
                       torch.rand(200, generator=gen, dtype=torch.float64) * 10])
    for clip, r in ((1.0, 0.0), (0.3, 0.0), (2.5, 0.05), (1e-3, 1e-7)):
        fn = clipping_function(name, r if name != "flat" else 0.0)
        factors = fn.factors(norms, clip)
        expected = [formula(name, n, clip, fn.stability) for n in norms.tolist()]
        assert factors.dtype == torch.float64 and factors.tolist() == expected, (clip, r)


def test_flat_is_clip_factors_bit_for_bit():
    norms = torch.tensor([0.0, 0.5, 1.0, 2.0, 1e30, math.inf, math.nan, FLOAT32_MAX])
    for clip in (1.0, torch.tensor([0.1, 1, 2, 3, 4, 5, 6, 7.0])):
        torch.testing.assert_close(FLAT.factors(norms, clip), clip_factors(norms, clip),
                                   rtol=0, atol=0, equal_nan=True)


#: adversarial norms: 0, subnormal, the least normal, tiny, around r and PSAC's peak √r − r,
#: ordinary, huge, the largest float32; radii from tiny to the float32 range's top
NORMS = [0.0, 2.0**-149, 1e-40, FLOAT32_TINY, 1e-30, 1e-12, 1e-4, 0.0099, 0.01, 0.3, 1.0, 7.0,
         1e10, 1e30, FLOAT32_MAX]
RADII = [FLOAT32_TINY, 1e-30, 1e-6, 0.01, 1.0, 1e6, 1e30, FLOAT32_MAX]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_every_function_keeps_a_clipped_norm_below_the_clip(name, dtype):
    """Adversarial and random norms, one radius or one per norm: every factor is finite and
    nonnegative and w·‖g‖ ≤ C, within the float rounding flat clipping has too (and below C
    in float64 for the others wherever their denominator exceeds ‖g‖ beyond rounding)."""
    gen = torch.Generator().manual_seed(1)
    random = torch.exp(torch.randn(500, generator=gen, dtype=torch.float64) * 20).clamp(
        max=FLOAT32_MAX)
    norms = torch.cat([torch.tensor(NORMS, dtype=torch.float64), random]).to(dtype)
    for given in (0.0, 1e-12, 0.5):
        fn = clipping_function(name, given if name != "flat" else 0.0)
        r = fn.stability
        for radius in [*RADII, torch.tensor(RADII * 100)[:len(norms)].to(dtype)]:
            factors = fn.factors(norms, radius)
            assert bool((torch.isfinite(factors) & (factors >= 0)).all())
            clipped = factors.double() * norms.double()
            radius64 = torch.as_tensor(radius, dtype=dtype).double()
            assert bool((clipped <= radius64 * (1 + 2 * torch.finfo(dtype).eps)).all())
            if name != "flat" and dtype is torch.float64:
                n = norms.double()
                denominator = n + (r / (n + r) if name == "psac" else r)
                clear = denominator - n > 1e-12 * denominator  # beyond float64's rounding
                assert bool((clipped < radius64)[clear].all())


@pytest.mark.parametrize("name", OTHERS)
def test_a_non_finite_norm_gives_factor_zero_or_nan_as_flat_leaves_it(name):
    """inf gives 0 and NaN gives NaN; the engine drops either record (weight 0)."""
    factors = CLIPPING_FUNCTIONS.get(name).factors(torch.tensor([math.inf, math.nan]), 1.0)
    assert factors[0] == 0 and math.isnan(factors[1])


def test_psacs_weight_is_not_monotone_and_peaks_at_root_r_minus_r():
    psac = CLIPPING_FUNCTIONS.get("psac")
    r = psac.stability
    norms = torch.tensor([0.0, (math.sqrt(r) - r) / 2, math.sqrt(r) - r, 2 * math.sqrt(r), 1.0],
                         dtype=torch.float64)
    w = psac.factors(norms, 1.0).tolist()
    assert w[0] == 1.0 and w[0] < w[1] < w[2] and w[2] > w[3] > w[4]
    assert w[2] == pytest.approx(1 / (2 * math.sqrt(r) - r))


# ---- through the per-sample engine -------------------------------------------------------------

# the closed form (logistic), ghost norms (mlp) and materialised conv layers (clip21-cnn)
MODELS = {"logistic": ((13,), 1, "logistic"), "mlp": ((6,), 3, "cross-entropy"),
          "clip21-cnn": ((1, 12, 12), 3, "cross-entropy")}


def setup_model(name: str, scale: float = 1.0):
    """A model with its regulariser on (3-sample chunks), a point, two clients of 7 samples,
    inputs times ``scale``."""
    shape, classes, loss = MODELS[name]
    model = FlatModel(build_model(name, input_shape=shape, num_classes=classes, seed=0), loss,
                      nonconvex_reg=0.01, chunk_size=3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, *shape, generator=gen) * scale
    y = (torch.randint(0, 2, (2, 7), generator=gen).float() * 2 - 1 if loss == "logistic"
         else torch.randint(0, classes, (2, 7), generator=gen))
    flat = model.initial_params() + 0.05 * torch.randn(model.d, generator=gen)
    return model, flat, x, y


def reference_mean(model, flat, x, y, fn, clip) -> tuple[torch.Tensor, torch.Tensor]:
    """(1/b) Σ_j φ_C(g_j) from the materialised per-sample gradients, in float64, and each
    sample's φ_C(g_j) norm."""
    grads = model.per_sample_gradients(flat, x, y).double()
    factors = fn.factors(torch.linalg.vector_norm(grads, dim=-1), clip)
    clipped = grads * factors[..., None]
    return clipped.mean(dim=1), torch.linalg.vector_norm(clipped, dim=-1)


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("name", OTHERS)
def test_the_clipped_mean_is_the_mean_of_each_samples_phi_within_the_clip(name, model_name):
    """Ordinary and huge inputs (norms far above C): the engine's mean is the materialised
    one's, and each φ_C(g_j) lies within C."""
    fn = CLIPPING_FUNCTIONS.get(name)
    for scale, clip in ((1.0, 0.5), (1e3, 0.01)):
        model, flat, x, y = setup_model(model_name, scale)
        mean, norms = model.clipped_mean(flat, x, y, clip, clipping=fn)
        expected, clipped_norms = reference_mean(model, flat, x, y, fn, clip)
        torch.testing.assert_close(mean.double(), expected, rtol=1e-4, atol=1e-6 * clip)
        assert bool((clipped_norms <= clip * (1 + 1e-5)).all())
        flat_mean, flat_norms = model.clipped_mean(flat, x, y, clip)
        assert torch.equal(norms, flat_norms) and not torch.equal(mean, flat_mean)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_a_clipped_difference_applies_the_function_at_c1_and_the_flat_clip_at_c3(model_name):
    """PriSMA's (1/b) Σ_j [γ·c_j + (1 − γ)·clip_C3(c_j − c̃_j)], c_j = φ_C1(g_j) at both points."""
    fn = CLIPPING_FUNCTIONS.get("psac")
    model, flat, x, y = setup_model(model_name)
    before = flat + 0.05 * torch.randn(model.d, generator=torch.Generator().manual_seed(2))
    ours = model.clipped_difference_mean(flat, before, x, y, clip=0.5, clip_diff=0.1, gamma=0.3,
                                         clipping=fn)

    def phi(point):
        grads = model.per_sample_gradients(point, x, y).double()
        return grads * fn.factors(torch.linalg.vector_norm(grads, dim=-1), 0.5)[..., None]

    c, c_before = phi(flat), phi(before)
    diff = c - c_before
    diff = diff * clip_factors(torch.linalg.vector_norm(diff, dim=-1), 0.1)[..., None]
    expected = (0.3 * c + 0.7 * diff).mean(dim=1)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("name", OTHERS)
def test_a_non_finite_sample_is_dropped_whatever_the_function(name, model_name):
    """As under flat clipping (tests/test_non_finite.py): the sample contributes zero and its
    norm is reported as 0."""
    fn = CLIPPING_FUNCTIONS.get(name)
    model, flat, x, y = setup_model(model_name)
    bad = x.clone()
    bad[1, 2].view(-1)[0] = math.inf
    kept = [0, 1, 3, 4, 5, 6]
    ours, norms = model.clipped_mean(flat, bad, y, 0.5, clipping=fn)
    without = model.clipped_mean(flat, x[:, kept], y[:, kept], 0.5, clipping=fn)[0]
    assert bool(torch.isfinite(ours).all()) and norms[1, 2] == 0
    torch.testing.assert_close(ours[1], without[1] * 6 / 7, rtol=1e-5, atol=1e-7)
    assert model.take_dropped() == 1


# ---- the run configuration ----------------------------------------------------------------------

def per_sample_keys(name: str) -> dict:
    return {"clipping": "per-sample"} if name == "clip-sgd" else {}


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_the_per_sample_algorithms_offer_the_option_and_the_others_refuse_it(name):
    values = {"algorithm": name, "clipping-function": "psac", **per_sample_keys(name)}
    if name in PER_SAMPLE:
        hp = RunConfig(values).hyperparameters
        assert hp.per_sample_clipping is CLIPPING_FUNCTIONS.get("psac")
        assert RunConfig({"algorithm": name}).hyperparameters.per_sample_clipping is FLAT
    else:
        with pytest.raises(ConfigError, match="'clipping-function': not used by") as error:
            RunConfig(values)
        assert "\n" not in str(error.value) and "'flat'" in str(error.value)


def test_clip_sgd_refuses_a_function_for_its_client_level_clip():
    with pytest.raises(ConfigError, match="'clipping-function': applies to "
                       "clipping='per-sample' only"):
        RunConfig({"algorithm": "clip-sgd", "clipping-function": "auto-s"})


def test_the_stability_constant_defaults_to_the_functions_own_and_flat_has_none():
    for name in OTHERS:
        hp = RunConfig({"clipping-function": name}).hyperparameters
        assert hp.per_sample_clipping.stability == OWN_R[name]
        given = RunConfig({"clipping-function": name, "clipping-stability": 0.5})
        assert given.hyperparameters.per_sample_clipping.stability == 0.5
    with pytest.raises(ConfigError, match="'clipping-stability': clipping-function 'flat' has "
                       "no stability constant"):
        RunConfig({"clipping-stability": 0.5})
    with pytest.raises(ConfigError, match="'clipping-stability': must be 0"):
        RunConfig({"clipping-function": "psac", "clipping-stability": 1e-20})
    with pytest.raises(ConfigError, match=r"unknown value 'psak' \(did you mean 'psac'\?\) "
                       r"\(allowed: flat, auto-s, nsgd, psac\)"):
        RunConfig({"clipping-function": "psak"})


# ---- privacy: the ledger, a neighbour, the audit ------------------------------------------------

REL, ABS = 0.01, 1e-3  # tests/test_independent_accountant.py's tolerance


@pytest.mark.parametrize("noise", [{"noise-multiplier": 1.0}, {}], ids=["given", "calibrated"])
def test_a_psac_run_has_the_flat_runs_releases_and_ledger_and_dp_accountings_epsilon(
        small_config, noise):
    """DPSGD-GC on digits, end to end: PSAC's releases (radius, relation, rate, multiplier) and
    every accountant's ε are the flat run's, with the noise given or calibrated (the
    sensitivity is C/b either way); and the ledger is never below dp-accounting's PLD and RDP
    for the same history, whose figures the summary reports."""
    keys = {k.replace("-", "_"): v for k, v in noise.items()}
    flat = run(small_config(run_name="flat", **keys), echo=False, plot=False)
    psac = run(small_config(run_name="psac", clipping_function="psac", **keys), echo=False,
               plot=False)
    assert psac["releases"] == flat["releases"]
    assert psac["epsilon_by_accountant"] == flat["epsilon_by_accountant"]
    assert psac["test_accuracy"] != flat["test_accuracy"] or psac["test_loss"] != flat[
        "test_loss"]
    rounds, delta = psac["rounds_completed"], psac["delta"]
    histories = [tuple((r["noise_multiplier"], r["sample_rate"], r["steps"] * rounds)
                       for r in releases) for releases in psac["releases"].values()]
    by = psac["epsilon_by_accountant"]
    for accountant, name in ((independent.PLD, "dp-accounting-pld"),
                             (independent.RDP, "dp-accounting-rdp")):
        assert by[name] == pytest.approx(max(independent.epsilon(accountant, h, delta)
                                             for h in histories), rel=1e-9)
    tight = max(min(independent.epsilon(independent.PLD, h, delta),
                    independent.epsilon(independent.RDP, h, delta)) for h in histories)
    assert psac["epsilon_max"] >= tight * (1 - REL) - ABS


NEIGHBOUR_CASES = [("dpsgd-gc", "psac"), ("dpsgd-gc", "auto-s"), ("prisma", "psac"),
                   ("clip21-sgd2m-plus", "nsgd"), ("dp-fedavg", "psac"), ("pcdp-sgd", "psac"),
                   ("pdp-sgd", "auto-s")]


@pytest.mark.parametrize("name, function", NEIGHBOUR_CASES,
                         ids=[f"{n}-{f}" for n, f in NEIGHBOUR_CASES])
def test_a_replaced_record_moves_each_release_by_at_most_its_sensitivity(name, function,
                                                                         tmp_path):
    """tests/test_privacy_boundary.py's neighbour check under a non-flat function: noise 10⁴
    times the sensitivity and the same seed, one record of client 0 replaced (in every batch:
    the batch is the client's whole data); each noised array moves by at most 2C/b (1.1 for
    float32 rounding of values 10⁴ times larger)."""
    from flwr.app import ArrayRecord

    from dpfl.problem import build_problem
    from tests.test_privacy_boundary import _bound, _neighbour, _replies, base

    config = RunConfig({**base(name), "algorithm": name, "noise-multiplier": 1e4,
                        "clipping-function": function, "results-dir": str(tmp_path)})
    problem = build_problem(config)
    releases = {r.name: r for r in problem.releases(0)}
    uploads = {key: upload for e in problem.algorithm.exchanges
               for key, upload in e.uploads.items()}
    for ours, theirs in zip(_replies(problem), _replies(_neighbour(problem)), strict=True):
        for record_name, record in ours.items():
            if not isinstance(record, ArrayRecord):
                assert dict(record) == dict(theirs[record_name])
                continue
            for key in record:
                a, b = (torch.from_numpy(r[key].numpy()).double()
                        for r in (record, theirs[record_name]))
                bound = _bound(problem, releases[uploads[key].release], uploads[key], key)
                assert torch.linalg.vector_norm(a - b).item() <= 1.1 * bound, key


@pytest.mark.slow
def test_the_gradient_canarys_tight_audit_of_psac_finds_the_ledgers_epsilon():
    """tests/test_audit.py's tight setting (the gradient canary in every step, 2,000 runs a
    side, the PRV ledger) with DPSGD-GC under PSAC at C = 0.3: the canary's gradient, of norm
    s = 1000·C·b, is clipped to C·s/(s + r/(s + r)) ≈ C, so the ledger's ε lies inside the
    Gaussian-DP fit's two-sided 99.9% interval, at most half of it wide, and is never refuted
    (a factor that lost its C would move the canary by 1/C times as much)."""
    from scipy.stats import norm

    from tests.test_audit import (
        TIGHT_CONFIDENCE,
        TIGHT_TRIALS,
        gaussian_dp_epsilon,
        reduced_audit,
        standardised_difference,
    )

    result = reduced_audit("dpsgd-gc", trials=TIGHT_TRIALS, accountant="prv", clip=0.3,
                           **{"clipping-function": "psac"})
    ledger, fitted = result.epsilon_ledger, result.gaussian
    mu, stderr = standardised_difference(result.scores_out, result.scores_in)
    z = float(norm.ppf((1 + TIGHT_CONFIDENCE) / 2))
    low, high = (gaussian_dp_epsilon(mu - z * stderr, result.delta),
                 gaussian_dp_epsilon(mu + z * stderr, result.delta))
    assert low <= ledger <= high and high - low <= 0.5 * ledger
    assert result.bound.epsilon <= ledger and fitted.epsilon_lower <= ledger
    assert abs(fitted.std_ratio - 1) < 0.1
