"""The generic rule, for any module with trainable parameters that no rule of its own covers
(``MultiheadAttention`` with ``add_bias_kv`` or ``add_zero_attn``, an ``LSTM`` with
projections, a user's module): sample j's gradient is the
vector–Jacobian product of the module's call on sample j alone (a batch of one) with its output
gradients as the cotangent, ``∂⟨f(θ; x_j), g_j⟩/∂θ``, vectorised over the samples —
``torch.func.vmap`` of ``torch.func.vjp`` of ``torch.func.functional_call`` (Opacus' functorch
fallback; Goodfellow 2015's observation that g_j alone carries sample j's share of the loss).

The tape keeps the whole call (:class:`~dpfl.models.calls.Batched`): every argument, the
parameters in use, and the gradient of every floating-point output, so a module with several
outputs (a recurrent layer's ``(output, h_n)``) gets the gradient of whichever of them the rest
of the model uses. Which axis of each argument and output holds the samples is the module's
*layout* (:data:`LAYOUTS`, by type; others: :func:`samples_first`). The call is recomputed, so
it must be deterministic: dropout inside such a module is refused when the model is built
(:mod:`dpfl.models.grad_samplers.refusals`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from dpfl.models.calls import Batched, Dims, Outputs, flatten, floats
from dpfl.models.grad_samplers.registry import Rule, register

if TYPE_CHECKING:
    from dpfl.models.rows import Layer

#: (module, args, kwargs, output, samples n) → the batch axis of every leaf of (args, kwargs)
#: and of the output (None: shared by every sample); ``ValueError`` for a call it cannot split
Layout = Callable[[nn.Module, tuple, dict, Any, int], tuple[Dims, Dims]]


def _like(tree: Any, dim: int | None) -> Dims:
    """A tree of ``tree``'s shape holding ``dim`` at every leaf."""
    leaves, rebuild = flatten(tree)
    return rebuild([dim] * len(leaves))


def samples_first(module: nn.Module, args: tuple, kwargs: dict, output: Any, n: int
                  ) -> tuple[Dims, Dims]:
    """The default layout: an argument holds the samples on its first axis where that axis
    has the batch's n entries (else it is shared), every output on its first axis."""

    def axis(leaf: Any) -> int | None:
        return 0 if isinstance(leaf, Tensor) and leaf.dim() and len(leaf) == n else None

    leaves, rebuild = flatten((args, kwargs))
    return rebuild([axis(leaf) for leaf in leaves]), 0


def recurrent(module: nn.Module, args: tuple, kwargs: dict, output: Any, n: int
              ) -> tuple[Dims, Dims]:
    """``RNN``/``LSTM``/``GRU``: the sequence on axis 0 with ``batch_first``, else 1; the
    states ``h`` (and ``c``), given or returned, on axis 1."""
    assert isinstance(module, nn.RNNBase)
    if isinstance(args[0], PackedSequence):
        raise ValueError(f"per-sample gradients: {type(module).__name__} on a PackedSequence "
                         "(pad the sequences instead)")
    seq = 0 if module.batch_first else 1
    states = {k: _like(v, 1) for k, v in kwargs.items()}
    return ((seq, *(_like(h, 1) for h in args[1:])), states), (seq, _like(output[1], 1))


_ATTENTION = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def attention(module: nn.Module, args: tuple, kwargs: dict, output: Any, n: int
              ) -> tuple[Dims, Dims]:
    """``MultiheadAttention``: query, key and value on axis 0 with ``batch_first``, else 1;
    ``key_padding_mask`` on axis 0; a 2-D ``attn_mask`` shared (a 3-D one, per sample and head,
    is refused); the weights returned on axis 0."""
    assert isinstance(module, nn.MultiheadAttention)
    seq = 0 if module.batch_first else 1
    axes = {"query": seq, "key": seq, "value": seq, "key_padding_mask": 0}
    mask = kwargs.get("attn_mask", args[5] if len(args) > 5 else None)
    if isinstance(mask, Tensor) and mask.dim() != 2:
        raise ValueError("per-sample gradients: MultiheadAttention with a 3-D attn_mask "
                         "(one per sample and head); pass a 2-D mask and key_padding_mask")
    by_position = tuple(axes.get(name) for name in _ATTENTION[:len(args)])
    return (by_position, {k: axes.get(k) for k in kwargs}), (seq, 0)


