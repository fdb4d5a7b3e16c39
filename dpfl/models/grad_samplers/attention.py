"""``MultiheadAttention``: its parameters are ``Linear`` maps — the in-projection of the query,
key and value (``in_proj_weight``, or ``q/k/v_proj_weight`` where ``kdim``/``vdim`` differ from
``embed_dim``; ``in_proj_bias``) and ``out_proj`` — around a parameter-free core (scaled
dot-product attention over the heads), so its per-sample gradients are the ``Linear`` rule over
sequences (:func:`~dpfl.models.grad_samplers.linear.rows`) at each of them:

    ∂ℓ_j/∂W_q = Σ_t δq_t query_tᵀ   (and W_k, W_v from key and value),
    ∂ℓ_j/∂W_o = Σ_t g_t c_tᵀ,        ∂ℓ_j/∂b = Σ_t δ

with δq, δk, δv sample j's gradients at the projections' outputs q, k, v, c_t the core's
output (out_proj's input) and g the module's output gradient (Goodfellow 2015). Self-attention
(query, key and value the same tensor, as in ``TransformerEncoderLayer``) takes the three
parts at once: one ``[3E, E]`` weight on one input.

How δ is found. The tape keeps the whole call (query, key, value, the masks, ``need_weights``…:
:class:`~dpfl.models.calls.Batched`, samples first) and the gradients of the module's outputs.
The rule recomputes the in-projection from the parameters in use (without autograd), runs the
core again on the whole batch from leaves q, k, v, and one ``torch.autograd.grad`` call with
the cotangents ``g W_o`` at c (and the tape's gradient of the attention weights, where the
call returned them and the model used them) gives δq, δk, δv for every sample at once: the
core does not mix samples, so the batch's vjp is every sample's own. The generic rule
(:mod:`~dpfl.models.grad_samplers.fallback`) computes the same through ``vmap``, which has no
batching rule for CPU attention and runs it sample by sample.

The core follows ``torch.nn.functional.multi_head_attention_forward``: a boolean mask is
``-inf`` where True, a float mask is added; ``attn_mask`` (2-D, shared by the samples: a 3-D
one is refused by the layout) plus ``key_padding_mask`` broadcast over the heads and queries;
``is_causal`` without a key padding mask and without weights means the causal mask, as there.
``torch.nn.functional.scaled_dot_product_attention`` without weights, the explicit softmax
with them (averaged over the heads with ``average_attn_weights``).

Covered: any ``embed_dim``, ``kdim``, ``vdim`` and number of heads, ``batch_first`` either
way, bias or not, ``key_padding_mask`` and ``attn_mask`` (boolean or float), self- and
cross-attention, weights returned or not, any parameters frozen. Not covered, and left to the
generic rule: ``add_bias_kv`` (``bias_k``, ``bias_v``) and ``add_zero_attn``. Dropout on the
attention weights in training mode is refused by both when the model is built
(:mod:`~dpfl.models.grad_samplers.refusals`: a recomputation cannot draw the same masks).

No ghost norms: the per-sample gradients are materialised (``[n, 3E·E]`` and ``[n, E·E]``). A
whole-module rule hands back gradients, not (a, g) pairs, and at a sequence's length the Gram
trick is the dearer one anyway (:func:`~dpfl.models.grad_samplers.linear.has_ghost`: it needs
T² < in·out/(in + out), below 6 positions at E = 64).
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpfl.models.grad_samplers.linear import rows
from dpfl.models.grad_samplers.registry import register

if TYPE_CHECKING:
    from dpfl.models.calls import Batched
    from dpfl.models.rows import Layer

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def covered(module: nn.Module) -> bool:
    """Whether the rule covers ``module``: no ``bias_k``/``bias_v``, no ``add_zero_attn``."""
    return (isinstance(module, nn.MultiheadAttention) and module.bias_k is None
            and module.bias_v is None and not module.add_zero_attn)


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A mask as the module uses it: added to the scores (a boolean one: ``-inf`` where
    True)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf"))
    return mask.to(dtype)


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the same memory in the same shape (the tape moves
    each argument on its own: ``query is key`` is lost, not the memory they share)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _heads(t: Tensor, heads: int) -> Tensor:
    """``[n, T, E]`` → ``[n, heads, T, E/heads]``."""
    n, length, width = t.shape
    return t.view(n, length, heads, width // heads).transpose(1, 2)


@register(nn.MultiheadAttention, applies=covered, whole=True)
def attention(layer: Layer, call: Batched, grads: Batched) -> list[Tensor]:
    """One ``[n, numel]`` per trainable parameter (module docstring)."""
    module = layer.module
    assert isinstance(module, nn.MultiheadAttention)
    if module.training and module.dropout > 0:
        raise ValueError("per-sample gradients: MultiheadAttention with dropout in training "
                         "mode (its masks cannot be drawn again); use dropout=0, or eval()")
    params, args, kwargs = call.rebuild(list(call.leaves))  # samples first
    bound = _SIGNATURE.bind(module, *args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    query, key, value = given["query"], given["key"], given["value"]
    if query.dim() != 3:
        raise ValueError("per-sample gradients: MultiheadAttention on unbatched inputs")
    weights = dict(module.named_parameters())
    weights.update(zip(layer.names, params))  # the trainable ones as the call used them
    weights = {name: w.detach() for name, w in weights.items()}
    wanted = set(layer.names)
    heads, width = module.num_heads, module.embed_dim
    n, length, _ = query.shape
    dtype = query.dtype

    # the scores' additive mask, [n or 1, 1, T, S]
    padding, mask = given["key_padding_mask"], given["attn_mask"]
    if given["is_causal"] and padding is None and not given["need_weights"]:
        causal = torch.ones(length, key.shape[1], dtype=torch.bool, device=query.device)
        mask = causal.triu(diagonal=1)
    mask = _additive(mask, dtype)
    padding = _additive(padding, dtype)
    if padding is not None:
        padding = padding.view(n, 1, 1, -1)
        mask = padding if mask is None else mask + padding

    bias = weights.get("in_proj_bias")
    b_q, b_k, b_v = (None,) * 3 if bias is None else bias.chunk(3)
    separate = not module._qkv_same_embed_dim
    if separate:
        w_q, w_k, w_v = (weights[f"{p}_proj_weight"] for p in "qkv")
    else:
        w_q, w_k, w_v = weights["in_proj_weight"].chunk(3)
    together = not separate and _same(query, key) and _same(key, value)
    in_names = [name for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight",
                                  "v_proj_weight", "in_proj_bias") if name in wanted]
    out = {}
    g_out = grads.batched[0]  # [n, T, E]
    tracked_weights = given["need_weights"] and len(grads.batched) > 1
    with torch.no_grad():
        if together:
            qkv = F.linear(query, weights["in_proj_weight"], bias)
        else:
            qkv = torch.cat((F.linear(query, w_q, b_q), F.linear(key, w_k, b_k),
                             F.linear(value, w_v, b_v)), dim=1)  # along the positions
    spans = (length, key.shape[1], value.shape[1]) if not together else None
    with torch.enable_grad():
        qkv.requires_grad_(bool(in_names))
        if together:
            q, k, v = qkv.chunk(3, dim=-1)
        else:
            q, k, v = qkv.split(spans, dim=1)
        q, k, v = _heads(q, heads), _heads(k, heads), _heads(v, heads)
        if given["need_weights"]:
            scores = torch.matmul(q * math.sqrt(1.0 / q.shape[-1]), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            probs = scores.softmax(dim=-1)
            core = torch.matmul(probs, v)
        else:
            core = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        core = core.transpose(1, 2).reshape(n, length, width)  # out_proj's input c
        if in_names:
            outputs, cotangents = [core], [torch.matmul(g_out, weights["out_proj.weight"])]
            if tracked_weights:
                attn = probs.mean(dim=1) if given["average_attn_weights"] else probs
                outputs.append(attn)
                cotangents.append(grads.batched[1])
            (delta,) = torch.autograd.grad(outputs, (qkv,), cotangents)
    core = core.detach()
    if "out_proj.weight" in wanted or "out_proj.bias" in wanted:
        parts = rows(core, g_out, ("out_proj.weight" in wanted, "out_proj.bias" in wanted))
        out.update(zip([name for name in ("out_proj.weight", "out_proj.bias")
                        if name in wanted], parts))
    if in_names:
        if together:
            parts = rows(query, delta, ("in_proj_weight" in wanted, "in_proj_bias" in wanted))
            out.update(zip([name for name in ("in_proj_weight", "in_proj_bias")
                            if name in wanted], parts))
        else:
            deltas = delta.split(spans, dim=1)
            trained = [f"{p}_proj_weight" in wanted if separate else "in_proj_weight" in wanted
                       for p in "qkv"]
            per = [rows(x, d, (w, "in_proj_bias" in wanted))
                   for x, d, w in zip((query, key, value), deltas, trained)]
            if separate:
                for p, part, w in zip("qkv", per, trained):
                    if w:
                        out[f"{p}_proj_weight"] = part[0]
            elif "in_proj_weight" in wanted:
                out["in_proj_weight"] = torch.cat([part[0] for part in per], dim=1)
            if "in_proj_bias" in wanted:
                out["in_proj_bias"] = torch.cat([part[-1] for part in per], dim=1)
    return [out[name] for name in layer.names]
