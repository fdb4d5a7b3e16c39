"""A record whose gradient is not finite is dropped on its node, and nothing else tells.

A NaN or inf feature (or a model that overflows on one record) used to stop the client with an
error naming it, which reached the server: a fact about the data outside any release. Now the
record contributes zero wherever a gradient is taken (per-sample clipping at one or two points,
per-sample gradient rows, the client-level mini-batch gradient), its norm is reported as 0, the
event is logged on the node only, and the replies differ from those with any finite record in
its place by at most the release's sensitivity, as for any neighbour (docs/privacy.md,
"Non-finite values").
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from flwr.app import ArrayRecord

from dpfl.cli import main
from dpfl.datasets.loading import DATASETS, _load
from dpfl.models import FlatModel, build_model
from dpfl.problem import build_problem
from dpfl.rounds.client import ClientRuntime
from dpfl.runconfig import RunConfig
from tests.test_privacy_boundary import _bound, _neighbour, _replies, base

# the closed form (logistic), ghost norms (mlp) and materialised conv layers (clip21-cnn)
MODELS = {"logistic": ((13,), 1, "logistic"), "mlp": ((6,), 3, "cross-entropy"),
          "clip21-cnn": ((1, 12, 12), 3, "cross-entropy")}
B, BAD = 5, 2  # samples per client; client 1's sample BAD is the non-finite one
KEPT = [j for j in range(B) if j != BAD]


def _setup(name: str, value: float):
    """A model (regulariser on, so its per-sample share is checked too; 3-sample chunks), a
    point, two clients' data and the same data with client 1's sample BAD holding ``value``."""
    shape, classes, loss = MODELS[name]
    model = FlatModel(build_model(name, input_shape=shape, num_classes=classes, seed=0), loss,
                      nonconvex_reg=0.01, chunk_size=3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, B, *shape, generator=gen)
    y = (torch.randint(0, 2, (2, B), generator=gen).float() * 2 - 1 if loss == "logistic"
         else torch.randint(0, classes, (2, B), generator=gen))
    flat = model.initial_params() + 0.05 * torch.randn(model.d, generator=gen)
    bad = x.clone()
    bad[1, BAD].view(-1)[0] = value
    return model, flat, x, y, bad


def _close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal to float32 rounding (relative to the largest entry)."""
    return (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def _check_dropped(model: FlatModel, ours: torch.Tensor, without: torch.Tensor,
                   clean: torch.Tensor, bad: torch.Tensor) -> None:
    """Client 1's row is the call without the sample, times (b − 1)/b; client 0's row is the
    clean call's, bit for bit; one record counted; the caller's data untouched."""
    assert bool(torch.isfinite(ours).all())
    assert _close(ours[1], without[1] * (B - 1) / B)
    assert torch.equal(ours[0], clean[0])
    assert model.take_dropped() == 1 and model.take_dropped() == 0
    assert not bool(torch.isfinite(bad[1, BAD]).all())


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_sample_clipping_drops_a_non_finite_sample_and_reports_its_norm_as_zero(name,
                                                                                     value):
    model, flat, x, y, bad = _setup(name, value)
    ours, norms = model.clipped_mean(flat, bad, y, 0.5)
    without, without_norms = model.clipped_mean(flat, x[:, KEPT], y[:, KEPT], 0.5)
    _check_dropped(model, ours, without, model.clipped_mean(flat, x, y, 0.5)[0], bad)
    assert norms[1, BAD] == 0 and _close(norms[1, KEPT], without_norms[1])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_clipped_difference_drops_a_sample_not_finite_at_either_point(name):
    model, flat, x, y, bad = _setup(name, math.nan)
    before = flat + 0.01 * torch.randn(model.d, generator=torch.Generator().manual_seed(2))

    def difference(data: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.clipped_difference_mean(flat, before, data, labels, clip=0.5,
                                             clip_diff=0.1, gamma=0.3)

    ours = difference(bad, y)
    _check_dropped(model, ours, difference(x[:, KEPT], y[:, KEPT]), difference(x, y), bad)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_non_finite_mini_batch_gradient_is_the_mean_over_its_finite_records(name):
    model, flat, x, y, bad = _setup(name, math.nan)
    ours = model.batch_gradients(flat, bad, y)
    _check_dropped(model, ours, model.batch_gradients(flat, x[:, KEPT], y[:, KEPT]),
                   model.batch_gradients(flat, x, y), bad)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_mini_batch_gradient_with_no_finite_record_is_zero(name):
    model, flat, x, y, _ = _setup(name, math.nan)
    x[1].view(B, -1)[:, 0] = math.nan
    grads = model.batch_gradients(flat, x, y)
    assert bool(torch.isfinite(grads).all()) and not grads[1].any()
    assert model.take_dropped() == B


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_non_finite_per_sample_gradient_is_a_zero_row(name):
    model, flat, x, y, bad = _setup(name, math.nan)
    rows = model.per_sample_gradients(flat, bad, y)
    clean = model.per_sample_gradients(flat, x, y)
    assert not rows[1, BAD].any() and model.take_dropped() == 1
    assert torch.equal(rows[:, KEPT], clean[:, KEPT]) and torch.equal(rows[0], clean[0])


# ---- through the real ClientApp -------------------------------------------------------------

ALGORITHMS = ["adaptdp-fedavg", "clip-sgd", "clip21-sgd2m", "dp-fedavg-quantile", "dpsgd-gc",
              "prisma"]


def _with_nan(problem):
    """The problem with one feature of client 0's first record set to NaN."""
    ds = problem.dataset
    train_x = ds.train_x.clone()
    train_x[int(problem.partitions[0][0]), 0] = math.nan
    return dataclasses.replace(problem, dataset=dataclasses.replace(ds, train_x=train_x),
                               _cohorts={})


def _bounds(problem) -> dict[str, float]:
    """How far one replaced record can move each upload under the same noise: the
    privacy-boundary test's bound, or for a central (client-level) upload twice its radius:
    the clip broadcast in both rounds (the initial one) for the update, 1 for the bit."""
    algorithm = problem.algorithm
    uploads = {key: upload for e in algorithm.exchanges for key, upload in e.uploads.items()}
    releases = {r.name: r for r in [*problem.releases(0), *problem.server_releases()]}
    return {key: 2.0 * (releases[u.release].radius or algorithm.hp.clip)  # replace-one: 2r
            if u.central else _bound(problem, releases[u.release], u, key)
            for key, u in uploads.items()}


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_nan_record_gives_replies_within_the_sensitivity_of_any_finite_one(name, tmp_path,
                                                                             caplog):
    """Noise 10⁴ times the sensitivity (central DP: un-noised clipped updates), the same seed:
    the replies with client 0's NaN record are finite, differ from those with that record, or
    another finite one, in its place only in the uploads, and only by the sensitivity; the
    node's log says the record was dropped."""
    central = {"noise-multiplier": 1.0, "clipped-count-stddev": 5.0}
    extra = central if name == "dp-fedavg-quantile" else {"noise-multiplier": 1e4}
    problem = build_problem(RunConfig({**base(name), **extra, "algorithm": name,
                                       "results-dir": str(tmp_path)}))
    with caplog.at_level("WARNING", logger="dpfl"):
        ours = _replies(_with_nan(problem))
    assert any("whose gradient or loss was not finite" in r.getMessage()
               for r in caplog.records if r.name == "dpfl")
    bounds = _bounds(problem)
    for finite in (problem, _neighbour(problem)):
        for reply, theirs in zip(ours, _replies(finite), strict=True):
            assert list(reply) == list(theirs)
            for record_name, record in reply.items():
                if not isinstance(record, ArrayRecord):
                    assert dict(record) == dict(theirs[record_name]), record_name
                    continue
                for key in record:
                    a, b = (torch.from_numpy(r[key].numpy()).double()
                            for r in (record, theirs[record_name]))
                    assert bool(torch.isfinite(a).all()), key
                    assert torch.linalg.vector_norm(a - b).item() <= 1.1 * bounds[key], key


def test_a_quantile_update_that_overflows_is_sent_as_no_update(small_config, monkeypatch,
                                                              caplog):
    """Client 0's local steps overflow (its gradient forced to inf): its central update is sent
    as zeros and counted as unclipped, as a zero update would be; the others are untouched."""
    problem = build_problem(small_config(algorithm="dp-fedavg-quantile", noise_multiplier=1.0,
                                         clipped_count_stddev=5.0))
    algorithm = problem.algorithm
    gradients = algorithm.model.batch_gradients

    def overflowing(flat, x, y, **kwargs):
        out = gradients(flat, x, y, **kwargs)
        out[0] = math.inf
        return out

    monkeypatch.setattr(algorithm.model, "batch_gradients", overflowing)
    broadcast = algorithm.broadcast("train", algorithm.init_server_state(problem.x0), 1)
    with caplog.at_level("WARNING", logger="dpfl"):
        uploads, _, _ = ClientRuntime.of(problem).step(
            "train", 1, broadcast, algorithm.init_client_state(4), problem.full_cohort())
    assert not uploads["delta"][0].any() and uploads["unclipped"][0, 0] == 1
    assert bool(uploads["delta"][1:].abs().sum(dim=1).gt(0).all())
    assert any("upload 'delta' of clients [0] was not finite" in r.getMessage()
               for r in caplog.records)


# ---- a whole run ----------------------------------------------------------------------------

@pytest.fixture
def digits_with_a_nan_record(monkeypatch):
    """The digits dataset with a NaN feature in its first training record (every loader call;
    the loader's in-process cache is emptied before and after, so no other test sees it)."""
    load = DATASETS.get("digits")

    def with_nan(*, seed: int, num_public: int = 0):
        ds = load(seed=seed, num_public=num_public)
        train_x = ds.train_x.clone()
        train_x[0, 10] = math.nan
        return dataclasses.replace(ds, train_x=train_x)

    _load.cache_clear()
    monkeypatch.setitem(DATASETS._entries, "digits", with_nan)
    yield
    monkeypatch.undo()
    _load.cache_clear()


@pytest.mark.parametrize("name", ["dpsgd-gc", "clip21-sgd2m"])
def test_a_run_with_a_nan_record_finishes_with_a_finite_model(name, tmp_path, caplog,
                                                              digits_with_a_nan_record):
    """Every round of a run whose one record has a NaN feature (in every batch: a client's
    batch is its whole data) completes, its model is finite, and the drop is in the log."""
    with caplog.at_level("WARNING", logger="dpfl"):
        assert main(["run", "-q", "-c", f'algorithm="{name}" num-partitions=3 batch-size=479 '
                     f'num-server-rounds=2 results-dir="{tmp_path}" run-name="nan"']) == 0
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and not summary["stopped_early"]
    model = torch.load(tmp_path / "nan" / "model.pt")
    assert all(bool(torch.isfinite(v).all()) for v in model.values())
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2 and dropped[0].startswith("round 1, exchange 'train': clients "
                                                       "[0, 1, 2] dropped 1 record")
