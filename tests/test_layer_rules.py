"""Per-sample gradient rules beyond the zoo's layers: every rule of the registry, the generic
rule, frozen parameters, and the layers refused when the model is built.

Each model here is checked against a per-sample loop (one ``torch.autograd.grad`` per sample) in
float64 at rtol = 1e-10, relative to the largest entry: the per-sample gradients, the norms
``clipped_mean`` and ``per_sample_norms`` report, and the clipped mean itself (some samples
clipped, some not).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dpfl.errors import ConfigError
from dpfl.models import FlatModel, grad_sample
from dpfl.models.grad_samplers import FALLBACK, RULES, attention, recurrent, rule_for
from dpfl.models.grad_samplers.fallback import per_sample_looped

RTOL = 1e-10

# vmap runs scaled_dot_product_attention sample by sample (torch has no batching rule for it)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")
CLASSES = 3


def _close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    err = (ours.double() - ref.double()).abs().max().item()
    return err <= RTOL * max(ref.double().abs().max().item(), 1e-12)


class Head(nn.Module):
    """``body``, flattened, then a Linear head to ``CLASSES`` logits."""

    def __init__(self, body: nn.Module, features: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(features, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)).flatten(1))


class Tokens(nn.Module):
    """Token ids [n, T] → Embedding(padding_idx=0) → ``body`` → mean over the unpadded
    positions → Linear head; ``mask``: the body is called with the padding as
    ``src_key_padding_mask`` (a transformer layer)."""

    def __init__(self, body: nn.Module, width: int = 8, vocab: int = 11,
                 mask: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.body = body
        self.mask = mask
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = x == 0
        h = self.embed(x)
        h = self.body(h, src_key_padding_mask=pad) if self.mask else self.body(h)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head(self.norm((h * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1)))


class CharLSTM(nn.Module):
    """A character model: Embedding → LSTM → the last position's output → Linear head
    (``batch_first``), or → GRU → the final state h_n → head (sequence-first)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(11, 6)
        rnn = nn.LSTM if batch_first else nn.GRU
        self.rnn = rnn(6, 5, num_layers=2, batch_first=batch_first)
        self.head = nn.Linear(5, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.batch_first else self.embed(x).transpose(0, 1)
        out, state = self.rnn(h)
        return self.head(out[:, -1] if self.batch_first else state[-1])


class Recurrent(nn.Module):
    """Token ids → Embedding(padding_idx=0) → ``rnn`` (either layout, as it is built) → the
    last position's output, every layer's and direction's final state h_n summed (and the
    LSTM's c_n) → Linear head: every output of the layer gets a gradient. ``state``: an initial
    state (h_0, and c_0 = −h_0 for an LSTM) that depends on the sample (its first token), else
    none; ``packed``: the padded batch packed by its lengths (no padding before the end)."""

    def __init__(self, rnn: nn.RNNBase, state: bool = False, packed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, rnn.input_size, padding_idx=0)
        self.rnn = rnn
        self.state = state
        self.packed = packed
        sides = 2 if rnn.bidirectional else 1
        width = rnn.proj_size or rnn.hidden_size
        self.register_buffer("start", torch.linspace(-1, 1, rnn.num_layers * sides * width)
                             .reshape(-1, 1, width))
        cells = rnn.hidden_size if isinstance(rnn, nn.LSTM) else 0
        self.head = nn.Linear(sides * width + width + cells, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.rnn.batch_first
        h = self.embed(x) if first else self.embed(x).transpose(0, 1)
        lstm = isinstance(self.rnn, nn.LSTM)
        hx = None
        if self.state:
            h0 = self.start.to(h.dtype) * x[:, :1].t().unsqueeze(-1).to(h.dtype) / 10
            hx = (h0, -h0) if lstm else h0
        if self.packed:
            lengths = (x != 0).sum(dim=1).cpu()
            out, state = self.rnn(pack_padded_sequence(h, lengths, first, False), hx)
            out = pad_packed_sequence(out, first, total_length=x.shape[1])[0]
        else:
            out, state = self.rnn(h, hx)
        h_n, c_n = state if lstm else (state, None)
        parts = [out[:, -1] if first else out[-1], h_n.sum(dim=0)]
        return self.head(torch.cat(parts + ([c_n.sum(dim=0)] if lstm else []), dim=1))


def _frozen(module: nn.Module, *names: str) -> nn.Module:
    """``module`` with the parameters ``names`` frozen (all of them if none is named)."""
    for name, p in module.named_parameters():
        if not names or name in names:
            p.requires_grad_(False)
    return module


def _char_rnn(cell: type[nn.RNNBase]) -> nn.Module:
    """The shape of examples/shakespeare's ``char_rnn``: Embedding → one batch-first layer
    → its last output → Linear."""

    class CharRNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 4, padding_idx=0)
            self.rnn = cell(4, 5, batch_first=True)
            self.head = nn.Linear(5, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(self.embed(x))[0][:, -1])

    return CharRNN()


class LoRALinear(nn.Module):
    """A frozen pretrained ``Linear`` plus a trainable low-rank update: y = W x + b + B A x
    (Hu et al. 2021); ``modules``: A and B as ``Linear`` layers (their own rules), else as
    parameters of this module (the generic rule, with W and b frozen inside it)."""

    def __init__(self, d_in: int, d_out: int, rank: int, modules: bool) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.modules_ = modules
        if modules:
            self.a = nn.Linear(d_in, rank, bias=False)
            self.b = nn.Linear(rank, d_out, bias=False)
        else:
            self.a_weight = nn.Parameter(torch.randn(rank, d_in) / d_in ** 0.5)
            self.b_weight = nn.Parameter(torch.randn(d_out, rank) / rank ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.b(self.a(x)) if self.modules_ else x @ self.a_weight.t() @ self.b_weight.t()
        return self.base(x) + update


def _lora(modules: bool) -> nn.Module:
    """A frozen pretrained MLP with LoRA adapters on both layers."""
    return nn.Sequential(nn.Flatten(), LoRALinear(12, 10, 2, modules), nn.Tanh(),
                         LoRALinear(10, CLASSES, 2, modules))


class SelfAttention(nn.Module):
    """Self-attention over [n, T, width] by a sequence-first ``MultiheadAttention`` (on
    [T, n, width]), the padding masked."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2)

    def forward(self, h: torch.Tensor, src_key_padding_mask: torch.Tensor) -> torch.Tensor:
        h = h.transpose(0, 1)
        out = self.attention(h, h, h, key_padding_mask=src_key_padding_mask,
                             need_weights=False)[0]
        return out.transpose(0, 1)


class Attend(nn.Module):
    """Token ids [n, T] → Embedding(padding_idx=0) → ``attention`` (either layout, as it is
    built) → the mean over the positions → Linear head. Self-attention on the embedded tokens,
    or (``cross``) the queries attend to keys and values of their own, from the last
    ``T − 2`` tokens (widths ``kdim``, ``vdim``; the value a function of the key); ``padding``:
    the padded keys masked (``key_padding_mask``); ``mask``: ``"causal"`` (boolean, the
    queries' own and earlier positions), ``"float"`` (a fixed additive [T, S] mask);
    ``weights``: the attention weights returned (``average``: averaged over the heads, else
    every head's) and used by the head too; ``causal_hint``: ``is_causal=True`` with the causal
    mask."""

    def __init__(self, attention: nn.MultiheadAttention, cross: bool = False,
                 padding: bool = False, mask: str | None = None, weights: bool = False,
                 average: bool = True, causal_hint: bool = False) -> None:
        super().__init__()
        self.attention, self.cross, self.padding, self.mask = attention, cross, padding, mask
        self.weights, self.average, self.causal_hint = weights, average, causal_hint
        width = attention.embed_dim
        self.embed = nn.Embedding(11, width, padding_idx=0)
        if cross:
            self.embed_k = nn.Embedding(11, attention.kdim, padding_idx=0)
            self.to_v = nn.Linear(attention.kdim, attention.vdim)
        self.head = nn.Linear(width + (4 if weights else 0), CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.attention.batch_first
        h = self.embed(x)
        keys = x[:, 2:] if self.cross else x
        if self.cross:
            k = self.embed_k(keys)
            v = torch.tanh(self.to_v(k))
        t, s = x.shape[1], keys.shape[1]
        options = {"need_weights": self.weights, "average_attn_weights": self.average}
        if self.padding:
            options["key_padding_mask"] = keys == 0
        if self.mask == "causal":
            options["attn_mask"] = torch.ones(t, s, dtype=torch.bool).triu(1 + t - s)
            options["is_causal"] = self.causal_hint
        elif self.mask == "float":
            options["attn_mask"] = torch.linspace(-1, 1, t * s, dtype=h.dtype).reshape(t, s)
        if not first:
            h = h.transpose(0, 1)
            if self.cross:
                k, v = k.transpose(0, 1), v.transpose(0, 1)
        out, w = self.attention(h, k, v, **options) if self.cross else \
            self.attention(h, h, h, **options)
        pooled = (out if first else out.transpose(0, 1)).mean(dim=1)
        if self.weights:  # [n, T, S] (averaged over the heads) or [n, heads, T, S]
            pooled = torch.cat((pooled, w.reshape(len(x), -1, s).mean(dim=1)[:, :4]), dim=1)
        return self.head(pooled)


class Scaled(nn.Module):
    """A user's module with a parameter of its own: y = s ∘ tanh(W x)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(12, 6)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * torch.tanh(self.inner(x.flatten(1)))


# name -> (model builder, input shape, whether the inputs are token ids)
MODELS = {
    "linear-on-sequences-ghost": (lambda: Head(nn.Linear(16, 16), 2 * 16), (2, 16), False),
    "linear-on-sequences-materialised": (lambda: Head(nn.Linear(4, 5), 3 * 5), (3, 4), False),
    "conv1d": (lambda: Head(nn.Conv1d(2, 4, 3, stride=2, padding=1), 4 * 4), (2, 7), False),
    "conv1d-grouped": (lambda: Head(nn.Conv1d(8, 8, 3, groups=2, dilation=2), 8 * 3),
                       (8, 7), False),
    "conv2d-same-padding": (lambda: Head(nn.Conv2d(2, 3, 3, padding="same"), 3 * 25),
                            (2, 5, 5), False),
    "conv2d-reflect": (lambda: Head(nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
                                    3 * 25), (2, 5, 5), False),
    "conv3d": (lambda: Head(nn.Conv3d(1, 2, 2, padding=1), 2 * 4 * 4 * 4), (1, 3, 3, 3), False),
    "conv3d-grouped": (lambda: Head(nn.Conv3d(8, 4, 2, bias=False), 4 * 8), (8, 3, 3, 3),
                       False),
    "layernorm": (lambda: Head(nn.LayerNorm(4), 3 * 4), (3, 4), False),
    "layernorm-2d-shape": (lambda: Head(nn.LayerNorm((3, 4)), 12), (3, 4), False),
    "groupnorm": (lambda: Head(nn.GroupNorm(2, 4), 4 * 5), (4, 5), False),
    "instancenorm1d": (lambda: Head(nn.InstanceNorm1d(3, affine=True), 3 * 5), (3, 5), False),
    "instancenorm2d": (lambda: Head(nn.InstanceNorm2d(3, affine=True), 3 * 16), (3, 4, 4),
                       False),
    "instancenorm3d": (lambda: Head(nn.InstanceNorm3d(2, affine=True), 2 * 27), (2, 3, 3, 3),
                       False),
    "embedding-padded": (lambda: Tokens(nn.Identity()), (6,), True),
    "user-module": (lambda: Head(Scaled(), 6), (3, 4), False),
    "transformer": (lambda: Tokens(nn.TransformerEncoderLayer(
        8, 2, dim_feedforward=16, dropout=0.0, batch_first=True), mask=True), (6,), True),
    "attention-sequence-first": (lambda: Tokens(SelfAttention(), mask=True), (6,), True),
    "transformer-encoder-2-layers": (lambda: Tokens(nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True),
        2, enable_nested_tensor=False), mask=True), (6,), True),
    "attention-cross-kdim-vdim-weights": (lambda: Attend(nn.MultiheadAttention(
        8, 2, kdim=5, vdim=3, batch_first=True), cross=True, padding=True, weights=True),
        (6,), True),
    "lstm-batch-first": (lambda: CharLSTM(batch_first=True), (5,), True),
    "gru-sequence-first": (lambda: CharLSTM(batch_first=False), (5,), True),
    "char-rnn-lstm-padded": (lambda: _char_rnn(nn.LSTM), (7,), True),
    "char-rnn-gru-padded": (lambda: _char_rnn(nn.GRU), (7,), True),
    "lstm-2-layers-bidirectional-initial-state": (lambda: Recurrent(nn.LSTM(
        4, 3, num_layers=2, bidirectional=True), state=True), (5,), True),
    "gru-bidirectional-batch-first-no-bias": (lambda: Recurrent(nn.GRU(
        4, 3, bidirectional=True, batch_first=True, bias=False)), (5,), True),
    "rnn-relu-2-layers-initial-state": (lambda: Recurrent(nn.RNN(
        4, 3, num_layers=2, nonlinearity="relu"), state=True), (5,), True),
    "rnn-tanh-bidirectional": (lambda: Recurrent(nn.RNN(4, 3, bidirectional=True)), (5,),
                               True),
    "lstm-partly-frozen": (lambda: Recurrent(_frozen(
        nn.LSTM(4, 3, num_layers=2, bidirectional=True), "weight_ih_l0", "bias_hh_l0",
        "weight_ih_l0_reverse", "weight_hh_l0_reverse", "bias_ih_l0_reverse",
        "bias_hh_l0_reverse", "weight_hh_l1_reverse")), (5,), True),
    "lstm-lower-layer-frozen": (lambda: Recurrent(_frozen(
        nn.LSTM(4, 3, num_layers=3), *(f"{kind}_l{k}" for k in (0, 1) for kind in (
            "weight_ih", "weight_hh", "bias_ih", "bias_hh")))), (5,), True),
    "gru-frozen": (lambda: Recurrent(_frozen(nn.GRU(4, 3, num_layers=2))), (5,), True),
    "lstm-projections-generic": (lambda: Recurrent(nn.LSTM(
        4, 3, num_layers=2, proj_size=2, batch_first=True)), (5,), True),
    "lora-linear-adapters": (lambda: _lora(modules=True), (12,), False),
    "lora-parameter-adapters": (lambda: _lora(modules=False), (12,), False),
}


def _setup(name: str, clients: int = 2, batch: int = 6):
    return _prepared(*MODELS[name], clients, batch)


def _prepared(build, shape: tuple[int, ...], tokens: bool, clients: int = 2, batch: int = 6):
    torch.manual_seed(0)
    model = FlatModel(build().double(), "cross-entropy")  # frozen parameters too
    gen = torch.Generator().manual_seed(1)
    if tokens:  # ids 1..10, and some padding (0) at the ends of the sequences
        x = torch.randint(1, 11, (clients, batch, *shape), generator=gen)
        x[:, ::2, -2:] = 0
    else:
        x = torch.randn(clients, batch, *shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (clients, batch), generator=gen)
    flat = (model.initial_params() + 0.1 * torch.randn(model.d, generator=gen)).double()
    return model, flat, x, y


def _loop(model: FlatModel, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor
          ) -> torch.Tensor:
    """[b, d]: one autograd pass per sample on the module holding ``flat``, in float64."""
    module = model.load_into(flat).double()
    params = [p for p in module.parameters() if p.requires_grad]
    rows = []
    for j in range(len(x)):
        xj = x[j:j + 1] if not x.is_floating_point() else x[j:j + 1].double()
        loss = model.loss.per_sample(module(xj), y[j:j + 1]).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([torch.zeros_like(p).reshape(-1) if g is None else g.reshape(-1)
                               for p, g in zip(params, grads)]))
    return torch.stack(rows)


def _clipped(grads: torch.Tensor, clip: float) -> torch.Tensor:
    clip = torch.tensor(clip, dtype=torch.float32).item()
    norms = grads.norm(dim=1)
    return (grads * torch.where(norms > clip, clip / norms, torch.ones_like(norms))[:, None]
            ).mean(dim=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_gradients_norms_and_clipped_mean_equal_a_per_sample_loop(name):
    model, flat, x, y = _setup(name)
    ours = model.per_sample_gradients(flat, x, y)
    loops = [_loop(model, flat, x[c], y[c]) for c in range(len(x))]
    clip = torch.cat(loops).norm(dim=1).median().item()  # some samples clipped, some not
    means, norms = model.clipped_mean(flat, x, y, clip)
    alone = model.per_sample_norms(flat, x, y)
    for c, loop in enumerate(loops):
        assert _close(ours[c], loop)
        assert _close(norms[c], loop.norm(dim=1)) and _close(alone[c], loop.norm(dim=1))
        assert _close(means[c], _clipped(loop, clip))


@pytest.mark.parametrize("name", ["linear-on-sequences-ghost", "transformer",
                                  "lstm-batch-first"])
def test_the_clipped_difference_equals_a_per_sample_loop(name):
    model, flat, x, y = _setup(name)
    before = flat + 0.05 * torch.randn(flat.shape, generator=torch.Generator().manual_seed(2),
                                       dtype=flat.dtype)
    ours = model.clipped_difference_mean(flat, before, x, y, clip=0.5, clip_diff=0.3,
                                         gamma=0.25)
    for c in range(len(x)):
        now, then = _loop(model, flat, x[c], y[c]), _loop(model, before, x[c], y[c])

        def clip(g: torch.Tensor, radius: float) -> torch.Tensor:
            radius = torch.tensor(radius, dtype=torch.float32).item()
            norms = g.norm(dim=1, keepdim=True)
            return g * torch.where(norms > radius, radius / norms, torch.ones_like(norms))

        c_now, c_then = clip(now, 0.5), clip(then, 0.5)
        ref = (0.25 * c_now + 0.75 * clip(c_now - c_then, 0.3)).mean(dim=0)
        assert _close(ours[c], ref)


def test_every_registered_layer_type_has_its_own_rule():
    layers = [nn.Linear(3, 2), nn.Conv1d(2, 2, 1), nn.Conv2d(2, 2, 1), nn.Conv3d(2, 2, 1),
              nn.Embedding(4, 2), nn.LayerNorm(2), nn.GroupNorm(1, 2),
              nn.InstanceNorm1d(2, affine=True), nn.InstanceNorm2d(2, affine=True),
              nn.InstanceNorm3d(2, affine=True)]
    assert {type(m) for m in layers} <= set(RULES)
    model = FlatModel(nn.Sequential(*[nn.Sequential(m) for m in layers]), "cross-entropy")
    assert all(layer.rule is not FALLBACK for layer in model.flat.layers)


def test_modules_without_a_rule_are_covered_whole_by_the_generic_rule():
    model = _setup("user-module")[0]
    [scaled] = [layer for layer in model.flat.layers if isinstance(layer.module, Scaled)]
    assert scaled.rule is FALLBACK and scaled.names == ("scale", "inner.weight", "inner.bias")


def test_attention_is_covered_whole_by_its_own_rule():
    model = _setup("transformer")[0]
    kinds = {type(layer.module).__name__: layer for layer in model.flat.layers}
    layer = kinds["MultiheadAttention"]
    assert layer.rule is RULES[nn.MultiheadAttention] and layer.rule.whole
    assert layer.rule.per_sample is attention.attention
    assert layer.names == ("in_proj_weight", "in_proj_bias", "out_proj.weight",
                           "out_proj.bias")  # its out_proj too, used without being called
    assert {"Embedding", "Linear", "LayerNorm"} <= set(kinds)


# name -> (MultiheadAttention options, Attend options); every one also with batch_first
ATTENTION = {
    "self-1-head": ({"num_heads": 1}, {}),
    "self-4-heads-padding": ({"num_heads": 4}, {"padding": True}),
    "self-causal-padding": ({"num_heads": 2}, {"padding": True, "mask": "causal"}),
    "self-causal-hint": ({"num_heads": 2}, {"mask": "causal", "causal_hint": True}),
    "self-float-mask-no-bias": ({"num_heads": 2, "bias": False}, {"mask": "float"}),
    "self-weights-per-head": ({"num_heads": 4}, {"weights": True, "average": False,
                                                 "padding": True}),
    "cross-padding-causal": ({"num_heads": 2}, {"cross": True, "padding": True,
                                                "mask": "causal"}),
    "cross-4-heads-no-bias": ({"num_heads": 4, "bias": False}, {"cross": True}),
    "cross-kdim-vdim": ({"num_heads": 2, "kdim": 5, "vdim": 3},
                        {"cross": True, "padding": True}),
    "cross-kdim-weights-float-mask": ({"num_heads": 4, "kdim": 6},
                                      {"cross": True, "weights": True, "mask": "float"}),
}


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("name", list(ATTENTION))
def test_the_attention_rule_equals_a_per_sample_loop(name, batch_first):
    options, uses = ATTENTION[name]
    model, flat, x, y = _prepared(lambda: Attend(nn.MultiheadAttention(
        8, batch_first=batch_first, **options), **uses), (6,), True)
    [layer] = [layer for layer in model.flat.layers
               if isinstance(layer.module, nn.MultiheadAttention)]
    assert layer.rule.per_sample is attention.attention
    ours = model.per_sample_gradients(flat, x, y)
    for c in range(len(x)):
        loop = _loop(model, flat, x[c], y[c])
        assert loop.abs().max() > 0 and _close(ours[c], loop)


@pytest.mark.parametrize("frozen", [("in_proj_weight",), ("out_proj.weight", "out_proj.bias"),
                                    ("in_proj_bias", "out_proj.bias"),
                                    ("q_proj_weight", "v_proj_weight")])
def test_the_attention_rule_forms_only_the_trainable_parameters(frozen):
    kdim = 5 if "q_proj_weight" in frozen else None

    def build() -> nn.Module:
        mha = nn.MultiheadAttention(8, 2, kdim=kdim, vdim=kdim)
        return Attend(_frozen(mha, *frozen), cross=True, padding=True)

    model, flat, x, y = _prepared(build, (6,), True)
    [layer] = [layer for layer in model.flat.layers
               if isinstance(layer.module, nn.MultiheadAttention)]
    assert layer.rule.per_sample is attention.attention
    assert not set(frozen) & set(layer.names)
    assert _close(model.per_sample_gradients(flat, x, y)[0], _loop(model, flat, x[0], y[0]))


def test_a_transformer_in_evaluation_mode_gets_the_attention_rule():
    """eval(): torch's fast path (a fused kernel, not the module's call) runs only without
    gradients; the tape's forward pass keeps them, so the attention layer is still called."""
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)  # p = 0.1
    model, flat, x, y = _prepared(lambda: Tokens(nn.TransformerEncoder(
        layer, 2, enable_nested_tensor=False), mask=True).eval(), (6,), True)
    ours = model.per_sample_gradients(flat, x, y)
    assert _close(ours[0], _loop(model, flat, x[0], y[0]))


@pytest.mark.parametrize("options", [{"add_zero_attn": True}, {"add_bias_kv": True},
                                     {"add_bias_kv": True, "add_zero_attn": True}])
def test_attention_the_rule_does_not_cover_gets_the_generic_rule(options):
    mha = nn.MultiheadAttention(8, 2, batch_first=True, **options)
    assert rule_for(mha) is FALLBACK
    model, flat, x, y = _prepared(lambda: Attend(nn.MultiheadAttention(
        8, 2, batch_first=True, **options), padding=True), (6,), True)
    [layer] = [layer for layer in model.flat.layers
               if isinstance(layer.module, nn.MultiheadAttention)]
    assert layer.rule is FALLBACK
    assert _close(model.per_sample_gradients(flat, x, y)[0], _loop(model, flat, x[0], y[0]))


RNNS = {
    "rnn-tanh": lambda **options: nn.RNN(4, 3, **options),
    "rnn-relu": lambda **options: nn.RNN(4, 3, nonlinearity="relu", **options),
    "lstm": lambda **options: nn.LSTM(4, 3, **options),
    "gru": lambda **options: nn.GRU(4, 3, **options),
}


@pytest.mark.parametrize("layers, bidirectional", [(1, False), (1, True), (2, False),
                                                   (3, True)])
@pytest.mark.parametrize("cell", list(RNNS))
def test_the_recurrent_rule_equals_a_per_sample_loop_in_every_configuration(
        cell, layers, bidirectional):
    """Each recurrent layer, its layers and directions × batch_first × bias × an initial
    state (per sample) or none, on padded batches: the per-sample gradients of the whole model
    against the loop."""
    for batch_first, bias, state in itertools.product((False, True), repeat=3):
        options = {"num_layers": layers, "bidirectional": bidirectional,
                   "batch_first": batch_first, "bias": bias}
        model, flat, x, y = _prepared(lambda: Recurrent(RNNS[cell](**options), state), (5,),
                                      True, clients=1)
        [layer] = [layer for layer in model.flat.layers if isinstance(layer.module, nn.RNNBase)]
        assert layer.rule.per_sample is recurrent.recurrent
        assert _close(model.per_sample_gradients(flat, x, y)[0],
                      _loop(model, flat, x[0], y[0])), (batch_first, bias, state)


def test_recurrent_layers_have_their_own_rule_but_an_lstm_with_projections():
    for rnn in (nn.RNN(3, 2), nn.RNN(3, 2, nonlinearity="relu"), nn.LSTM(3, 2), nn.GRU(3, 2),
                nn.LSTM(3, 2, num_layers=2, bidirectional=True, batch_first=True, bias=False)):
        assert rule_for(rnn) is RULES[type(rnn)] and rule_for(rnn).whole
        assert rule_for(rnn).per_sample is recurrent.recurrent
    # the generic rule, one sample at a time (vmap has no batching rule for the fused kernels)
    projections = nn.LSTM(3, 4, proj_size=2)
    assert rule_for(projections) is recurrent.UNCOVERED is not FALLBACK
    assert recurrent.UNCOVERED.per_sample is per_sample_looped and recurrent.UNCOVERED.whole
    model = _setup("lstm-projections-generic")[0]
    assert [layer.rule for layer in model.flat.layers
            if isinstance(layer.module, nn.LSTM)] == [recurrent.UNCOVERED]


def test_a_frozen_recurrent_layer_is_left_out_and_a_partly_frozen_one_forms_its_trainable_part():
    model = _setup("gru-frozen")[0]
    assert not any(isinstance(layer.module, nn.RNNBase) for layer in model.flat.layers)
    assert model.d == 11 * 4 + (3 + 3 + 1) * CLASSES  # the embedding and the head
    model = _setup("lstm-partly-frozen")[0]
    [layer] = [layer for layer in model.flat.layers if isinstance(layer.module, nn.LSTM)]
    assert layer.names == ("weight_hh_l0", "bias_ih_l0", "weight_ih_l1", "weight_hh_l1",
                           "bias_ih_l1", "bias_hh_l1", "weight_ih_l1_reverse",
                           "bias_ih_l1_reverse", "bias_hh_l1_reverse")


def test_a_packed_sequence_is_refused_by_the_recurrent_rule_as_by_the_generic_one():
    for rnn in (nn.LSTM(4, 3, batch_first=True), nn.LSTM(4, 3, proj_size=2, batch_first=True)):
        model, flat, x, y = _prepared(lambda: Recurrent(rnn, packed=True), (5,), True)
        with pytest.raises(ValueError, match="LSTM on a PackedSequence .pad the sequences"):
            model.per_sample_gradients(flat, x, y)


def test_dropout_between_recurrent_layers_is_refused_in_training_mode():
    rnn = nn.GRU(4, 3, num_layers=2, dropout=0.5)
    _refused(Recurrent(rnn), r"'rnn' \(GRU\) draws dropout masks")
    FlatModel(Recurrent(rnn).eval(), "cross-entropy")


def test_a_linear_layer_on_sequences_clips_without_materialising_its_gradients(monkeypatch):
    model, flat, x, y = _setup("linear-on-sequences-ghost")
    expected = model.clipped_mean(flat, x, y, 0.5)
    materialise = grad_sample.materialise

    def no_sequence_linear(layer, a, g):
        assert not (type(layer.module) is nn.Linear and a.dim() > 2), "materialised"
        return materialise(layer, a, g)

    monkeypatch.setattr(grad_sample, "materialise", no_sequence_linear)
    means, norms = model.clipped_mean(flat, x, y, 0.5)
    assert torch.equal(means, expected[0]) and torch.equal(norms, expected[1])


@pytest.mark.parametrize("modules", [True, False])
def test_frozen_parameters_are_neither_trained_nor_clipped(modules):
    """A frozen pretrained network with LoRA adapters: the flat vector holds the adapters
    alone, so clipping and noise see only them, and the frozen weights travel unchanged."""
    model = FlatModel(_lora(modules), "cross-entropy")
    assert model.d == (12 * 2 + 2 * 10) + (10 * 2 + 2 * CLASSES)
    loaded = model.load_into(torch.zeros(model.d))
    assert torch.equal(loaded[1].base.weight, model.flat.template[1].base.weight)


def _refused(module: nn.Module, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as error:
        FlatModel(module, "cross-entropy")
    assert error.value.key == "model" and "\n" not in str(error.value)


@pytest.mark.parametrize("layer, match", [
    (nn.BatchNorm1d(4), r"'1' \(BatchNorm1d\) normalises with the batch's .* use GroupNorm"),
    (nn.SyncBatchNorm(4), r"'1' \(SyncBatchNorm\) .* use GroupNorm"),
    (nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
     r"running statistics.*track_running_stats=False"),
])
def test_layers_that_mix_samples_are_refused_naming_their_replacement(layer, match):
    _refused(nn.Sequential(nn.Conv1d(1, 4, 1), layer), match)


def test_an_embedding_scaled_by_the_batchs_token_counts_is_refused():
    _refused(nn.Sequential(nn.Embedding(5, 3, scale_grad_by_freq=True)), "scale_grad_by_freq")


def test_dropout_inside_a_module_the_generic_rule_recomputes_is_refused():
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)  # p = 0.1
    _refused(Tokens(layer), r"'body.self_attn' \(MultiheadAttention\) draws dropout masks")
    FlatModel(Tokens(layer.eval()), "cross-entropy")  # no dropout in evaluation mode


def test_a_sequence_first_transformer_layer_is_refused():
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)
    _refused(Tokens(layer), r"'body' \(TransformerEncoderLayer\).*use batch_first=True")


def test_tied_parameters_are_refused():
    embed, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    head.weight = embed.weight
    _refused(nn.Sequential(embed, head), r"'1.weight' is tied")
