"""A torch module's trainable parameters as one flat vector: where each parameter and layer
sits in it, the module called at a flat point, and its losses there."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dpfl.errors import ConfigError
from dpfl.models.grad_samplers import refusals, rule_for
from dpfl.models.losses import LOSSES, Loss
from dpfl.models.rows import Layer, aligned


class FlatParameters:
    """The trainable parameters of ``module`` (copied, never modified) in
    ``named_parameters()`` order, concatenated: a point is ``[d]``, or ``[C, d]`` per client.
    ``loss`` (a name in ``LOSSES``, or a :class:`~dpfl.models.losses.Loss`) and the nonconvex
    regulariser ``nonconvex_reg`` make the per-sample loss (:mod:`dpfl.models.functional`)."""

    def __init__(self, module: nn.Module, loss: str | Loss, nonconvex_reg: float = 0.0) -> None:
        self.loss = loss if isinstance(loss, Loss) else LOSSES.get(loss)
        self.nonconvex_reg = float(nonconvex_reg)
        self.template = copy.deepcopy(module)
        self.module = copy.deepcopy(module)

        # Trainable parameters in named_parameters() order, as (owner module, attribute name).
        self.slots: list[tuple[nn.Module, str]] = []
        self.shapes: list[torch.Size] = []
        self.numels: list[int] = []
        where: dict[str, slice] = {}
        owners = dict(self.module.named_modules())
        for name, p in self.module.named_parameters():
            if p.requires_grad:
                where[name] = slice(sum(self.numels), sum(self.numels) + p.numel())
                prefix, _, attr = name.rpartition(".")
                self.slots.append((owners[prefix], attr))
                self.shapes.append(p.shape)
                self.numels.append(p.numel())
        self.d = sum(self.numels)

        refusals.check(self.module)
        self.layers: list[Layer] = list(layers_of(self.module, "", where))

    def initial_params(self) -> Tensor:
        """The module's initial trainable parameters, flattened: ``[d]`` float32."""
        trainable = [p for p in self.template.parameters() if p.requires_grad]
        return torch.cat([p.detach().reshape(-1) for p in trainable]).to(torch.float32)

    def load_into(self, flat: Tensor) -> nn.Module:
        """A copy of the module holding ``flat`` (``[d]``) as its trainable parameters."""
        module = copy.deepcopy(self.template)
        trainable = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, v in zip(trainable, flat.detach().split(self.numels)):
                p.copy_(v.view_as(p))
        return module

    def point(self, flat: Tensor, c: int) -> Tensor:
        """Client ``c``'s point of ``flat`` (``[d]``: everyone's), on aligned memory."""
        return aligned(flat if flat.dim() == 1 else flat[c])

    def params(self, point: Tensor) -> list[Tensor]:
        """The trainable parameters as views of ``point``, in their shapes."""
        return [v.view(shape) for v, shape in zip(point.split(self.numels), self.shapes)]

    def forward(self, point: Tensor, x: Tensor) -> Tensor:
        """The private module's output with its trainable parameters replaced by views of
        ``point`` (a cheaper ``torch.func.functional_call``; the originals are put back)."""
        return self.forward_with(self.params(point), x)

    def forward_with(self, params: list[Tensor], x: Tensor) -> Tensor:
        """The private module's output with its trainable parameters replaced by ``params``."""
        originals = [module._parameters[attr] for module, attr in self.slots]
        try:
            for (module, attr), param in zip(self.slots, params):
                module._parameters[attr] = param  # type: ignore[assignment]
            return self.module(x)
        finally:
            for (module, attr), original in zip(self.slots, originals):
                module._parameters[attr] = original

    def point_losses(self, point: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """Per-sample losses at ``point``, regulariser included."""
        losses = self.loss.per_sample(self.forward(point, x), y)
        return losses + self.reg_value(point) if self.nonconvex_reg else losses

    def reg_value(self, point: Tensor) -> Tensor:
        sq = point.square()
        return 0.5 * self.nonconvex_reg * (sq / (1 + sq)).sum()

    def reg_grad(self, point: Tensor) -> Tensor:
        return self.nonconvex_reg * point / (1 + point.square()).square()

    def linear_blocks(self) -> list[LinearBlock] | None:
        """The blocks of a linear model, which :class:`~dpfl.models.linear.ClosedFormLinear`
        differentiates by hand when the loss has a closed-form output gradient: a ``Linear``
        or ``Sequential(Flatten, Linear)`` is one block; a module may declare its own
        (``linear_blocks()``, e.g. an audit's canary model: the model and one more scalar);
        else None."""
        declared = getattr(self.module, "linear_blocks", None)
        if callable(declared):
            return declared()
        layer = linear_of(self.module)
        return None if layer is None else [LinearBlock(layer)]


@dataclass(frozen=True)
class LinearBlock:
    """A ``Linear`` layer on the columns ``inputs`` of the flattened input (None: every
    column). A model of blocks outputs their outputs side by side, in block order, and its
    trainable parameters are the blocks', in the same order."""

    layer: nn.Linear
    inputs: slice | None = None


def linear_of(module: nn.Module) -> nn.Linear | None:
    """The ``Linear`` layer of a linear module (``Linear`` or ``Sequential(Flatten, Linear)``,
    every parameter trainable), else None."""
    layers = list(module) if isinstance(module, nn.Sequential) else [module]
    if (isinstance(layers[-1], nn.Linear) and all(type(m) is nn.Flatten for m in layers[:-1])
            and layers[-1].weight.requires_grad
            and (layers[-1].bias is None or layers[-1].bias.requires_grad)):
        return layers[-1]
    return None


def layers_of(module: nn.Module, prefix: str, where: dict[str, slice]) -> Iterator[Layer]:
    """The layers of ``module`` (named ``prefix``) with trainable parameters, in
    ``named_modules()`` order: a module whose type has a rule covers its own parameters (its
    sub-modules are layers of their own); any other module with trainable parameters of its own
    is covered whole by the generic rule, its sub-modules' parameters included (it may use them
    without calling them: ``MultiheadAttention``'s ``out_proj``); a module with none is looked
    into. ``where``: each trainable parameter's flat positions, by full name (a parameter
    listed under a second name, tied, is refused: its gradient would be split)."""
    rule = rule_for(module)
    if any(p.requires_grad for p in module.parameters(recurse=False)):
        names = [n for n, p in module.named_parameters(recurse=rule.whole) if p.requires_grad]
        full = [f"{prefix}.{n}" if prefix else n for n in names]
        for name in full:
            if name not in where:
                raise ConfigError("model", f"per-sample gradients: parameter {name!r} is tied "
                                  "to another (shared by two layers); untie it")
        if rule.whole:
            refusals.check_recomputable(module, prefix)
        yield Layer(module=module, rule=rule, names=tuple(names),
                    slices=tuple(where[f] for f in full),
                    shapes=tuple(module.get_parameter(n).shape for n in names))
        if rule.whole:
            return
    for name, child in module.named_children():
        yield from layers_of(child, f"{prefix}.{name}" if prefix else name, where)
