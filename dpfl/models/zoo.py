"""The models of the four papers, by the name a run config gives them, and a user's own model by
reference (``model="package.module:callable"``, :mod:`dpfl.reference`).

``build_model(name, input_shape=, num_classes=, seed=)`` draws the initial weights from ``seed``
alone (the global RNG is left as it was), so every client and every runtime starts from the same
point. No model has BatchNorm: it mixes samples, which per-sample clipping and the DP analyses
exclude.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import nn

from dpfl.config import format_options
from dpfl.errors import ConfigError
from dpfl.models.resnet import ResNet20
from dpfl.reference import accepted, first_line, is_reference, resolve
from dpfl.registry import Registry

ModelBuilder = Callable[..., nn.Module]
MODELS: Registry[ModelBuilder] = Registry("model")
#: what a referenced builder is given, where its signature takes it
GIVEN = ("input_shape", "num_classes")
MAX_SIZE = 2**20  # the largest width (or group count) an option may ask for


def build_model(
    name: str, *, input_shape: tuple[int, ...], num_classes: int, seed: int,
    input_dtype: torch.dtype = torch.float32, **options: object
) -> nn.Module:
    """Build model ``name`` (a registered name, or a reference: :func:`builder_of`) for inputs
    of ``input_shape`` (no batch axis) and ``input_dtype``, with weights drawn from ``seed``.

    ``options`` go to the model's builder (e.g. ``hidden=`` for ``random-feature-mlp``).
    Raises ``ConfigError`` for an unknown name or a bad reference (key ``model``), a size option
    out of range (``model-options``, :func:`check_options`), and a model that cannot be built
    with the options or does not take the inputs (one zero record is run through it).
    """
    builder = builder_of(name)
    check_options(options)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return _checked(builder, tuple(input_shape), num_classes, input_dtype, **options)
    except ConfigError:  # an option the builder refuses names itself
        raise
    except Exception as exc:
        if is_reference(name):  # the user's code: whatever it raised, on one line
            given = f" with {format_options(options)}" if options else ""
            raise ConfigError("model", f"{name!r}{given} failed on inputs of shape "
                              f"{tuple(input_shape)} ({input_dtype}): {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
        if not isinstance(exc, RuntimeError | ValueError):
            raise
        # a size torch refuses, a shape mismatch
        problem = f"does not take inputs of shape {tuple(input_shape)}: {exc}".splitlines()[0]
        if options:
            raise ConfigError("model-options", f"model {name!r} with {format_options(options)} "
                              f"{problem}") from None
        raise ConfigError("model", f"{name!r} {problem}",
                          allowed=[m for m in MODELS if m != name
                                   and _takes(m, tuple(input_shape), num_classes, input_dtype)]
                          ) from None


def builder_of(name: str) -> ModelBuilder:
    """The builder of model ``name``: a registered one, or the user's callable a reference
    names, called with ``input_shape`` and ``num_classes`` as keywords where its signature
    takes them, and the model options as further keywords."""
    if not is_reference(name):
        return MODELS.get(name)
    function = resolve("model", name)

    def build(input_shape: tuple[int, ...], num_classes: int, **options: object) -> nn.Module:
        given = accepted(function, dict(zip(GIVEN, (input_shape, num_classes), strict=True)))
        return function(**given, **options)

    return build


def _checked(builder: ModelBuilder, input_shape: tuple[int, ...], num_classes: int,
             input_dtype: torch.dtype = torch.float32, **options: object) -> nn.Module:
    """``builder``'s model, after one zero record of ``input_dtype`` went through it in eval
    mode (a layer that mixes samples is then refused by its name, not by its batch of one);
    ``TypeError`` for a builder that returns no ``nn.Module``, ``ValueError`` for a model with
    an empty layer (inputs too small for its convolutions)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")
        model = builder(input_shape, num_classes, **options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"returned a {type(model).__name__}, not a torch.nn.Module")
    if any(p.numel() == 0 for p in model.parameters()):
        raise ValueError("a layer of the model is empty")
    modes = {module: module.training for module in model.modules()}
    with torch.no_grad():
        model.eval()(torch.zeros(1, *input_shape, dtype=input_dtype))
    for module, training in modes.items():
        module.training = training
    return model


