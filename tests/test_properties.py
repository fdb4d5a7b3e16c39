"""Properties that must hold for any input, checked with hypothesis.

Every test runs derandomized (the same examples on every machine) with an explicit number of
examples and no example database, so CI is reproducible and nothing is written to the checkout:

- clipping never exceeds its bound, whatever the shape, magnitude or radius: the clipping
  operators of :mod:`dpfl.privacy.clipping` and the per-sample clipping of
  :meth:`dpfl.models.FlatModel.clipped_mean`; an inf or NaN upload is sent as zeros (noised as
  usual) and logged on the node, never raised to the server, while a non-finite broadcast or
  server model stops the run with a clear error;
- the run-config parser answers any text with one ``dpfl: error:`` line and exit status 2, or
  with a valid configuration, and never starts a run to find out;
- every partitioner covers every record exactly once (``shards``: at most once, in equal
  partitions), or refuses with a ConfigError naming the key;
- the noise a release adds has the std the release declares, within a chi-square bound at a
  false-alarm probability of 1e-6 per client.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.extra.numpy import arrays
from scipy import stats

from dpfl.config import FLOAT32_MAX, FLOAT32_TINY
from dpfl.datasets import PARTITIONERS, partition
from dpfl.datasets.base import Dataset
from dpfl.errors import ConfigError, NonFiniteError
from dpfl.privacy import Query, Randomness, Release, add_noise, stds
from dpfl.privacy.clipping import clip_by_norm, clip_factors
from dpfl.rounds.client import LEVERS
from dpfl.runconfig import RunConfig, all_params

# hypothesis' own caches go where the tests' other caches go (tests/conftest.py), not the checkout
set_hypothesis_home_dir(os.path.join(os.environ["DPFL_CACHE_DIR"], "hypothesis"))


def examples(n: int) -> settings:
    """``n`` derandomized examples, no deadline (shared CI cores), no example database."""
    return settings(derandomize=True, max_examples=n, deadline=None, database=None)


# ---- clipping -------------------------------------------------------------------------------

FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
RADII = st.floats(min_value=FLOAT32_TINY, max_value=FLOAT32_MAX, width=32)
SHAPES = st.lists(st.integers(1, 4), min_size=0, max_size=2).flatmap(
    lambda lead: st.integers(1, 40).map(lambda d: (*lead, d)))


def bounded(clipped: torch.Tensor, radius: torch.Tensor) -> bool:
    """Whether every row's norm (in float64) is within float32 rounding of its radius; the
    subnormals a tiny radius leaves lose up to 2^-149 an entry."""
    norms = torch.linalg.vector_norm(clipped.double(), dim=-1)
    slack = math.sqrt(clipped.shape[-1]) * 2.0**-149
    return bool((norms <= radius.double() * (1 + 1e-5) + slack).all())


@examples(150)
@given(st.data(), SHAPES, st.sampled_from([None, 1e-35, 1e-20, 1.0, 1e20, 1e35]))
def test_clip_by_norm_never_exceeds_the_radius(data, shape, scale):
    """Entries anywhere in float32's range, or of magnitude up to 1e3 times ``scale``: tiny
    (subnormal), ordinary and huge ones (the sum of squares over- or underflows), zeros."""
    elements = FLOAT32 if scale is None else st.floats(-1e3, 1e3, width=32)
    vectors = torch.from_numpy(data.draw(arrays(np.float32, shape, elements=elements)))
    vectors = vectors * (scale or 1.0)
    per_row = data.draw(st.booleans())
    radius = (torch.from_numpy(data.draw(arrays(np.float32, shape[:-1], elements=RADII)))
              if per_row else torch.tensor(data.draw(RADII)))
    clipped = clip_by_norm(vectors, radius)
    assert bool(torch.isfinite(clipped).all())
    assert bounded(clipped, radius.expand(shape[:-1]))
    # a nonnegative multiple of each row, and the rows within the radius are untouched
    assert bool((clipped * vectors >= 0).all()) and bool((clipped.abs() <= vectors.abs()).all())
    norms = torch.linalg.vector_norm(vectors.double(), dim=-1)
    inside = norms <= radius.double() * (1 - 1e-6)
    assert torch.equal(clipped[inside], vectors[inside])


@examples(100)
@given(st.lists(st.floats(min_value=0, max_value=FLOAT32_MAX, width=32), min_size=1,
                max_size=20), RADII)
def test_clip_factors_are_in_the_unit_interval_and_bound_the_norm(norms, radius):
    norms = torch.tensor(norms, dtype=torch.float32)
    factors = clip_factors(norms, radius)
    assert bool(((factors >= 0) & (factors <= 1)).all())
    assert bool((factors.double() * norms.double() <= radius * (1 + 1e-6)).all())


def test_an_infinite_or_nan_vector_does_not_pass_the_clip_as_a_finite_one():
    """What the runtime's zeroing (below) is for: clipping cannot repair a non-finite
    vector."""
    clipped = clip_by_norm(torch.tensor([[math.inf, 1.0], [math.nan, 1.0]]), 1.0)
    assert not bool(torch.isfinite(clipped).all(dim=1).any())


def flat_model(name: str, input_shape: tuple[int, ...], classes: int):
    from dpfl.models import FlatModel, build_model

    module = build_model(name, input_shape=input_shape, num_classes=classes, seed=0)
    return FlatModel(module, "cross-entropy", chunk_size=3)


PER_SAMPLE_MODELS = {  # the closed-form, the ghost-norm and the materialised (conv) paths
    "logistic": ((6,), 3), "mlp": ((6,), 3), "clip21-cnn": ((1, 12, 12), 3)}


@examples(40)
@given(st.sampled_from(sorted(PER_SAMPLE_MODELS)), st.integers(1, 5),
       st.sampled_from([1e-6, 1e-2, 1.0, 1e2, 1e6]), st.floats(1e-4, 1e4), st.integers(0, 99),
       st.booleans())
def test_per_sample_clipping_bounds_each_records_contribution(name, batch, scale, radius, seed,
                                                              proximal):
    """Each record moves the sum of ``clipped_mean``'s clipped gradients by at most the
    radius: the sum over a batch less its sum without record j is record j's clipped
    gradient."""
    input_shape, classes = PER_SAMPLE_MODELS[name]
    model = flat_model(name, input_shape, classes)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, batch, *input_shape, generator=gen) * scale
    y = torch.randint(0, classes, (1, batch), generator=gen)
    flat = model.initial_params().unsqueeze(0)
    offset = torch.randn(1, model.d, generator=gen) * scale if proximal else None
    total, norms = model.clipped_mean(flat, x, y, radius, offset=offset)
    assume(bool(torch.isfinite(norms).all()))
    assert bool(torch.isfinite(total).all())
    for j in range(batch):
        alone, _ = model.clipped_mean(flat, x[:, j:j + 1], y[:, j:j + 1], radius,
                                      offset=offset)
        assert bounded(alone[0], torch.tensor(radius))
    assert bounded(total[0] * batch, torch.tensor(radius * batch))


# ---- a client's inf and NaN stay on its node; the server's stop the run -----------------------

def poisoned(cls, server_round: int, client: int, value: float):
    """``cls.client_step`` that fills ``client``'s row of its first upload in ``round`` with
    ``value``."""
    step = cls.client_step

    def client_step(self, exchange, states, broadcast, cohort, ctx):
        messages, states = step(self, exchange, states, broadcast, cohort, ctx)
        if ctx.server_round == server_round and client in cohort.ids:
            first = sorted(messages)[0]
            messages = {**messages, first: messages[first].clone()}
            messages[first][cohort.ids.index(client)] = value
        return messages, states

    return client_step


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_upload_is_sent_as_zeros_and_logged_on_the_node(value, small_config,
                                                                     monkeypatch, caplog):
    """Client 2's upload turns non-finite: its row is noised as a zero row (the others as they
    are), the step names it in one line of the node's log, and a broadcast that is not finite
    (the server's doing) still stops the step."""
    from dpfl.algorithms import ALGORITHMS
    from dpfl.problem import build_problem
    from dpfl.rounds import client as runtime

    cls = ALGORITHMS.get("dpsgd-gc")
    problem = build_problem(small_config())
    clients = runtime.ClientRuntime.of(problem)
    noised = []
    monkeypatch.setattr(runtime, "add_noise", lambda values, *a, **k: noised.append(values)
                        or values)
    x = problem.x0.clone()

    def step():
        return clients.step("train", 1, {"x": x}, problem.algorithm.init_client_state(4),
                            problem.full_cohort())[0]["c"]

    clean = step()
    monkeypatch.setattr(cls, "client_step", poisoned(cls, 1, 2, value))
    with caplog.at_level("WARNING", logger="dpfl"):
        sent = step()
    assert len(noised) == 2  # noised as usual
    assert torch.equal(sent[[0, 1, 3]], clean[[0, 1, 3]]) and not sent[2].any()
    lines = [r.getMessage() for r in caplog.records if r.name == "dpfl"]
    assert len(lines) == 1 and lines[0].startswith(
        "round 1, exchange 'train': upload 'c' of clients [2] was not finite and is sent as zeros")
    x[3] = value  # a server model that overflowed is refused before any client step
    with pytest.raises(NonFiniteError, match="the server's broadcast 'x' is not finite"):
        clients.step("train", 2, {"x": x}, problem.algorithm.init_client_state(4),
                     problem.full_cohort())


def test_a_nan_upload_leaves_the_run_going_and_its_results_silent(tmp_path, capsys, caplog,
                                                                   monkeypatch):
    """Round 2 of client 1 turns NaN: the run finishes every round with a finite model and no
    error line, and the event is only in the node's log: its model, rounds and summary (the
    ledger included) are those of a run in which that upload was zero, bit for bit."""
    from dpfl.algorithms import ALGORITHMS
    from dpfl.cli import main

    def run(name: str) -> dict:
        assert main(["run", "-q", "-c", f'num-partitions=4 batch-size=16 noise-multiplier=1.0 '
                     f'num-server-rounds=3 results-dir="{tmp_path}" run-name="{name}"']) == 0
        return json.loads((tmp_path / name / "summary.json").read_text())

    cls = ALGORITHMS.get("dpsgd-gc")
    monkeypatch.setattr(cls, "client_step", poisoned(cls, 2, 1, 0.0))  # what is sent instead
    zero = run("zero")
    monkeypatch.setattr(cls, "client_step", poisoned(cls, 2, 1, math.nan))
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="dpfl"):
        nan = run("nan")
    assert not [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert [r.getMessage() for r in caplog.records if "sent as zeros" in r.getMessage()] == [
        "round 2, exchange 'train': upload 'c' of clients [1] was not finite and is sent as "
        "zeros; logged on this node only" + LEVERS]
    assert nan["rounds_completed"] == 3 and not nan["stopped_early"]
    model = torch.load(tmp_path / "nan" / "model.pt")
    assert all(bool(torch.isfinite(v).all()) for v in model.values())
    reference = torch.load(tmp_path / "zero" / "model.pt")
    assert all(torch.equal(model[k], reference[k]) for k in reference)
    times = ("seconds", "wall_seconds", "seconds_per_round", "cpu_seconds", "results", "runtime")
    assert {k: v for k, v in nan.items() if k not in times} == \
        {k: v for k, v in zero.items() if k not in times}
    rounds = [[{k: v for k, v in json.loads(line).items() if k not in times}
               for line in (tmp_path / name / "rounds.jsonl").open()] for name in ("nan", "zero")]
    assert rounds[0] == rounds[1]


# ---- the run-config parser ------------------------------------------------------------------

PARAMS = all_params()
KEY = st.one_of(st.sampled_from(sorted(PARAMS)), st.text(max_size=8))
WORD = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
VALUE = st.one_of(
    st.integers(-2**70, 2**70).map(str),
    st.floats().map(lambda v: "nan" if math.isnan(v) else repr(v)),
    st.sampled_from(["true", "false", "inf", "-inf", "1e999", "1e-320", "\"auto\"", "''"]),
    st.sampled_from(sorted({c for p in PARAMS.values() for c in p.choices or ()})).map(
        json.dumps),
    WORD.map(json.dumps),
    WORD,
)
KIND = {bool: st.booleans().map(json.dumps),
        int: st.one_of(st.integers(-3, 100), st.integers(-2**70, 2**70)).map(str),
        float: st.floats().map(lambda v: "nan" if math.isnan(v) else repr(v)),
        str: WORD.map(json.dumps)}
TYPED = st.sampled_from(sorted(PARAMS)).flatmap(lambda key: st.tuples(
    st.just(key), st.just("="),
    st.sampled_from(PARAMS[key].choices).map(json.dumps) if PARAMS[key].choices
    else KIND[PARAMS[key].kind] | VALUE))
PAIR = st.one_of(TYPED, TYPED, st.tuples(KEY, st.sampled_from(["=", " = ", "", "=="]), VALUE)
                 ).map("".join)
PAIRS = st.lists(PAIR, max_size=4).flatmap(
    lambda pairs: st.sampled_from([" ", " ", "  ", "", "\t"]).map(lambda sep: sep.join(pairs)))
TEXT = st.one_of(PAIRS, PAIRS, PAIRS, WORD)


def cli(argv: list[str], monkeypatch) -> tuple[int, str, list[RunConfig]]:
    """The command line's exit status and stderr for ``argv``, with the engine replaced by a
    stub that records the configurations that would have started."""
    from dpfl import engine
    from dpfl.cli import main

    started: list[RunConfig] = []
    monkeypatch.setattr(engine, "run", lambda config, **_: started.append(config) or {})
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as stop:  # argparse: e.g. a value that starts with "-"
            status = stop.code
    return status, err.getvalue(), started


@examples(200)
@given(st.lists(TEXT, min_size=1, max_size=2))
def test_any_run_config_text_gives_one_error_line_or_a_valid_configuration(texts):
    with pytest.MonkeyPatch.context() as monkeypatch:
        status, err, started = cli(["run", *[f"--run-config={t}" for t in texts]], monkeypatch)
    if started:
        event("a valid configuration")
        assert status == 0 and not err and isinstance(started[0], RunConfig)
        return
    event(f"refused: {err.split(':')[2].strip() if err.count(':') > 2 else err}"[:60])
    lines = err.splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("dpfl: error: "), err


# ---- partitioners ---------------------------------------------------------------------------

@st.composite
def datasets(draw) -> Dataset:
    n = draw(st.integers(1, 60))
    task = draw(st.sampled_from(["classification", "classification", "binary", "regression"]))
    classes = draw(st.integers(1, 5)) if task == "classification" else 1
    gen = np.random.default_rng(draw(st.integers(0, 2**16)))
    y = {"classification": lambda: torch.from_numpy(gen.integers(0, classes, n)),
         "binary": lambda: torch.from_numpy(gen.choice([-1.0, 1.0], n).astype(np.float32)),
         "regression": lambda: torch.from_numpy(gen.normal(size=n).astype(np.float32))}[task]()
    cuts = draw(st.none() | st.lists(st.integers(1, max(1, n - 1)), max_size=5, unique=True))
    sizes = None if cuts is None else tuple(np.diff([0, *sorted(set(cuts) - {n}), n]).tolist())
    return Dataset("generated", torch.zeros(n, 1), y, torch.zeros(1, 1), y[:1], task=task,
                   num_classes=classes, client_sizes=sizes)


@pytest.mark.parametrize("name", PARTITIONERS.names())
@examples(30)
@given(data=st.data(), dataset=datasets(), alpha=st.floats(1e-3, 1e3), shards=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_partitioners_cover_every_record_once_or_refuse_naming_the_key(
        name, data, dataset, alpha, shards, seed):
    n = dataset.num_train
    clients = data.draw(st.integers(1, n + 2), label="clients")
    try:
        parts = partition(dataset, partitioner=name, num_partitions=clients, seed=seed,
                          alpha=alpha, shards_per_partition=shards)
    except ConfigError as refusal:
        event(f"{name} refused: {refusal.key}")
        assert refusal.key in ("num-partitions", "partitioner", "shards-per-partition")
        assert refusal.allowed
        natural = dataset.client_sizes
        refused = {  # what the partitioner cannot do, and so must refuse
            "num-partitions": clients > n or name == "dirichlet"
            or (name == "natural" and natural is not None and clients != len(natural)),
            "partitioner": (name in ("dirichlet", "shards") and dataset.task == "regression")
            or (name == "natural" and dataset.client_sizes is None),
            "shards-per-partition": name == "shards" and shards > n // clients}
        assert refused[refusal.key], refusal
        return
    event(f"{name} split")
    assert clients <= n and len(parts) == clients
    assert all(len(p) > 0 and np.all(np.diff(p) > 0) for p in parts)  # sorted, no repeats
    rows = np.concatenate(parts)
    assert len(np.unique(rows)) == len(rows) and rows.min() >= 0 and rows.max() < n
    if name == "shards":  # equal partitions of whole shards; the rows left over are in none
        size = shards * (n // (clients * shards))
        assert {len(p) for p in parts} == {size}
        return
    assert len(rows) == n
    if name in ("iid", "contiguous"):
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


# ---- noise ----------------------------------------------------------------------------------

FALSE_ALARM = 1e-6  # per client: the chance that a correct std fails the test


def within_chi_square(noise: torch.Tensor, std: float) -> bool:
    """Whether ``noise`` (n draws, mean 0) has std ``std``: n·s²/std² ~ χ²(n), two-sided at
    :data:`FALSE_ALARM`."""
    n = noise.numel()
    statistic = float(noise.double().square().sum()) / std**2
    low, high = stats.chi2.ppf(FALSE_ALARM / 2, n), stats.chi2.isf(FALSE_ALARM / 2, n)
    return bool(low <= statistic <= high)


#: a sum of vectors of norm at most r moves by 2r when one is replaced, r when one is added
FACTORS = {"replace-one": 2.0, "add-remove": 1.0}
QUERIES = st.builds(lambda radius, relation: Query("q", "train", radius, relation),
                    st.floats(1e-3, 1e3), st.sampled_from(sorted(FACTORS)))


@examples(60)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=6, unique=True),
       st.integers(50, 3000), QUERIES, st.just(0.0) | st.floats(1e-3, 1e2),
       st.integers(1, 10**6), st.integers(0, 2**31))
def test_each_client_draws_noise_of_its_releases_declared_std(clients, dim, query, multiplier,
                                                              server_round, seed):
    """std = noise multiplier × sensitivity; ``noise-multiplier`` (std over the radius) gives
    the same release both ways; each client's draw has that std."""
    release = Release.of(query, query.multiplier_of(multiplier))
    declared = release.std()
    assert math.isclose(declared, multiplier * query.radius, rel_tol=1e-12)
    assert math.isclose(release.noise_multiplier * FACTORS[query.relation], multiplier,
                        rel_tol=1e-12)
    assert math.isclose(stds([release] * len(clients))[0], declared, rel_tol=1e-6)
    values = torch.zeros(len(clients), dim)
    noisy = add_noise(values, clients, stds([release] * len(clients)), rng=Randomness(seed),
                      server_round=server_round, stream="noise")
    if declared == 0:
        assert torch.equal(noisy, values)
        return
    assert all(within_chi_square(row, float(np.float32(declared))) for row in noisy)


@examples(40)
@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=6), st.integers(200, 3000),
       st.integers(0, 2**31))
