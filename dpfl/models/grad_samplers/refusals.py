"""Layers refused when the model is built, each with its usual replacement (Opacus'
``ModuleValidator`` is the model): a layer whose output for one sample depends on the others'
(batch normalisation), whose gradient does (an embedding scaled by the batch's token counts),
whose forward pass changes its own parameters, or whose forward pass the generic rule could
not recompute (dropout inside a module it covers: the masks are drawn once)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from dpfl.errors import ConfigError

_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


@dataclass(frozen=True)
class Refusal:
    """Modules of ``types`` for which ``when`` holds are refused: ``why`` says what goes
    wrong, ``instead`` what to use."""

    types: tuple[type[nn.Module], ...]
    why: str
    instead: str
    when: Callable[[nn.Module], bool] = lambda module: True


REFUSALS: tuple[Refusal, ...] = (
    Refusal((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
             nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d),
            "normalises with the batch's statistics, so each sample's gradient depends on the "
            "others'", "GroupNorm (or LayerNorm, or InstanceNorm with affine=True)"),
    Refusal(_INSTANCE_NORMS, "tracks running statistics of the batch, which no noise covers",
            "track_running_stats=False",
            lambda m: bool(m.track_running_stats)),
    Refusal((nn.Embedding,), "scales its gradient by the batch's token counts",
            "scale_grad_by_freq=False", lambda m: bool(m.scale_grad_by_freq)),
    Refusal((nn.Embedding, nn.EmbeddingBag), "renormalises its rows in place in the forward "
            "pass", "max_norm=None", lambda m: m.max_norm is not None),
    Refusal((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer),
            "feeds its Linear and LayerNorm layers sequence-first inputs, whose rules read the "
            "samples on the first axis", "batch_first=True",
            lambda m: not m.self_attn.batch_first),
)

#: modules that draw random numbers in training mode, with what turns that off
_RANDOM: tuple[tuple[tuple[type[nn.Module], ...], Callable[[nn.Module], bool]], ...] = (
    ((nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
      nn.FeatureAlphaDropout), lambda m: m.p > 0),
    ((nn.MultiheadAttention,), lambda m: m.dropout > 0),
    ((nn.RNNBase,), lambda m: m.dropout > 0 and m.num_layers > 1),
)


def check(module: nn.Module) -> None:
    """``ConfigError`` (key ``model``) naming the first refused layer of ``module``."""
    for name, m in module.named_modules():
        for refusal in REFUSALS:
            if isinstance(m, refusal.types) and refusal.when(m):
                raise ConfigError("model", f"per-sample gradients: layer {name or '(the model)'!r}"
                                  f" ({type(m).__name__}) {refusal.why}; use "
                                  f"{refusal.instead} instead")


def check_recomputable(module: nn.Module, prefix: str) -> None:
    """``ConfigError`` where ``module`` (whose call the generic rule, or the recurrent rule,
    recomputes) draws random numbers: dropout in training mode."""
    for name, m in module.named_modules(prefix=prefix):
        if m.training and any(isinstance(m, t) and random(m) for t, random in _RANDOM):
            raise ConfigError("model", f"per-sample gradients: layer {name!r} "
                              f"({type(m).__name__}) draws dropout masks inside a layer whose "
                              "call is recomputed for its per-sample gradients, which cannot "
                              "draw the same masks; use dropout=0 there, or eval()")
