"""Per-sample gradient rules, one module per family of layers, held in one registry
(:mod:`~dpfl.models.grad_samplers.registry`); any other module with trainable parameters gets
the generic rule (:mod:`~dpfl.models.grad_samplers.fallback`), and the layers no rule can serve
are refused (:mod:`~dpfl.models.grad_samplers.refusals`). Importing this package registers
every rule."""

from torch import nn

from dpfl.models.grad_samplers import conv, embedding, linear, norm  # noqa: F401 - registers
from dpfl.models.grad_samplers.fallback import FALLBACK
from dpfl.models.grad_samplers.registry import RULES, Rule


def rule_for(module: nn.Module) -> Rule:
    """The rule of ``module``'s exact type where it covers the module's configuration, else the
    generic rule."""
    rule = RULES.get(type(module))
    return rule if rule is not None and rule.applies(module) else FALLBACK


__all__ = ["FALLBACK", "RULES", "Rule", "rule_for"]
