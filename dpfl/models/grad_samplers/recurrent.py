"""``RNN`` (tanh and relu), ``LSTM`` and ``GRU``: each layer of the module, unrolled over time,
is two ``Linear`` layers applied at every step, and its per-sample gradients are the ``Linear``
rule over sequences (:func:`~dpfl.models.grad_samplers.linear.rows`).

The math. At step t a layer (one direction of it) computes its gates' pre-activations

    z_t = (W_ih x_t + b_ih) + (W_hh h_{t-1} + b_hh)

(``h_{t-1}``: its state one step earlier in its own order, the initial state at the first
step; x_t: the module's input, or the layer below's outputs, both directions side by side),
then the gates and the new state from them (Elman: h_t = tanh or relu(z_t); LSTM: the i, f, g,
o gates, c_t = f ⊙ c_{t-1} + i ⊙ g, h_t = o ⊙ tanh(c_t); GRU below). With δ_t = ∂ℓ_j/∂z_t
sample j's gradient at that pre-activation (autograd's δ of backpropagation through time), the
parameters enter only through z, so

    ∂ℓ_j/∂W_ih = Σ_t δ_t x_tᵀ,   ∂ℓ_j/∂b_ih = Σ_t δ_t,
    ∂ℓ_j/∂W_hh = Σ_t δ_t h_{t-1}ᵀ,   ∂ℓ_j/∂b_hh = Σ_t δ_t

(Goodfellow 2015's observation that sample j's gradient needs its own inputs and output
gradients only, applied at every step). The GRU's candidate gate is
``n_t = tanh(W_in x_t + b_in + r_t ⊙ (W_hn h_{t-1} + b_hn))``: its input part gets δ^n_t and
its hidden part (W_hn, b_hn) gets ``r_t ⊙ δ^n_t``; the r and z gates are as above.

How δ is found. The tape keeps the whole call (input, initial state: samples first) and the
gradients of the module's outputs (``output``, ``h_n``, and the LSTM's ``c_n``). The rule runs
each layer again with the module's own fused kernel (``torch.lstm``, ``torch.gru``,
``torch.rnn_tanh``, ``torch.rnn_relu``, one layer at a time, at the parameters in use) for its
states h_t; forms every step's gates at once from them (z_t needs only x_t and h_{t-1}: two
GEMMs over all steps, as torch's CPU kernel computes the input parts; the LSTM's cell states
take one fused multiply–add a step); and backpropagates through time by hand, from the last
step to the first, a small GEMM (δ_t W_hh) and two to four elementwise products a step, the
gradient reaching a lower layer being the layer above's δ W_ih (one GEMM over all steps). This
is the δ one ``torch.autograd.grad`` call through an unrolled recomputation gives, with the
tape's output gradients as cotangents; written out, it costs about half as much (autograd
records and replays some 30 small operations a step: on examples/shakespeare's ``char_rnn``,
64 hidden units, 80 steps, batch 16, one CPU core, the LSTM's rule takes 4.7 ms against
9.4 ms, the GRU's 5.7 ms against 9.6 ms).

Prior art: Opacus' ``DPLSTM``, ``DPGRU`` and ``DPRNN`` (``opacus.layers.dp_rnn``) replace the
module with one unrolled over time, whose ``RNNLinear`` layers get the ``Linear`` rule at each
step (``ModuleValidator.fix`` swaps them in). Here the user's module is kept: its fused kernel
runs the forward pass the model sees, and the rule's recomputation only finds δ.

Covered: ``RNN`` (``tanh``, ``relu``), ``GRU``, and ``LSTM`` with ``proj_size=0``; any
``num_layers``, ``bidirectional``, ``batch_first`` either way, bias or not, an initial state
given or not, on padded sequences (the padding is computed over like any other input, as the
module does). Not covered, and left to the generic rule run one sample at a time
(:func:`~dpfl.models.grad_samplers.fallback.per_sample_looped`): an ``LSTM`` with
``proj_size > 0``. A ``PackedSequence`` is refused by both (pad the sequences instead), and
dropout between layers in training mode too (:mod:`~dpfl.models.grad_samplers.refusals`: a
recomputation cannot draw the same masks).

No ghost norms: the per-sample gradients are materialised (``[n, gates·in]`` and
``[n, gates·hidden]`` per layer and direction). The Gram trick costs ``T²·(in + out)`` a sample
against ``T·in·out`` for forming them (:func:`~dpfl.models.grad_samplers.linear.has_ghost`):
it is the cheaper only where ``T² < in·out/(in + out)``, below about 7 steps for an LSTM's
``W_hh`` with 64 hidden units, not at a character model's 80.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpfl.models.grad_samplers.fallback import per_sample_looped
from dpfl.models.grad_samplers.linear import rows
from dpfl.models.grad_samplers.registry import Rule, register

if TYPE_CHECKING:
    from dpfl.models.calls import Batched
    from dpfl.models.rows import Layer


@dataclass(frozen=True)
class Direction:
    """One direction of one layer, time-major (``[T, n, ·]``, in time order): its input x_t
    (the module's input, or the layer below's outputs), its states h_t and h_{t-1} as the
    fused kernel computed them, its initial cell state (LSTM), the gradients reaching each h_t
    from outside the layer (the module's output gradient, or the layer above's, plus ``h_n``'s
    at its last step) and its last cell state's (``c_n``'s), its parameters, and the order in
    which it takes its steps."""

    x: Tensor
    seq: Tensor
    before: Tensor
    c0: Tensor | None
    e: Tensor
    e_c: Tensor | None
    w_ih: Tensor
    b_ih: Tensor | None
    w_hh: Tensor
    b_hh: Tensor | None
    order: Sequence[int]

    def parts(self) -> tuple[Tensor, Tensor]:
        """The input parts ``W_ih x_t + b_ih`` and hidden parts ``W_hh h_{t-1} + b_hh`` of z_t,
        ``[T, n, gates·H]``."""
        return (F.linear(self.x, self.w_ih, self.b_ih),
                F.linear(self.before, self.w_hh, self.b_hh))

    def z(self) -> Tensor:
        """z_t ``[T, n, gates·H]`` (the two biases added first)."""
        bias = self.b_ih if self.b_hh is None else self.b_hh if self.b_ih is None \
            else self.b_ih + self.b_hh
        z = F.linear(self.x, self.w_ih, bias)
        z.view(-1, z.shape[-1]).addmm_(self.before.flatten(0, 1), self.w_hh.t())
        return z


#: one direction of one layer → δ of its input parts and of its hidden parts
#: ``[T, n, gates·H]`` (the same tensor but for the GRU)
Backward = Callable[[Direction], tuple[Tensor, Tensor]]


def _lstm(d: Direction) -> tuple[Tensor, Tensor]:
    """i, f, g, o = σ, σ, tanh, σ of z's quarters; c_t = f ⊙ c_{t-1} + i ⊙ g;
    h_t = o ⊙ tanh(c_t). Backwards, with ∂c_t the cell state's gradient:
    ∂c_t = ∂c_{t+1} ⊙ f_{t+1} + ∂h_t ⊙ o ⊙ (1 − tanh²c_t), and
    δ = (∂c_t ⊙ g ⊙ σ'_i, ∂c_t ⊙ c_{t-1} ⊙ σ'_f, ∂c_t ⊙ i ⊙ (1 − g²), ∂h_t ⊙ tanh c_t ⊙ σ'_o);
    ∂h_{t-1} = e_{t-1} + δ_t W_hh."""
    assert d.c0 is not None and d.e_c is not None
    # in place wherever it can be: fresh [T, n, 4H] temporaries cost more than the arithmetic
    z = d.z()
    steps, n, width = z.shape
    hidden = width // 4
    g = z[..., 2 * hidden:3 * hidden].tanh()
    gates = z.sigmoid_().view(steps, n, 4, hidden)  # i, f, o (the g quarter: overwritten)
    i, f, _, o = gates.unbind(2)
    forget = f.clone()
    ig, c, cells = (i * g).unbind(0), d.c0, [d.c0] * steps
    for t in d.order:  # the cell states, which the fused kernel does not return
        c = cells[t] = torch.addcmul(ig[t], forget[t], c)
    cell = torch.stack(cells)
    tanh_c = cell.tanh()
    through = torch.addcmul(o, o * tanh_c, tanh_c, value=-1)  # ∂h_t/∂c_t = o ⊙ (1 − tanh²c_t)
    # the gates become δ's coefficients (σ' = σ − σ², tanh' = 1 − g²), then δ
    torch.mul(torch.addcmul(g.new_ones(()), g, g, value=-1), i, out=gates[:, :, 2])
    i.addcmul_(i, i, value=-1).mul_(g)
    f.addcmul_(f, f, value=-1).mul_(_shifted(cell, d.c0, d.order))
    o.addcmul_(o, o, value=-1).mul_(tanh_c)
    e, th, forget = d.e.unbind(0), through.unbind(0), forget.unbind(0)
    scale_c, scale_h = gates[:, :, :3].unbind(0), gates[:, :, 3].unbind(0)
    delta = gates.view(steps, n, width)
    rows_ = delta.unbind(0)
    back = d.order[::-1]
    dh, dc = e[back[0]], d.e_c
    for k, t in enumerate(back):
        if k:
            dc = dc * forget[back[k - 1]]
        dc = torch.addcmul(dc, dh, th[t])
        scale_c[t].mul_(dc.unsqueeze(1))
        scale_h[t].mul_(dh)
        if k + 1 < steps:
            dh = torch.addmm(e[back[k + 1]], rows_[t], d.w_hh)
    return delta, delta


def _gru(d: Direction) -> tuple[Tensor, Tensor]:
    """r, z = σ(z's thirds); n = tanh(i_n + r ⊙ h_n) (``i_n``, ``h_n``: the n gate's input and
    hidden parts); h_t = (1 − z) ⊙ n + z ⊙ h_{t-1}. Backwards, every δ is ∂h_t times a
    coefficient of the step: k_n = (1 − z)(1 − n²) for ``i_n``, k_n ⊙ r for ``h_n``,
    (h_{t-1} − n) ⊙ σ'_z for z, k_n ⊙ h_n ⊙ σ'_r for r;
    ∂h_{t-1} = e_{t-1} + ∂h_t ⊙ z + δ_hh W_hh."""
    ih, hh = d.parts()
    steps, n, width = ih.shape
    i_r, i_z, i_n = ih.chunk(3, dim=2)
    h_r, h_z, h_n = hh.chunk(3, dim=2)
    r, z = (i_r + h_r).sigmoid(), (i_z + h_z).sigmoid()
    new = torch.addcmul(i_n, h_n, r).tanh()
    k_n = (1 - z) * torch.addcmul(torch.ones_like(new), new, new, value=-1)
    scale = torch.stack((k_n * h_n * torch.addcmul(r, r, r, value=-1),
                         (d.before - new) * torch.addcmul(z, z, z, value=-1), k_n * r),
                        dim=2)  # [T, n, 3, H]: δ_hh = ∂h_t ⊙ scale
    delta_hh = torch.empty_like(scale)
    dhs = torch.empty_like(d.seq)
    e, zs, sc, out, flat = d.e.unbind(0), z.unbind(0), scale.unbind(0), delta_hh.unbind(0), \
        delta_hh.view(steps, n, width).unbind(0)
    back = d.order[::-1]
    dh = e[back[0]]
    for k, t in enumerate(back):
        dhs[t] = dh
        torch.mul(sc[t], dh.unsqueeze(1), out=out[t])
        if k + 1 < steps:
            dh = torch.addmm(torch.addcmul(e[back[k + 1]], dh, zs[t]), flat[t], d.w_hh)
    delta_ih = torch.cat((delta_hh[:, :, :2], (dhs * k_n).unsqueeze(2)), dim=2)
    return delta_ih.view(steps, n, width), delta_hh.view(steps, n, width)


def _elman(derivative: Callable[[Tensor], Tensor]) -> Backward:
    def backward(d: Direction) -> tuple[Tensor, Tensor]:
        """h_t = φ(z_t); δ_t = ∂h_t ⊙ φ'(z_t), read off h_t; ∂h_{t-1} = e_{t-1} + δ_t W_hh."""
        scale = derivative(d.seq)
        delta = torch.empty_like(scale)
        e, sc, out = d.e.unbind(0), scale.unbind(0), delta.unbind(0)
        back = d.order[::-1]
        dh = e[back[0]]
        for k, t in enumerate(back):
            torch.mul(dh, sc[t], out=out[t])
            if k + 1 < len(back):
                dh = torch.addmm(e[back[k + 1]], out[t], d.w_hh)
        return delta, delta

    return backward


#: by ``RNNBase.mode``: the fused forward function (``torch.lstm``, …, as the module calls it)
#: and the backward pass of one direction of one layer
CELLS: dict[str, tuple[Callable, Backward]] = {
    "LSTM": (torch.lstm, _lstm),
    "GRU": (torch.gru, _gru),
    "RNN_TANH": (torch.rnn_tanh, _elman(lambda h: torch.addcmul(torch.ones_like(h), h, h,
                                                                value=-1))),
    "RNN_RELU": (torch.rnn_relu, _elman(lambda h: (h > 0).to(h.dtype))),
}


def covered(module: nn.Module) -> bool:
    """Whether the rule covers ``module``: not an ``LSTM`` with projections."""
    return isinstance(module, nn.RNNBase) and module.mode in CELLS and module.proj_size == 0


#: the generic rule, one sample at a time, for the recurrent layers :func:`covered` leaves out
UNCOVERED = Rule(per_sample_looped, whole=True)


#: one direction of one layer's parameters, in the order the fused kernels take them
_ORDER = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def _suffix(layer: int, direction: int) -> str:
    return f"_l{layer}" + ("_reverse" if direction else "")


def _shifted(seq: Tensor, first: Tensor, order: Sequence[int]) -> Tensor:
    """``[T, ...]``: at each step, ``seq`` one step earlier in ``order`` (``first`` at the
    first step)."""
    if order[0] == 0:
        return torch.cat((first.unsqueeze(0), seq[:-1]))
    return torch.cat((seq[1:], first.unsqueeze(0)))


@register(nn.RNN, nn.LSTM, nn.GRU, applies=covered, whole=True)
def recurrent(layer: Layer, call: Batched, grads: Batched) -> list[Tensor]:
    """One ``[n, numel]`` per trainable parameter (module docstring)."""
    module = layer.module
    assert isinstance(module, nn.RNNBase)
    forward, backward = CELLS[module.mode]
    lstm = module.mode == "LSTM"
    params, args, kwargs = call.rebuild(list(call.leaves))  # samples first
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    steps, n = x.shape[1], x.shape[0]
    depth, hidden = module.num_layers, module.hidden_size
    sides = 2 if module.bidirectional else 1
    kinds = _ORDER[:4 if module.bias else 2]
    weights = {kind + _suffix(k, d): getattr(module, kind + _suffix(k, d))
               for k in range(depth) for d in range(sides) for kind in kinds}
    weights.update(zip(layer.names, params))  # the trainable ones as the call used them
    weights = {name: w.detach() for name, w in weights.items()}
    wanted = set(layer.names)
    trained = {(k, d) for k in range(depth) for d in range(sides)
               if any(kind + _suffix(k, d) in wanted for kind in _ORDER)}
    lowest = min(k for k, _ in trained)
    g_out, g_h, *g_c = (g.transpose(0, 1) for g in grads.batched)  # time-major, [L·D, n, H]
    h0 = hx[0] if lstm and hx is not None else hx
    zeros = x.new_zeros(depth * sides, n, hidden)
    h0 = zeros if h0 is None else h0.detach().transpose(0, 1)
    c0 = (zeros if hx is None else hx[1].detach().transpose(0, 1)) if lstm else None
    orders = (range(steps), range(steps - 1, -1, -1))

    with torch.no_grad():
        # forward: every layer's states h_t by the fused kernel, as the module computed them
        inputs = [x.detach().transpose(0, 1).contiguous()]  # [T, n, ·] per layer
        for k in range(depth):
            flat = [weights[kind + _suffix(k, d)] for d in range(sides) for kind in kinds]
            span = slice(k * sides, (k + 1) * sides)
            state = (h0[span].contiguous(), c0[span].contiguous()) if lstm \
                else h0[span].contiguous()
            inputs.append(forward(inputs[k], state, flat, module.bias, 1, 0.0, False,
                                  module.bidirectional, False)[0])
        # backward: the layers from the top down to the lowest trained one
        out: dict[str, Tensor] = {}
        from_above = g_out
        for k in range(depth - 1, lowest - 1, -1):
            below = None
            for d in range(sides):
                if k == lowest and (k, d) not in trained:
                    continue  # nothing below needs its δ
                s, index, order = _suffix(k, d), k * sides + d, orders[d]
                seq = inputs[k + 1][..., d * hidden:(d + 1) * hidden]
                e = from_above[..., d * hidden:(d + 1) * hidden].clone(
                    memory_format=torch.contiguous_format)
                e[order[-1]] += g_h[index]
                direction = Direction(
                    inputs[k], seq, _shifted(seq, h0[index], order), c0[index] if lstm else None,
                    e, g_c[0][index] if lstm else None, weights["weight_ih" + s],
                    weights.get("bias_ih" + s), weights["weight_hh" + s],
                    weights.get("bias_hh" + s), order)
                delta_ih, delta_hh = backward(direction)
                _put(out, direction.x, delta_ih, "weight_ih" + s, "bias_ih" + s, wanted)
                _put(out, direction.before, delta_hh, "weight_hh" + s, "bias_hh" + s, wanted)
                if k > lowest:
                    down = torch.matmul(delta_ih, direction.w_ih)
                    below = down if below is None else below + down
            from_above = below
    return [out[name] for name in layer.names]


def _put(out: dict[str, Tensor], a: Tensor, g: Tensor, weight: str, bias: str,
         wanted: set[str]) -> None:
    """``out[weight]``, ``out[bias]`` (those ``wanted``): the ``Linear`` rule on the
    time-major ``a``, ``g`` (``[T, n, ·]``) with the samples put first."""
    names = [name for name in (weight, bias) if name in wanted]
    if names:
        parts = rows(a.transpose(0, 1), g.transpose(0, 1), (weight in wanted, bias in wanted))
        out.update(zip(names, parts))
