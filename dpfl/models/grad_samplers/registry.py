"""The registry of per-sample gradient rules, by layer type (Opacus' ``register_grad_sampler``
is the model): a rule turns a layer's input ``a`` and output gradient ``g`` into its trainable
parameters' per-sample gradients; a layer type without a rule, or whose configuration its rule
does not cover, gets the generic rule (:mod:`dpfl.models.grad_samplers.fallback`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

if TYPE_CHECKING:
    from dpfl.models.rows import Layer

#: (layer, its input a, its output gradient g) → one ``[n, numel]`` per trainable parameter, in
#: the layer's ``names`` order
PerSample = Callable[["Layer", Any, Any], list[Tensor]]


def _always(module: nn.Module) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """How one kind of layer's per-sample gradients are formed.

    ``per_sample``: the gradients from the tape's (a, g). ``applies``: whether the rule covers
    a module's configuration (else the generic rule takes it). ``whole``: the tape keeps the
    whole call (every argument, the parameters in use, every output's gradient:
    :class:`~dpfl.models.calls.Batched`) and the rule covers the module's parameters with its
    sub-modules'; else the tape keeps the first argument and the output's gradient, and the
    rule covers the module's own parameters."""

    per_sample: PerSample
    applies: Callable[[nn.Module], bool] = _always
    whole: bool = False


#: the rules by exact layer type (a subclass may change ``forward``: it gets the generic rule)
RULES: dict[type[nn.Module], Rule] = {}


def register(*types: type[nn.Module], applies: Callable[[nn.Module], bool] = _always,
             whole: bool = False) -> Callable[[PerSample], PerSample]:
    """Decorator: ``per_sample`` is the rule of ``types`` (where ``applies``; ``whole``:
    :class:`Rule`)."""

    def add(per_sample: PerSample) -> PerSample:
        for t in types:
            RULES[t] = Rule(per_sample, applies, whole)
        return per_sample

    return add
