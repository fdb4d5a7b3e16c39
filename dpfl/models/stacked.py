"""Clients at points of their own in one pass: the joint tapes of :mod:`dpfl.models.tape` for a
cohort's iterates (a local step after the first), where the model is a ``Sequential`` of
``Linear`` layers and modules that treat each sample alone. Each ``Linear`` layer is one batched
GEMM (``baddbmm``) over the clients' weights, viewed in place as ``[G, out, in]`` from their
rows of one tensor; each sample-wise module is one call over all the samples. Whether that gives
the numbers each client's own pass gives is checked per layout by
:meth:`~dpfl.models.tape.TapeEngine.same_jointly`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dpfl.models.flat import FlatParameters
from dpfl.models.rows import Layer

#: a member of a sequential model: (module, its Layer or None, the positions of its weight and
#: bias among the parameters)
Member = tuple[nn.Module, Layer | None, int | None, int | None]
#: parameter-free modules that treat each sample alone, applied to all the clients' samples in
#: one call
SAMPLEWISE = (nn.Tanh, nn.ReLU, nn.Sigmoid, nn.Identity)


def views(lists: list[list[Tensor]]) -> list[Tensor] | None:
    """Each parameter of G clients' ``lists`` (views of their points) as one ``[G, *shape]``
    view, without a copy, where the points are rows of one tensor at a constant positive
    stride (a cohort's iterates, :func:`~dpfl.models.rows.aligned_rows`); else None."""
    first = lists[0]
    size = first[0].element_size()
    step = lists[1][0].data_ptr() - first[0].data_ptr()
    if step <= 0 or step % size:
        return None
    storage = first[0].untyped_storage().data_ptr()
    for i, params in enumerate(lists):
        for p, p0 in zip(params, first, strict=True):
            if (p.untyped_storage().data_ptr() != storage
                    or p.data_ptr() - p0.data_ptr() != i * step or p.stride() != p0.stride()):
                return None
    return [p.as_strided((len(lists), *p.shape), (step // size, *p.stride())) for p in first]


def sequence(flat: FlatParameters) -> list[Member] | None:
    """``flat``'s module as (module, its Layer or None, the positions of its weight and bias in
    the parameter list) per member, where it is a ``Sequential`` of ``Linear`` layers whose
    parameters are all trainable or all frozen (a random-feature layer), ``Flatten(1, -1)`` and
    :data:`SAMPLEWISE` modules; else None."""
    module = flat.module
    if not isinstance(module, nn.Sequential):
        return None
    layers = {id(layer.module): layer for layer in flat.layers}
    where = {(id(owner), attr): i for i, (owner, attr) in enumerate(flat.slots)}
    members: list[Member] = []
    for m in module:
        if type(m) is nn.Linear and id(m) in layers:
            layer = layers[id(m)]
            if layer.trainable != (True, m.bias is not None):
                return None
            members.append((m, layer, where[id(m), "weight"],
                            where[id(m), "bias"] if m.bias is not None else None))
        elif (type(m) is nn.Flatten and (m.start_dim, m.end_dim) == (1, -1)) \
                or type(m) in SAMPLEWISE or (type(m) is nn.Linear and id(m) not in layers):
            members.append((m, None, None, None))  # a frozen Linear: fixed, sample by sample
        else:
            return None
    return members


def forward(flat: FlatParameters, members: list[Member], params: list[Tensor], x: Tensor,
            y: Tensor) -> tuple[list[tuple[Layer, Tensor, Tensor]], Tensor]:
    """One forward pass of G clients at points of their own, each with ``len(x) / G``
    consecutive samples of ``x``: ``params`` holds each parameter of every client as one
    ``[G, *shape]`` tensor (:func:`views`), ``members`` the model (:func:`sequence`). Returns
    (layer, its input, its output) per trainable layer and the per-sample losses, with the
    graph from the outputs to the losses."""
    clients = len(params[0])
    h, tape = x, []
    with torch.enable_grad():
        for module, layer, weight, bias in members:
            if layer is None:
                h = module(h)
                continue
            a = h.reshape(clients, -1, h.shape[-1])
            assert weight is not None
            w = params[weight].transpose(1, 2)
            out = torch.bmm(a, w) if bias is None else torch.baddbmm(
                params[bias].unsqueeze(1), a, w)
            if not out.requires_grad:  # nothing below this layer is trainable
                out = out.detach().requires_grad_()
            h = out.view(-1, out.shape[-1])
            tape.append((layer, a.detach().view(h.shape[0], -1), h))
        return tape, flat.loss.per_sample(h, y)
