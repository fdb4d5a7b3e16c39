"""The model zoo and the losses: sizes from the specs, no BatchNorm, seeded init, errors."""

from __future__ import annotations

import math

import pytest
import torch
from opacus.validators import ModuleValidator
from torch import nn

from dpfl.errors import ConfigError
from dpfl.models import LOSSES, MODELS, build_model

# Every registered model, with the input it is meant for: a model registered without an entry
# here fails test_no_registered_model_has_batchnorm.
SHAPES = {
    "logistic": ((1, 28, 28), 10),
    "least-squares": ((20,), 1),
    "mlp": ((1, 28, 28), 10),
    "clip21-cnn": ((1, 28, 28), 10),
    "dpftrl-cnn": ((3, 32, 32), 10),
    "random-feature-mlp": ((784,), 10),
    "resnet20": ((3, 32, 32), 10),
    "pcdp-cnn": ((1, 28, 28), 10),
    "pcdp-lenet": ((3, 32, 32), 10),
}


def _build(name: str, seed: int = 0, **options) -> torch.nn.Module:
    shape, classes = SHAPES[name]
    return build_model(name, input_shape=shape, num_classes=classes, seed=seed, **options)


def _trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("mlp", 203_530),  # the Clip21 MLP: 784·256 + 256 + 256·10 + 10
        ("clip21-cnn", 22_842),  # 416 + 6,416 + 16,010 with our linear head
        ("dpftrl-cnn", 550_570),  # PriSMA §5.2
        ("resnet20", 269_722),  # He et al. 2016: 0.27M
        ("logistic", 7_850),
        ("least-squares", 20),
        ("random-feature-mlp", 5_130),  # 512 random features · 10 classes + 10
        ("pcdp-cnn", 26_010),  # PCDP-SGD's CNN (the first author's public code)
        ("pcdp-lenet", 797_962),  # its CIFAR-10 LeNet
    ],
)
def test_parameter_counts_match_the_specs(name, expected):
    assert _trainable(_build(name)) == expected


@pytest.mark.parametrize("name", MODELS.names())
def test_no_registered_model_has_batchnorm(name):
    model = _build(name)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert ModuleValidator.validate(model, strict=False) == []


@pytest.mark.parametrize("name", MODELS.names())
def test_output_has_one_column_per_class(name):
    shape, classes = SHAPES[name]
    assert _build(name)(torch.randn(3, *shape)).shape == (3, classes)


@pytest.mark.parametrize("name", MODELS.names())
def test_init_is_determined_by_the_seed(name):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, other = _build(name, seed=7), _build(name, seed=7), _build(name, seed=8)
    assert torch.equal(torch.rand(1), before)  # the global RNG is left alone
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key])
    if name != "least-squares":  # zero init whatever the seed
        assert any(not torch.equal(v, other.state_dict()[k]) for k, v in a.state_dict().items())


def test_unknown_model_is_a_config_error_listing_the_models():
    with pytest.raises(ConfigError) as info:
        build_model("vgg-16", input_shape=(3, 32, 32), num_classes=10, seed=0)
    assert info.value.key == "model"
    for name in MODELS.names():
        assert name in str(info.value)


def test_unknown_loss_is_a_config_error():
    with pytest.raises(ConfigError, match="loss"):
        LOSSES.get("hinge")


def test_dpftrl_cnn_init_follows_the_dpftrl_code():
    model = _build("dpftrl-cnn")
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in convs + linears:
        assert m.bias.abs().max() == 0
    for m in convs[1:]:  # enough weights for a tight std estimate
        assert m.weight.std().item() == pytest.approx(1 / math.sqrt(m.weight[0].numel()), rel=0.05)
    first = linears[0]
    xavier_std = math.sqrt(2 / sum(first.weight.shape))
    assert first.weight.std().item() == pytest.approx(xavier_std, rel=0.05)


def test_least_squares_starts_at_zero():
    assert _build("least-squares")[1].weight.abs().max() == 0


def test_random_feature_layer_is_frozen_and_head_is_trainable():
    model = _build("random-feature-mlp", hidden=128)
    assert not model[1].weight.requires_grad and not model[1].bias.requires_grad
    assert _trainable(model) == 128 * 10 + 10
    assert "1.weight" in model.state_dict()  # shipped with x_0


def test_logistic_loss_is_stable_softplus_of_the_negative_margin():
    out = torch.tensor([[0.3], [-2.0], [200.0], [-200.0]])
    y = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss = LOSSES.get("logistic").per_sample(out, y)
    assert torch.isfinite(loss).all()
    expected = [math.log1p(math.exp(-0.3)), math.log1p(math.exp(2.0))]
    assert loss[:2].tolist() == pytest.approx(expected)
    assert loss[2].item() == pytest.approx(200.0)
    assert loss[3].item() == pytest.approx(0.0, abs=1e-30)
    assert LOSSES.get("logistic").correct(out, y).tolist() == [True, False, False, True]