#: layouts by type, looked up along the MRO
LAYOUTS: dict[type[nn.Module], Layout] = {
    nn.RNNBase: recurrent,
    nn.MultiheadAttention: attention,
}


def layout_of(module: nn.Module) -> Layout:
    return next((LAYOUTS[t] for t in type(module).__mro__ if t in LAYOUTS), samples_first)


def record(layer: Layer, args: tuple, kwargs: dict, output: Any, n: int
           ) -> tuple[Batched, Any, Outputs]:
    """What the tape keeps of a call on ``n`` samples: the call (the trainable parameters in
    use, shared; the arguments), the output to hand on (every floating-point leaf tracked, so
    that its gradient is found), and those tracked outputs with their batch axes."""
    module = layer.module
    what = type(module).__name__
    in_dims, out_dims = layout_of(module)(module, args, kwargs, output, n)
    in_use = dict(module.named_parameters())
    params = tuple(in_use[name] for name in layer.names)
    call = Batched.of((params, args, kwargs), ((None,) * len(params), *in_dims), n, what)
    leaves, rebuild = flatten(output)
    axes = flatten(out_dims)[0] if isinstance(out_dims, (tuple, list, dict)) \
        else [out_dims] * len(leaves)
    tracked, dims = [], []
    for i, (leaf, dim) in enumerate(zip(leaves, axes, strict=True)):
        if isinstance(leaf, Tensor) and torch.is_floating_point(leaf):
            if not leaf.requires_grad:  # nothing before this layer is trainable
                leaves[i] = leaf = leaf.detach().requires_grad_()
            tracked.append(leaf)
            dims.append(dim)
    return call, rebuild(leaves), Outputs(tuple(tracked), tuple(dims), n, what)


def per_sample(layer: Layer, call: Batched, grads: Batched) -> list[Tensor]:
    """One ``[n, numel]`` per trainable parameter: vmap over the samples of the vjp of the
    call on one sample with its output gradients (:func:`sample_vjp`)."""
    per_param = torch.func.vmap(sample_vjp(layer, call, grads))(call.batched, grads.batched)
    return [p.reshape(len(p), -1) for p in per_param]


@register(nn.RNN, nn.LSTM, nn.GRU, whole=True)
def per_sample_looped(layer: Layer, call: Batched, grads: Batched) -> list[Tensor]:
    """:func:`per_sample` one sample at a time: the fused recurrent kernels (``RNN``,
    ``LSTM``, ``GRU``) have no batching rule for ``vmap``."""
    one = sample_vjp(layer, call, grads)
    rows = [one([t[j] for t in call.batched], [t[j] for t in grads.batched])
            for j in range(grads.batched[0].shape[0])]
    return [torch.stack(p).reshape(len(rows), -1) for p in zip(*rows)]


def sample_vjp(layer: Layer, call: Batched, grads: Batched
               ) -> Callable[[list[Tensor], list[Tensor]], tuple[Tensor, ...]]:
    """The function of one sample's entries of the call's and the output gradients' batched
    leaves that gives its gradients of the layer's trainable parameters: the vjp of the call
    on that sample alone (a batch of one) with its output gradients as the cotangent."""
    module, names = layer.module, layer.names

    def one(inputs: list[Tensor], cotangents: list[Tensor]) -> tuple[Tensor, ...]:
        params, args, kwargs = call.one_sample(inputs)

        def outputs(*trainable: Tensor) -> tuple[Tensor, ...]:
            out = torch.func.functional_call(module, dict(zip(names, trainable)), args, kwargs)
            return tuple(floats(out))

        _, pull = torch.func.vjp(outputs, *params)
        return pull(tuple(grads.one_sample(cotangents)))

    return one


FALLBACK = Rule(per_sample, whole=True)