def check_options(options: Mapping[str, object]) -> None:
    """Refuse a size (an ``int`` option: a width, a group count) outside ``1..``:data:`MAX_SIZE`
    (``ConfigError``, key ``model-options``); the options' names and kinds are the run
    config's to check (:func:`dpfl.problem.options`)."""
    for key, value in options.items():
        if type(value) is int and not 1 <= value <= MAX_SIZE:
            raise ConfigError("model-options", f"{key} must be a size in 1..{MAX_SIZE}, got "
                              f"{value}", allowed=f"1..{MAX_SIZE}")


def _takes(name: str, input_shape: tuple[int, ...], num_classes: int,
           input_dtype: torch.dtype) -> bool:
    """Whether model ``name``, at its default options, takes inputs of ``input_shape`` and
    ``input_dtype``."""
    try:
        _checked(MODELS.get(name), input_shape, num_classes, input_dtype)
    except (RuntimeError, ValueError):
        return False
    return True


def _features(input_shape: tuple[int, ...]) -> int:
    return math.prod(input_shape)


@MODELS.register("logistic")
def logistic(
    input_shape: tuple[int, ...], num_classes: int, *, bias: bool = True, zero_init: bool = False
) -> nn.Module:
    """Linear model on the flattened input: multinomial logistic regression with
    ``cross-entropy``, or with ``num_classes=1`` the ±1-label model of Clip21 E1 paired with the
    ``logistic`` loss (the Clip21 paper's logistic regression uses ``bias=False,
    zero_init=True``: x⁰ = 0)."""
    linear = nn.Linear(_features(input_shape), num_classes, bias=bias)
    if zero_init:
        nn.init.zeros_(linear.weight)
        if bias:
            nn.init.zeros_(linear.bias)
    return nn.Sequential(nn.Flatten(), linear)


