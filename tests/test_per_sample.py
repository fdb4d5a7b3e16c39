"""Per-sample gradients and per-sample clipping of ``FlatModel``.

Tolerances: "close" means max|ours − reference| ≤ rtol · max|reference| (relative to the
largest entry). The maths is checked in float64 (``FlatModel`` runs in the dtype of its inputs)
against float64 references, with rtol = 1e-10: rounding cannot reach that, a wrong formula can.
The float32 path the runs use is checked with rtol = 1e-5: a float32 gradient through the MLP's
784→256 layer is itself ~1.4e-6 off (measured on an AVX-512 CPU; the order MKL sums in depends
on the CPU), ~2e-6 for the deep nets. Clipping references are computed in float64 from
materialised gradients. Reproducibility properties are checked bit for bit with ``torch.equal``.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule

from dpfl.errors import ConfigError
from dpfl.models import FlatModel, build_model
from dpfl.models.functional import GROUP_BYTES
from dpfl.models.rows import aligned_rows
from dpfl.models.stacked import views
from dpfl.privacy.clipping import FLAT

RTOL64, RTOL32 = 1e-10, 1e-5

# name -> (input shape, classes, loss)
CASES = {
    "mlp": ((1, 28, 28), 10, "cross-entropy"),
    "clip21-cnn": ((1, 28, 28), 10, "cross-entropy"),
    "logistic": ((13,), 1, "logistic"),  # 13 features: per-client rows start misaligned
    "random-feature-mlp": ((20,), 4, "cross-entropy"),
    "resnet20": ((3, 16, 16), 10, "cross-entropy"),
    "dpftrl-cnn": ((3, 32, 32), 10, "cross-entropy"),
    "least-squares": ((7,), 1, "squared"),
}


def _setup(name: str, clients: int = 2, batch: int = 5, seed: int = 0,
           dtype: torch.dtype = torch.float32, **kwargs):
    shape, classes, loss = CASES[name]
    model = build_model(name, input_shape=shape, num_classes=classes, seed=seed)
    flat_model = FlatModel(model, loss, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(clients, batch, *shape, generator=gen)
    if loss == "cross-entropy":
        y = torch.randint(0, classes, (clients, batch), generator=gen)
    elif loss == "logistic":
        y = torch.randint(0, 2, (clients, batch), generator=gen).float() * 2 - 1
    else:
        y = torch.randn(clients, batch, generator=gen)
    flat = flat_model.initial_params() + 0.05 * torch.randn(flat_model.d, generator=gen)
    return flat_model, flat.to(dtype), x.to(dtype), y.to(dtype) if y.is_floating_point() else y


def _close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """Close to ``ref`` at the tolerance of ``ours``' dtype (see the module docstring)."""
    rtol = RTOL64 if ours.dtype == torch.float64 else RTOL32
    err = (ours.double() - ref.double()).abs().max().item()
    return err <= rtol * max(ref.double().abs().max().item(), 1e-12)