def test_pooled_noise_gives_the_sum_the_std_of_the_clients_draws(std, dim, seed):
    """The engine's fast mode: one draw of std √(Σσ_i²) for the participants' sum."""
    std_t = torch.tensor(std, dtype=torch.float32)
    values = torch.zeros(len(std), dim)
    noisy = add_noise(values, list(range(len(std))), std_t, rng=Randomness(seed), server_round=1,
                      stream="noise", pooled=True)
    total = math.sqrt(sum(float(np.float32(s)) ** 2 for s in std))
    if total == 0:
        assert torch.equal(noisy, values)
        return
    assert torch.equal(noisy[1:], values[1:])
    assert within_chi_square(noisy.sum(dim=0), total)


def test_a_server_step_that_overflows_stops_the_run_and_keeps_the_last_finite_model(
        tmp_path, monkeypatch):
    """A server step that turns the model inf (round 2's, here forced) stops the run there,
    before anything is broadcast from it, and the folder keeps round 1's finite model."""
    from dpfl.algorithms import ALGORITHMS
    from dpfl.engine import run
    from dpfl.runconfig import RunConfig

    def config(name: str, rounds: int) -> RunConfig:
        return RunConfig({"algorithm": "dp-sgd", "num-partitions": 4, "num-server-rounds": rounds,
                          "noise-multiplier": 1.0, "results-dir": str(tmp_path),
                          "run-name": name})

    run(config("clean", 1), echo=False)
    cls = ALGORITHMS.get("dp-sgd")
    step = cls.server_step

    def overflowing(self, exchange, state, sums, ctx):
        state = step(self, exchange, state, sums, ctx)
        return {**state, "x": state["x"] * math.inf} if ctx.server_round == 2 else state

    monkeypatch.setattr(cls, "server_step", overflowing)
    with pytest.raises(NonFiniteError, match="round 2, exchange 'train': the server's step"):
        run(config("overflow", 3), echo=False)
    summary = json.loads((tmp_path / "overflow" / "summary.json").read_text())
    assert summary["rounds_completed"] == 1 and "NonFiniteError" in summary["stopped_early"]
    model = torch.load(tmp_path / "overflow" / "model.pt")
    reference = torch.load(tmp_path / "clean" / "model.pt")
    assert all(torch.equal(model[k], reference[k]) for k in reference)