def test_squared_loss_is_half_the_squared_residual():
    loss = LOSSES.get("squared").per_sample(torch.tensor([[1.0], [3.0]]), torch.tensor([0.0, 1.0]))
    assert loss.tolist() == [0.5, 2.0]
    assert LOSSES.get("squared").correct is None


def test_cross_entropy_is_per_sample():
    out, y = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
    expected = torch.nn.functional.cross_entropy(out, y, reduction="none")
    assert torch.equal(LOSSES.get("cross-entropy").per_sample(out, y), expected)


@pytest.mark.parametrize("model, loss, classes, options, reg", [
    ("logistic", "logistic", 1, {"bias": False}, 2e-3),  # Clip21 E1
    ("logistic", "logistic", 1, {}, 0.0),
    ("logistic", "cross-entropy", 10, {}, 0.1),
    ("least-squares", "squared", 1, {}, 0.0),  # PriSMA eq. 22
])
def test_linear_models_closed_form_gradients_equal_autograd(model, loss, classes, options, reg):
    """Linear models skip autograd in batch_gradients (ClosedFormLinear.gradient); the same
    module behind an Identity takes the autograd path and must agree."""
    from dpfl.models import FlatModel

    torch.manual_seed(0)
    module = build_model(model, input_shape=(7,), num_classes=classes, seed=0, **options)
    closed = FlatModel(module, loss, nonconvex_reg=reg)
    auto = FlatModel(torch.nn.Sequential(torch.nn.Identity(), *module), loss, nonconvex_reg=reg)
    assert closed.linear is not None and auto.linear is None
    x = torch.randn(3, 5, 7)
    if loss == "cross-entropy":
        y = torch.randint(0, classes, (3, 5))
    elif loss == "logistic":
        y = torch.randint(0, 2, (3, 5)).float() * 2 - 1
    else:
        y = torch.randn(3, 5)
    flat = torch.randn(closed.d)
    losses_closed, losses_auto = torch.empty(3, 5), torch.empty(3, 5)
    fast = closed.batch_gradients(flat, x, y, losses=losses_closed)
    slow = auto.batch_gradients(flat, x, y, losses=losses_auto)
    assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-6)
    assert torch.equal(losses_closed, losses_auto)
    assert fast.abs().max() > 1e-2  # not trivially zero
    alone = closed.batch_gradients(flat, x[1:2], y[1:2])  # a client alone: the same bits
    assert torch.equal(alone[0], fast[1])
    # per-sample gradients, closed form against autograd's layer by layer
    per_fast = closed.per_sample_gradients(flat, x, y)
    assert torch.allclose(per_fast, auto.per_sample_gradients(flat, x, y), rtol=1e-5, atol=1e-6)
    assert torch.allclose(per_fast.mean(dim=1), fast, rtol=1e-5, atol=1e-6)
    assert torch.equal(closed.per_sample_gradients(flat, x[1:2], y[1:2])[0], per_fast[1])
    # the tape a gradient span is built from (inputs, output gradients), against autograd's
    tape = closed.linear.record(flat, x[0], y[0])
    reference = auto.tapes.record(auto.flat.params(flat), x[0], y[0])
    assert [layer.slices for layer, _, _ in tape] == [layer.slices for layer, _, _ in reference]
    for (_, a, delta), (_, a_auto, delta_auto) in zip(tape, reference, strict=True):
        assert torch.equal(a, a_auto)
        assert torch.allclose(delta, delta_auto, rtol=1e-5, atol=1e-6)


def test_random_feature_options_keep_the_default_model_and_offer_the_unstated_readings():
    """The paper states neither the random layer's distribution nor its activation:
    ``activation`` and ``init`` read them; the defaults are the model as it was."""
    default = _build("random-feature-mlp", hidden=256)
    spelled = _build("random-feature-mlp", hidden=256, activation="relu", init="default")
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(),
                                                  spelled.state_dict().values(), strict=True))
    assert isinstance(_build("random-feature-mlp", activation="tanh")[2], nn.Tanh)
    assert isinstance(_build("random-feature-mlp", activation="sigmoid")[2], nn.Sigmoid)
    normal = _build("random-feature-mlp", hidden=256, init="normal")[1]
    assert normal.weight.std().item() == pytest.approx(1.0, rel=0.02)
    assert normal.bias.std().item() == pytest.approx(1.0, rel=0.2)
    assert not normal.weight.requires_grad
    for options, allowed in (({"activation": "elu"}, "relu, tanh, sigmoid"),
                             ({"init": "xavier"}, "default, normal")):
        with pytest.raises(ConfigError, match=f"model-options.*allowed: {allowed}"):
            _build("random-feature-mlp", **options)