@MODELS.register("least-squares")
def least_squares(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """f(x; a) = aᵀx, no bias, x⁰ = 0 (PriSMA eq. 22 with the ``squared`` loss)."""
    linear = nn.Linear(_features(input_shape), 1, bias=False)
    nn.init.zeros_(linear.weight)
    return nn.Sequential(nn.Flatten(), linear)


@MODELS.register("mlp")
def mlp(input_shape: tuple[int, ...], num_classes: int, *, hidden: int = 256) -> nn.Module:
    """Flatten → Linear(in, 256) → tanh → Linear(256, classes): Clip21 E3's 784-256-10 MLP."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(_features(input_shape), hidden),
        nn.Tanh(),
        nn.Linear(hidden, num_classes),
    )


@MODELS.register("clip21-cnn")
def clip21_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The Clip21 paper's MNIST CNN (App. I.2.2; its head is not printed, ours is a linear layer):
    Conv(1→16, k5) → tanh → Conv(16→16, k5) → tanh → MaxPool(2) → Linear.

    For 1×28×28 inputs the head is Linear(16·10·10 = 1600 → classes); d = 22,842 for 10 classes.
    """
    channels, height, width = input_shape
    flat = 16 * ((height - 8) // 2) * ((width - 8) // 2)
    return nn.Sequential(
        nn.Conv2d(channels, 16, 5),
        nn.Tanh(),
        nn.Conv2d(16, 16, 5),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, num_classes),
    )


@MODELS.register("dpftrl-cnn")
def dpftrl_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """PriSMA's CIFAR-10 model (its Table 1): the DP-FTRL ``vgg128`` tanh CNN; d = 550,570 for
    3×32×32 and 10 classes.

    Init as the DP-FTRL code: conv weights N(0, 1/fan_in), linear weights Xavier-normal, zero
    biases.
    """
    channels, height, width = input_shape
    layers: list[nn.Module] = []
    for c_in, c_out in ((channels, 32), (32, 64), (64, 128)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.Tanh()]
        layers += [nn.Conv2d(c_out, c_out, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2)]
    layers += [
        nn.Flatten(),
        nn.Linear(128 * (height // 8) * (width // 8), 128),
        nn.Tanh(),
        nn.Linear(128, num_classes),
    ]
    model = nn.Sequential(*layers)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.normal_(m.weight, std=1.0 / math.sqrt(m.weight[0].numel()))
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.xavier_normal_(m.weight)
            nn.init.zeros_(m.bias)
    return model


@MODELS.register("pcdp-cnn")
def pcdp_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """PCDP-SGD's MNIST/Fashion-MNIST "CNN" (the tanh CNN of Papernot et al. that PDP-SGD also
    trains; the layers as in the first author's public code): Conv(1→16, k8, s2, p2) → tanh →
    MaxPool(2, s1) → Conv(16→32, k4, s2) → tanh → MaxPool(2, s1) → Linear(512→32) → tanh →
    Linear(32→classes); d = 26,010 for 1×28×28 and 10 classes."""
    channels, height, _ = input_shape
    side = ((height + 4 - 8) // 2 + 1 - 1 - 4) // 2 + 1 - 1
    return nn.Sequential(
        nn.Conv2d(channels, 16, 8, stride=2, padding=2), nn.Tanh(), nn.MaxPool2d(2, stride=1),
        nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, stride=1),
        nn.Flatten(), nn.Linear(32 * side * side, 32), nn.Tanh(), nn.Linear(32, num_classes),
    )


@MODELS.register("pcdp-lenet")
def pcdp_lenet(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """PCDP-SGD's CIFAR-10 "LeNet" (first author's public code): Conv(3→64, k5) → tanh →
    MaxPool(2) → Conv(64→64, k5) → tanh → MaxPool(2) → Linear(1600→384) → tanh →
    Linear(384→192) → tanh → Linear(192→classes); d = 797,962 for 3×32×32 and 10 classes."""
    channels, height, _ = input_shape
    side = ((height - 4) // 2 - 4) // 2
    return nn.Sequential(
        nn.Conv2d(channels, 64, 5), nn.Tanh(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 5), nn.Tanh(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * side * side, 384), nn.Tanh(),
        nn.Linear(384, 192), nn.Tanh(), nn.Linear(192, num_classes),
    )


ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
FEATURE_INITS = ("default", "normal")


@MODELS.register("random-feature-mlp")
def random_feature_mlp(
    input_shape: tuple[int, ...], num_classes: int, *, hidden: int = 512, zero_head: bool = False,
    activation: str = "relu", init: str = "default",
) -> nn.Module:
    """AdaptDP-FedAvg's MNIST/Fashion-MNIST/Bank model (Fukami et al., §5): a frozen random
    ``Linear(in, hidden)`` (``requires_grad=False``, so it is not among the trainable parameters
    but is in the ``state_dict``), an ``activation`` (``relu``, ``tanh``, ``sigmoid``), and a
    trainable ``Linear(hidden, classes)`` head. The loss is convex in the head. The paper states
    neither the random layer's distribution nor the activation: ``init="default"`` is PyTorch's
    (weights and bias uniform in ±1/√in), ``"normal"`` draws both from N(0, 1)."""
    if activation not in ACTIVATIONS:
        raise ConfigError("model-options", f"activation {activation!r} is not offered",
                          allowed=list(ACTIVATIONS))
    if init not in FEATURE_INITS:
        raise ConfigError("model-options", f"init {init!r} is not offered",
                          allowed=list(FEATURE_INITS))
    features = nn.Linear(_features(input_shape), hidden)
    if init == "normal":
        nn.init.normal_(features.weight)
        nn.init.normal_(features.bias)
    features.requires_grad_(False)
    head = nn.Linear(hidden, num_classes)
    if zero_head:
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
    return nn.Sequential(nn.Flatten(), features, ACTIVATIONS[activation](), head)


@MODELS.register("resnet20")
def resnet20(input_shape: tuple[int, ...], num_classes: int, *, norm_groups: int = 2) -> nn.Module:
    """CIFAR ResNet-20 with GroupNorm (the Clip21 paper's CIFAR-10 runs); see
    ``dpfl.models.resnet``."""
    return ResNet20(input_shape[0], num_classes, norm_groups=norm_groups)