def _per_sample_loss(flat_model: FlatModel, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return flat_model.loss.per_sample(out, y)


def _naive(flat_model: FlatModel, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """[b, d]: one ``torch.autograd.grad`` per sample, regulariser included, in float64."""
    module = flat_model.load_into(flat).double()
    params = [p for p in module.parameters() if p.requires_grad]
    rows = []
    for j in range(len(x)):
        loss = _per_sample_loss(flat_model, module(x[j : j + 1].double()), y[j : j + 1]).sum()
        if flat_model.nonconvex_reg:
            sq = torch.cat([p.reshape(-1) for p in params]).square()
            loss = loss + 0.5 * flat_model.nonconvex_reg * (sq / (1 + sq)).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def _clip_then_mean(grads: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference clipping of materialised [b, d] gradients, in float64, at the radius rounded
    to float32 as ``clipped_mean`` rounds it (a radius means the same in either dtype)."""
    clip = torch.tensor(clip, dtype=torch.float32).item()
    grads = grads.double()
    norms = grads.norm(dim=1)
    scale = torch.where(norms > clip, clip / norms, torch.ones_like(norms))
    return (grads * scale[:, None]).mean(dim=0), norms


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # Opacus, inputs need no grad
@pytest.mark.parametrize(
    "name", ["mlp", "clip21-cnn", "logistic", "random-feature-mlp", "resnet20"]
)
def test_per_sample_gradients_equal_opacus_grad_sample(name):
    flat_model, flat, x, y = _setup(name, clients=1, batch=4)
    ours = flat_model.per_sample_gradients(flat, x, y)[0]
    module = GradSampleModule(flat_model.load_into(flat), loss_reduction="sum")
    _per_sample_loss(flat_model, module(x[0]), y[0]).sum().backward()
    trainable = [p for p in module.parameters() if p.requires_grad]
    ref = torch.cat([p.grad_sample.reshape(len(x[0]), -1) for p in trainable], dim=1)
    assert _close(ours, ref)


@pytest.mark.parametrize(
    "name", ["mlp", "clip21-cnn", "logistic", "resnet20", "dpftrl-cnn", "least-squares"]
)
def test_per_sample_gradients_equal_naive_autograd_loop(name):
    for dtype in (torch.float64, torch.float32):
        flat_model, flat, x, y = _setup(name, clients=2, batch=3, dtype=dtype)
        ours = flat_model.per_sample_gradients(flat, x, y)
        assert ours.dtype == dtype
        for c in range(2):
            assert _close(ours[c], _naive(flat_model, flat, x[c], y[c]))


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn", "logistic", "resnet20", "dpftrl-cnn"])
def test_clipped_mean_equals_clip_then_mean(name):
    flat_model, flat, x, y = _setup(name, clients=2, batch=6, dtype=torch.float64)
    grads = flat_model.per_sample_gradients(flat, x, y)
    clip = grads.norm(dim=2).median().item()  # some samples clipped, some not
    means, norms = flat_model.clipped_mean(flat, x, y, clip)
    for c in range(2):
        ref_mean, ref_norms = _clip_then_mean(grads[c], clip)
        assert _close(means[c], ref_mean)
        assert _close(norms[c], ref_norms)
    assert grads.norm(dim=2).gt(clip).any() and grads.norm(dim=2).lt(clip).any()


def test_clipped_mean_takes_one_radius_per_client():
    flat_model, flat, x, y = _setup("clip21-cnn", clients=3, batch=4, dtype=torch.float64)
    grads = flat_model.per_sample_gradients(flat, x, y)
    radii = torch.tensor([0.01, 0.1, 100.0])
    means, _ = flat_model.clipped_mean(flat, x, y, radii)
    for c in range(3):
        assert _close(means[c], _clip_then_mean(grads[c], radii[c].item())[0])
    assert _close(means[2], grads[2].double().mean(dim=0))  # radius above every norm: no clipping


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn"])
def test_every_clipped_per_sample_norm_is_at_most_the_radius(name):
    flat_model, flat, x, y = _setup(name, clients=2, batch=8)
    clip = 0.05
    # One sample per "client": the clipped mean of a single sample is its clipped gradient.
    singles_x, singles_y = x.reshape(16, 1, *x.shape[2:]), y.reshape(16, 1)
    clipped, norms = flat_model.clipped_mean(flat, singles_x, singles_y, clip)
    clipped_norms = clipped.double().norm(dim=1)
    assert (clipped_norms <= clip * (1 + 1e-6)).all()
    big = norms[:, 0] > clip
    assert big.any()
    assert torch.allclose(clipped_norms[big], torch.full_like(clipped_norms[big], clip), rtol=1e-5)


def test_a_zero_gradient_is_left_unclipped():
    flat_model, flat, x, y = _setup("least-squares", clients=1, batch=3)
    y = (x[..., :] @ flat).detach()  # exact fit: every per-sample gradient is 0
    means, norms = flat_model.clipped_mean(flat, x, y, 1.0)
    assert torch.isfinite(means).all() and means.abs().max() == 0 and norms.abs().max() == 0


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn", "resnet20"])
def test_chunking_gives_the_same_results(name):
    flat_model, flat, x, y = _setup(name, clients=2, batch=9, dtype=torch.float64)
    clip = 0.3
    results = []
    for chunk in (1, 7, 256):
        flat_model.chunk_size = chunk
        grads = flat_model.per_sample_gradients(flat, x, y)
        results.append((grads, *flat_model.clipped_mean(flat, x, y, clip)))
    for other in results[1:]:
        for ours, ref in zip(other, results[0]):
            assert _close(ours, ref)


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn", "logistic"])
def test_a_chunk_byte_budget_leaves_the_results_unchanged(name):
    """float64, rtol 1e-10: budgets of one sample per chunk, three, and none (a linear model's
    closed form, otherwise one chunk per client, is split too; chunks of any length, ResNet-20
    included, are checked by test_chunking_gives_the_same_results)."""
    flat_model, flat, x, y = _setup(name, clients=2, batch=7, dtype=torch.float64)
    per_row = flat_model.sample_bytes(flat, x, y, rows=True)
    per_clip = flat_model.sample_bytes(flat, x, y, rows=False)
    results = []
    for budget in (None, 1, 3 * per_clip):
        flat_model.chunk_bytes = budget
        losses = torch.empty(2, 7, dtype=torch.float64)
        grads = flat_model.per_sample_gradients(flat, x, y)
        results.append((grads, *flat_model.clipped_mean(flat, x, y, 0.3, losses=losses), losses))
        if budget is not None:
            for rows, per_sample in ((False, per_clip), (True, per_row)):
                length = flat_model.chunk_length(flat, x, y, rows=rows)
                assert length == min(7, max(1, budget // per_sample))
    for other in results[1:]:
        for ours, ref in zip(other, results[0]):
            assert _close(ours, ref)


@pytest.mark.parametrize("method, pair", [("clipped_mean", 0), ("clipped_difference_mean", 1)])
def test_no_tape_outlives_its_group(method, pair):
    """A group's tapes are freed before the next group's forward pass, so a step holds one
    chunk's per-sample values (a name left holding the last tape would double the peak): at every
    forward pass, no earlier tape is alive but the other point's of the same chunk (``pair``)."""
    flat_model, flat, x, y = _setup("clip21-cnn", clients=2, batch=8)
    flat_model.chunk_size = 4  # groups of one 4-sample chunk: four of them
    flat_model.group_bytes = 1
    flat_model.sample_bytes(flat, x, y, rows=False)  # its one-sample pass, made once, first
    record, alive, calls = flat_model.tapes.record, [], []

    def tracked(*args, **kwargs):
        calls.append(sum(ref() is not None for ref in alive))
        tape = record(*args, **kwargs)
        alive.append(weakref.ref(tape[0][2]))  # the first layer's output gradients
        return tape

    flat_model.tapes.record = tracked
    if method == "clipped_mean":
        flat_model.clipped_mean(flat, x, y, 0.1)
    else:
        flat_model.clipped_difference_mean(flat, flat * 0.9, x, y, clip=0.1, clip_diff=0.05,
                                           gamma=0.5)
    assert len(calls) == 4 * (1 + pair)
    assert max(calls) == pair


@pytest.mark.parametrize("name", ["clip21-cnn", "logistic"])
def test_no_chunk_of_gradient_rows_exceeds_the_byte_budget(name):
    flat_model, flat, x, y = _setup(name, clients=2, batch=10)
    per_row = flat_model.sample_bytes(flat, x, y, rows=True)
    assert per_row >= 4 * flat_model.d  # a row is counted, at least
    flat_model.chunk_bytes = 3 * per_row + per_row // 2
    lengths = [len(rows) for _, _, rows in flat_model.per_sample_gradient_chunks(flat, x, y)]
    assert lengths == [3, 3, 3, 1] * 2


@pytest.mark.parametrize("own", [False, True])
def test_how_clients_are_grouped_changes_no_bit(own):
    """Groups of one chunk (``group_bytes=1``; here a client's batch), of three clients'
    chunks, and of every client (the default on the MLP): the same clipped means, norms,
    losses and clipped difference means, bit for bit, at one point and at points of their own;
    and every group holds what its budget allows, at least one chunk (the joint tapes a larger
    group takes are checked per layout, so this holds whatever the verdicts)."""
    flat_model, flat, x, y = _setup("mlp", clients=7, batch=16, chunk_size=16)
    points = aligned_rows(flat, 7, flat_model.d).copy_(
        flat + 0.01 * torch.arange(7.0)[:, None]) if own else flat
    per_sample = flat_model.sample_bytes(flat, x, y, rows=False)
    sizes, results = [], []
    groups = flat_model.tapes.groups

    def recorded(*args, **kwargs):
        held = list(groups(*args, **kwargs))
        sizes.append(max(sum(chunk.n for chunk in group) for group in held))
        return iter(held)

    flat_model.tapes.groups = recorded
    # (budget, most samples a group of the clipped mean holds, of the clipped difference's)
    for budget, most, most_difference in ((1, 16, 16), (3 * 16 * per_sample, 48, 16),
                                          (GROUP_BYTES, 112, 112)):
        flat_model.group_bytes = budget
        assert flat_model.group_length(flat, x, y, 16) == max(16, budget // per_sample)
        losses = torch.empty(7, 16)
        results.append((*flat_model.clipped_mean(points, x, y, 0.1, losses=losses), losses,
                        flat_model.clipped_difference_mean(points, flat * 0.9, x, y, clip=0.2,
                                                           clip_diff=0.05, gamma=0.5)))
        assert sizes[-2:] == [most, most_difference]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, results[0], strict=True))


def test_a_group_stays_within_the_chunk_byte_budget():
    """``chunk_bytes`` caps a group as it caps a chunk (the memory a step holds at once); a
    model whose samples are large (the Clip21 CNN's 165 KB) keeps groups of one chunk's
    samples; two tapes a sample (a clipped difference) halve the group."""
    flat_model, flat, x, y = _setup("mlp", clients=2, batch=8)
    per_sample = flat_model.sample_bytes(flat, x, y, rows=False)
    assert flat_model.group_length(flat, x, y, 256) == GROUP_BYTES // per_sample > 256
    assert flat_model.group_length(flat, x, y, 256, tapes=2) == GROUP_BYTES // (2 * per_sample)
    flat_model.chunk_bytes = 300 * per_sample
    assert flat_model.group_length(flat, x, y, 256) == 300
    cnn, flat, x, y = _setup("clip21-cnn", clients=2, batch=8)
    assert cnn.sample_bytes(flat, x, y, rows=False) > GROUP_BYTES // 256
    assert cnn.group_length(flat, x, y, 256) == 256
    with pytest.raises(ValueError, match="group_bytes"):
        FlatModel(build_model("mlp", input_shape=(1, 28, 28), num_classes=10, seed=0),
                  "cross-entropy", group_bytes=0)


@pytest.mark.parametrize("name, reg", [("mlp", 0.0), ("mlp", 0.01), ("clip21-cnn", 0.0),
                                       ("logistic", 0.0)])
@pytest.mark.parametrize("own", [False, True])
def test_per_sample_norms_are_the_clipped_means_norms_bitwise(name, reg, own):
    """``per_sample_norms`` gives the norms ``clipped_mean`` reports, bit for bit, at one point
    and at points of their own, before and after a layout's verdict, without a weighted sum
    (a linear model's closed form excepted); a record whose gradient is not finite gets 0 and
    is dropped in both."""
    flat_model, flat, x, y = _setup(name, clients=4, batch=8, nonconvex_reg=reg)
    x[1, 2] = float("nan")
    points = aligned_rows(flat, 4, flat_model.d).copy_(
        flat + 0.01 * torch.arange(4.0)[:, None]) if own else flat
    _, expected = flat_model.clipped_mean(points, x, y, 0.3)
    dropped = flat_model.take_dropped()
    assert dropped == 1 and expected[1, 2] == 0
    if flat_model.linear is None:
        flat_model.tapes.add_weighted = None  # a weighted sum would fail
    for _ in range(2):  # the first call of a layout checks it, the second takes the verdict
        assert torch.equal(flat_model.per_sample_norms(points, x, y), expected)
        assert flat_model.take_dropped() == dropped


def test_a_chunk_byte_budget_must_be_positive():
    model = build_model("mlp", input_shape=(1, 28, 28), num_classes=10, seed=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        FlatModel(model, "cross-entropy", chunk_bytes=0)


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn"])
def test_per_client_points_equal_separate_calls(name):
    flat_model, flat, x, y = _setup(name, clients=3, batch=4)
    points = torch.stack([flat + 0.01 * k for k in range(3)])
    means, norms = flat_model.clipped_mean(points, x, y, 0.2)
    grads = flat_model.per_sample_gradients(points, x, y)
    batch = flat_model.batch_gradients(points, x, y)
    for c in range(3):
        one = slice(c, c + 1)
        m, n = flat_model.clipped_mean(points[c], x[one], y[one], 0.2)
        assert torch.equal(means[c], m[0]) and torch.equal(norms[c], n[0])
        assert torch.equal(grads[c], flat_model.per_sample_gradients(points[c], x[one], y[one])[0])
        assert torch.equal(batch[c], flat_model.batch_gradients(points[c], x[one], y[one])[0])


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn", "logistic", "resnet20"])
@pytest.mark.parametrize("shared", [True, False])
def test_a_client_result_does_not_depend_on_the_other_clients_bitwise(name, shared):
    """A Flower client calls with C = 1, the engine with C = 4 (whose clients' clip factors are
    computed together, in one group): every client agrees bit for bit (the rows of a [4, d]
    result start at four different offsets from a 64-byte boundary; with 8 or more samples
    MKL's GEMM result depends on that offset, measured on an AVX-512 CPU)."""
    flat_model, flat, x, y = _setup(name, clients=4, batch=8, nonconvex_reg=1e-3)
    flat4 = flat if shared else torch.stack([flat + 0.01 * k for k in range(4)])
    radii4 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    m4, n4 = flat_model.clipped_mean(flat4, x, y, radii4)
    difference = dict(clip=0.2, clip_diff=0.05, gamma=0.5)  # PriSMA's increment
    d4 = flat_model.clipped_difference_mean(flat4, flat4 * 0.9, x, y, **difference)
    methods = (flat_model.batch_gradients, flat_model.per_sample_gradients)
    together = [method(flat4, x, y) for method in methods]
    losses4 = flat_model.losses(flat4, x, y) if not shared else None
    for c in range(4):
        flat1 = flat.clone() if shared else flat4[c].clone()
        x1, y1 = x[c : c + 1].clone(), y[c : c + 1].clone()
        m1, n1 = flat_model.clipped_mean(flat1, x1, y1, radii4[c].item())
        assert torch.equal(m4[c], m1[0]) and torch.equal(n4[c], n1[0])
        d1 = flat_model.clipped_difference_mean(flat1, flat1 * 0.9, x1, y1, **difference)
        assert torch.equal(d4[c], d1[0])
        for method, result in zip(methods, together):
            assert torch.equal(result[c], method(flat1, x1, y1)[0])
        if losses4 is not None:
            assert torch.equal(losses4[c], flat_model.losses(flat1[None], x1, y1)[0])


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn", "logistic"])
def test_regulariser_gradient_matches_autograd(name):
    lam = 0.5
    flat_model, flat, x, y = _setup(name, clients=1, batch=4, dtype=torch.float64,
                                    nonconvex_reg=lam)
    naive = _naive(flat_model, flat, x[0], y[0])
    assert _close(flat_model.per_sample_gradients(flat, x, y)[0], naive)
    assert _close(flat_model.batch_gradients(flat, x, y)[0], naive.mean(dim=0))
    clip = 0.5 * naive.norm(dim=1).median().item()
    means, norms = flat_model.clipped_mean(flat, x, y, clip)
    ref_mean, ref_norms = _clip_then_mean(naive, clip)
    assert _close(means[0], ref_mean) and _close(norms[0], ref_norms)
    sq = flat.double().square()
    plain = FlatModel(flat_model.load_into(flat), CASES[name][2]).losses(flat, x[0], y[0])
    expected = plain.double() + 0.5 * lam * (sq / (1 + sq)).sum()
    assert _close(flat_model.losses(flat, x[0], y[0]), expected)


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn", "least-squares"])
def test_batch_gradients_are_the_gradient_of_the_mean_loss(name):
    flat_model, flat, x, y = _setup(name, clients=2, batch=5, dtype=torch.float64)
    ours = flat_model.batch_gradients(flat, x, y)
    for c in range(2):
        assert _close(ours[c], _naive(flat_model, flat, x[c], y[c]).mean(dim=0))


def test_frozen_random_features_are_not_trainable_parameters():
    model = build_model("random-feature-mlp", input_shape=(784,), num_classes=10, seed=3)
    flat_model = FlatModel(model, "cross-entropy")
    assert flat_model.d == 512 * 10 + 10 == flat_model.initial_params().numel()
    x, y = torch.randn(1, 4, 784), torch.randint(0, 10, (1, 4))
    assert flat_model.per_sample_gradients(flat_model.initial_params(), x, y).shape == (1, 4, 5130)
    loaded = flat_model.load_into(torch.zeros(flat_model.d))
    assert torch.equal(loaded[1].weight, model[1].weight)  # the frozen layer travels unchanged
    assert loaded[3].weight.abs().max() == 0


def test_load_into_round_trips_the_flat_vector():
    flat_model, flat, _, _ = _setup("resnet20")
    module = flat_model.load_into(flat)
    assert torch.equal(torch.cat([p.reshape(-1) for p in module.parameters()]), flat)
    assert torch.equal(FlatModel(module, "cross-entropy").initial_params(), flat)


def test_batchnorm_models_are_refused():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    with pytest.raises(ConfigError, match="layer '1' \\(BatchNorm2d\\).*use GroupNorm") as error:
        FlatModel(model, "cross-entropy")
    assert error.value.key == "model"


def test_evaluate_reports_mean_loss_and_accuracy():
    flat_model, flat, x, y = _setup("mlp", clients=1, batch=30)
    result = flat_model.evaluate(flat, x[0], y[0], batch_size=7)
    out = flat_model.load_into(flat)(x[0])
    assert result["loss"] == pytest.approx(F.cross_entropy(out, y[0]).item(), rel=1e-5)
    assert result["accuracy"] == pytest.approx((out.argmax(1) == y[0]).float().mean().item())
    ls_model, ls_flat, ls_x, ls_y = _setup("least-squares", clients=1, batch=10)
    assert ls_model.evaluate(ls_flat, ls_x[0], ls_y[0])["accuracy"] is None


class _Unused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(6, 3)
        self.unused = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_layer_left_out_of_the_forward_pass_gets_zero_gradient():
    flat_model = FlatModel(_Unused(), "cross-entropy")
    x, y = torch.randn(2, 4, 6), torch.randint(0, 3, (2, 4))
    flat = torch.full((flat_model.d,), float("nan"))
    flat[:21] = flat_model.initial_params()[:21]  # the unused layer's parameters are never read
    flat_model.clipped_mean(flat, x, y, 0.1)[0].fill_(float("nan"))  # leave NaNs on the heap, where
    means, _ = flat_model.clipped_mean(flat, x, y, 0.1)  # the next result is likely allocated
    grads = flat_model.per_sample_gradients(flat, x, y)
    assert means[:, 21:].abs().max() == 0 and grads[:, :, 21:].abs().max() == 0
    assert torch.isfinite(means).all()


class _Odd(torch.nn.Module):
    """Layer variants the zoo does not use: strided, dilated and grouped convolutions, a
    GroupNorm, and a Linear applied along a sequence axis."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, stride=(2, 1), padding=(1, 2), dilation=(1, 2))
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.seq = torch.nn.Linear(11, 5)
        self.head = torch.nn.Linear(8 * 6 * 5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.conv2(torch.tanh(self.conv1(x)))))  # [n, 8, 6, 11]
        return self.head(torch.tanh(self.seq(h.reshape(len(h), 8 * 6, 11))).flatten(1))


def test_layer_variants_match_naive_autograd():
    torch.manual_seed(0)
    flat_model = FlatModel(_Odd(), "cross-entropy")
    flat = flat_model.initial_params().double()
    x, y = torch.randn(1, 5, 3, 12, 11, dtype=torch.float64), torch.randint(0, 4, (1, 5))
    naive = _naive(flat_model, flat, x[0], y[0])
    assert _close(flat_model.per_sample_gradients(flat, x, y)[0], naive)
    clip = naive.norm(dim=1).median().item()
    means, norms = flat_model.clipped_mean(flat, x, y, clip)
    ref_mean, ref_norms = _clip_then_mean(naive, clip)
    assert _close(means[0], ref_mean) and _close(norms[0], ref_norms)


class Centred(torch.nn.Module):
    """Subtracts the batch's mean input: a layer that mixes samples (as batch normalisation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn", "random-feature-mlp", "resnet20"])
@pytest.mark.parametrize("batch", [8, 16])  # on an AVX-512 CPU, 8 stays per client, 16 joins
def test_a_group_taken_jointly_equals_its_clients_alone_bitwise(name, batch):
    """Clients at one point with whole batches of one size may share one tape (one forward
    and backward pass over the group, at each point): the first call of a layout checks that
    this gives what a tape per client gave, bit for bit, and later calls take it only where it
    did. Either way every client's clipped mean, norms, losses and clipped difference mean
    (PriSMA's increment) equal its own alone (a Flower node's call)."""
    flat_model, flat, x, y = _setup(name, clients=6, batch=batch)
    engine, records = flat_model.tapes, []
    record = engine.record
    engine.record = lambda *args, **kwargs: records.append(1) or record(*args, **kwargs)
    difference = dict(clip=0.2, clip_diff=0.05, gamma=0.5)
    alone = [(*flat_model.clipped_mean(flat, x[c:c + 1], y[c:c + 1], 0.1),
              flat_model.clipped_difference_mean(flat, flat * 0.9, x[c:c + 1], y[c:c + 1],
                                                 **difference))
             for c in range(6)]
    for _ in range(2):  # the first call decides, the second takes the verdict
        records.clear()
        losses = torch.empty(6, batch)
        means, norms = flat_model.clipped_mean(flat, x, y, 0.1, losses=losses)
        increments = flat_model.clipped_difference_mean(flat, flat * 0.9, x, y, **difference)
        for c, (m1, n1, d1) in enumerate(alone):
            assert torch.equal(means[c], m1[0]) and torch.equal(norms[c], n1[0])
            assert torch.equal(increments[c], d1[0])
            assert torch.equal(losses[c], flat_model.losses(flat[None], x[c:c + 1], y[c:c + 1])[0])
    verdicts = {key[0]: joint for key, joint in engine.joint.items()}
    assert len(verdicts) == len(engine.joint) == 2
    assert len(records) == (1 if verdicts["mean"] else 6) + (2 if verdicts["difference"] else 12)


@pytest.mark.parametrize("name", ["mlp", "clip21-cnn", "logistic"])
def test_a_ragged_batch_gives_each_client_its_own_records_alone_bitwise(name):
    """Poisson batches come ragged: ``lengths[c]`` records of client c, the clients' records
    packed one after another. Each client's clipped mean (divided by the public b, not its own
    length), norms, losses, clipped difference mean and per-sample norms equal those of its
    own records alone, bit for bit (a Flower node's call), however the others' lengths fall;
    a client without records gets zeros, and the norms beyond a client's records are 0."""
    lengths, b = [5, 0, 2, 5, 3], 4  # the longest first and fourth: a layout of whole rows
    flat_model, flat, x, y = _setup(name, clients=5, batch=5, seed=3)
    packed_x = torch.cat([x[c, :n] for c, n in enumerate(lengths)])
    packed_y = torch.cat([y[c, :n] for c, n in enumerate(lengths)])
    difference = dict(clip=0.2, clip_diff=0.05, gamma=0.5)
    for _ in range(2):  # a joint layout's verdict is taken on the first call, used on the second
        losses = torch.zeros(5, 5)
        means, norms = flat_model.clipped_mean(flat, packed_x, packed_y, 0.1, losses=losses,
                                               lengths=lengths, divisor=b)
        increments = flat_model.clipped_difference_mean(flat, flat * 0.9, packed_x, packed_y,
                                                        lengths=lengths, divisor=b, **difference)
        only_norms = flat_model.per_sample_norms(flat, packed_x, packed_y, lengths=lengths)
        assert norms.shape == only_norms.shape == (5, 5)
        for c, n in enumerate(lengths):
            assert torch.equal(norms[c, n:], torch.zeros(5 - n))
            assert torch.equal(only_norms[c], norms[c])
            if n == 0:
                assert not means[c].any() and not increments[c].any()
                continue
            own_x, own_y = x[c:c + 1, :n], y[c:c + 1, :n]
            own_losses = torch.zeros(1, n)
            mean, own_norms = flat_model.clipped_mean(flat, own_x, own_y, 0.1, losses=own_losses,
                                                      divisor=b)
            assert torch.equal(means[c], mean[0]) and torch.equal(norms[c, :n], own_norms[0])
            assert torch.equal(losses[c, :n], own_losses[0])
            assert torch.equal(increments[c], flat_model.clipped_difference_mean(
                flat, flat * 0.9, own_x, own_y, divisor=b, **difference)[0])
    # the divisor is the public b: the sum of the client's clipped gradients over b
    full = flat_model.clipped_mean(flat, x[:1], y[:1], 0.1)[0][0]
    assert _close(means[0], full * 5 / b)
    # no records at all: zeros, and nothing computed
    nothing = flat_model.clipped_mean(flat, packed_x[:0], packed_y[:0], 0.1, lengths=[0, 0],
                                      divisor=b)
    assert nothing[0].shape == (2, flat_model.d) and not nothing[0].any()
    assert nothing[1].shape == (2, 0)


def test_clients_at_points_of_the_same_bits_share_a_tape():
    """Per-client points ``[C, d]`` (a round of local steps) whose rows hold the same bits, as
    every client's do at the round's first step, are taken as one point: the group may share a
    tape, and every client's clipped mean and norms are still its own alone, bit for bit. A
    row that differs only by the sign of a zero is another point, and a group of two points
    keeps a tape per client."""
    flat_model, flat, x, y = _setup("mlp", clients=6, batch=16)
    flat[0] = 0.0
    points = aligned_rows(flat, 6, flat_model.d).copy_(flat)  # six copies, six places
    engine, records = flat_model.tapes, []
    record = engine.record
    engine.record = lambda *args, **kwargs: records.append(1) or record(*args, **kwargs)
    for _ in range(2):  # the first call decides, the second takes the verdict
        records.clear()
        means, norms = flat_model.clipped_mean(points, x, y, 0.1)
    assert engine.joint and len(records) == (1 if all(engine.joint.values()) else 6)
    points[3, 0] = -0.0  # equal to 0.0, not the same bits
    records.clear()
    again, _ = flat_model.clipped_mean(points, x, y, 0.1)
    assert len(records) == 6
    for c in range(6):
        alone, alone_norms = flat_model.clipped_mean(flat, x[c:c + 1], y[c:c + 1], 0.1)
        assert torch.equal(means[c], alone[0]) and torch.equal(norms[c], alone_norms[0])
        if c != 3:
            assert torch.equal(again[c], alone[0])


@pytest.mark.parametrize("name", ["mlp", "random-feature-mlp"])
def test_clients_at_points_of_their_own_may_share_a_pass(name):
    """Clients at points of their own, rows of one ``[C, d]`` tensor (a local step after the
    first), of a sequential model: one pass with each client's weights in a batched GEMM, where
    the layout's check found it the same; every client's clipped mean, norms and losses, and
    its clipped difference mean between two such points, equal its own alone, bit for bit."""
    flat_model, flat, x, y = _setup(name, clients=6, batch=16)
    gen = torch.Generator().manual_seed(7)
    points = aligned_rows(flat, 6, flat_model.d).copy_(flat + 0.01 * torch.randn(
        6, flat_model.d, generator=gen))
    before = aligned_rows(flat, 6, flat_model.d).copy_(points * 0.9)
    engine, stacked = flat_model.tapes, []
    record = engine.record_stacked
    engine.record_stacked = lambda *args, **kwargs: stacked.append(1) or record(*args, **kwargs)
    difference = {"clip": 0.2, "clip_diff": 0.05, "gamma": 0.5}
    for _ in range(2):  # the first call decides, the second takes the verdict
        stacked.clear()
        losses = torch.empty(6, 16)
        means, norms = flat_model.clipped_mean(points, x, y, 0.1, losses=losses)
        increments = flat_model.clipped_difference_mean(points, before, x, y, **difference)
    verdicts = {key[0]: joint for key, joint in engine.joint.items()}
    assert len(verdicts) == 2 and all("stacked" in key for key in engine.joint)
    assert len(stacked) == (1 if verdicts["mean"] else 0) + (2 if verdicts["difference"] else 0)
    for c in range(6):
        alone, alone_norms = flat_model.clipped_mean(points[c], x[c:c + 1], y[c:c + 1], 0.1)
        assert torch.equal(means[c], alone[0]) and torch.equal(norms[c], alone_norms[0])
        assert torch.equal(losses[c], flat_model.losses(points[c][None], x[c:c + 1],
                                                        y[c:c + 1])[0])
        increment = flat_model.clipped_difference_mean(points[c], before[c], x[c:c + 1],
                                                       y[c:c + 1], **difference)
        assert torch.equal(increments[c], increment[0])


def test_only_evenly_spaced_points_of_a_sequential_model_are_stacked():
    """Points that are not rows of one tensor (copies), and a model that is not a sequence of
    Linear layers and sample-wise modules, keep a tape per client."""
    flat_model, flat, _, _ = _setup("mlp", clients=3, batch=16)
    copies = [flat_model.flat.params(flat.clone() * s) for s in (1.0, 0.5, 2.0)]
    rows = aligned_rows(flat, 3, flat_model.d).copy_(flat)
    assert views(copies) is None
    stacks = views([flat_model.flat.params(row) for row in rows])
    assert stacks is not None and all(torch.equal(v[2], p) for v, p in
                                     zip(stacks, flat_model.flat.params(rows[2])))
    assert _setup("clip21-cnn")[0].tapes.sequence is None
    assert len(flat_model.tapes.sequence) == 4


@pytest.mark.parametrize("name, own", [("clip21-cnn", False), ("mlp", True)])
def test_a_joint_tape_splits_into_each_clients_own(name, own):
    """Taken jointly (whatever the verdict on this CPU), at one point or (``own``) at points of
    their own, the group's clipped means and norms are its clients' own in float64, to
    rounding: the split of the tape is the clients' tapes."""
    flat_model, flat, x, y = _setup(name, clients=3, batch=5, dtype=torch.float64)
    if own:
        scales = torch.tensor([[1.0], [0.5], [2.0]], dtype=flat.dtype)
        flat = aligned_rows(flat, 3, flat_model.d).copy_(flat * scales)
    (group,) = flat_model.tapes.groups(flat, x, y, 15)
    runs = []
    for joint in (False, True):
        out, norms = torch.empty(3, flat_model.d, dtype=torch.float64), torch.empty(3, 5,
                                                                                  dtype=x.dtype)
        flat_model.tapes.clip_group(FLAT, [0.1] * 3, 5, group, {"out": out, "norms": norms},
                                    joint)
        runs.append((out, norms))
    assert _close(runs[1][0], runs[0][0]) and _close(runs[1][1], runs[0][1])
    assert not torch.equal(runs[0][0][0], runs[0][0][1])  # three clients' own means


def test_a_layer_that_mixes_samples_is_never_taken_jointly():
    """A module whose output for one sample depends on the others' (here: centred on the
    batch's mean) gives other numbers over a group than over a client's batch: the check finds
    it, and the clients keep a tape each."""
    model = torch.nn.Sequential(Centred(), torch.nn.Linear(6, 3))
    flat_model = FlatModel(model, "cross-entropy")
    x, y = torch.randn(4, 5, 6), torch.randint(0, 3, (4, 5))
    flat = flat_model.initial_params()
    for _ in range(2):
        means, _ = flat_model.clipped_mean(flat, x, y, 0.5)
    assert list(flat_model.tapes.joint.values()) == [False]
    for c in range(4):
        alone, _ = flat_model.clipped_mean(flat, x[c:c + 1], y[c:c + 1], 0.5)
        assert torch.equal(means[c], alone[0])


def test_joint_tapes_can_be_switched_off():
    """``joint_tapes=False``: every client's tape on its own, no layout checked."""
    flat_model, flat, x, y = _setup("mlp", clients=6, batch=16, joint_tapes=False)
    joining = _setup("mlp", clients=6, batch=16)[0]
    joined = [joining.clipped_mean(flat, x, y, 0.1)[0] for _ in range(2)]  # checked, then taken
    means, _ = flat_model.clipped_mean(flat, x, y, 0.1)
    assert flat_model.tapes.joint is None and torch.equal(means, joined[1])
