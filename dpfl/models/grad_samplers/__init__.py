"""Per-sample gradient rules, one module per family of layers, held in one registry
(:mod:`~dpfl.models.grad_samplers.registry`); any other module with trainable parameters gets
the generic rule (:mod:`~dpfl.models.grad_samplers.fallback`), and the layers no rule can serve
are refused (:mod:`~dpfl.models.grad_samplers.refusals`). Importing this package registers
every rule."""

from torch import nn

from dpfl.models.grad_samplers import conv, embedding, linear, norm  # noqa: F401 - registers
from dpfl.models.grad_samplers import recurrent  # noqa: F401 - registers (after fallback's)
from dpfl.models.grad_samplers import attention  # noqa: F401 - registers
from dpfl.models.grad_samplers.fallback import FALLBACK
from dpfl.models.grad_samplers.registry import RULES, Rule

#: the generic rule of a type whose own rule does not cover a module's configuration, where it
#: is not :data:`FALLBACK`: the recurrent layers' fused kernels have no batching rule for
#: ``vmap``, so theirs runs one sample at a time (an ``LSTM`` with ``proj_size > 0``)
GENERIC: dict[type[nn.Module], Rule] = dict.fromkeys((nn.RNN, nn.LSTM, nn.GRU),
                                                     recurrent.UNCOVERED)


def rule_for(module: nn.Module) -> Rule:
    """The rule of ``module``'s exact type where it covers the module's configuration, else the
    generic rule."""
    rule = RULES.get(type(module))
    if rule is not None and rule.applies(module):
        return rule
    return GENERIC.get(type(module), FALLBACK)


__all__ = ["FALLBACK", "GENERIC", "RULES", "Rule", "rule_for"]
