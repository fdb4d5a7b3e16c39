"""Small character-level models for next-character prediction: token ids ``[n, seq_len]`` in,
``[n, num_classes]`` logits for the character after the window out.

Every layer here has a per-sample rule of its own in dpfl (``Embedding``, ``LayerNorm``,
``Linear``, ``MultiheadAttention`` and the recurrent layers).
"""

from __future__ import annotations

import torch
from torch import nn


class CharRNN(nn.Module):
    """Embedding → one recurrent layer (``cell``: ``"lstm"`` or ``"gru"``) → its last output →
    Linear. McMahan et al. 2017 use an 8-dimensional embedding and two LSTM layers of 256; one
    smaller layer keeps a private step cheap."""

    def __init__(self, vocabulary: int, *, embedding: int, hidden: int, cell: str) -> None:
        super().__init__()
        layers = {"lstm": nn.LSTM, "gru": nn.GRU}
        if cell not in layers:
            raise ValueError(f"cell must be one of {sorted(layers)}, not {cell!r}")
        self.embed = nn.Embedding(vocabulary, embedding)
        self.rnn = layers[cell](embedding, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocabulary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out[:, -1])


class CharAttention(nn.Module):
    """Embedding plus a learned position embedding → ``layers`` pre-norm transformer encoder
    layers (causal, batch first, no dropout) → LayerNorm → Linear on the last position."""

    def __init__(self, vocabulary: int, seq_len: int, *, width: int, heads: int,
                 layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        h = self.embed(x) + self.position(positions)
        for block in self.blocks:
            h = block(h, src_mask=self.causal[:x.shape[1], :x.shape[1]])
        return self.head(self.norm(h[:, -1]))


def char_rnn(num_classes: int, *, embedding: int = 8, hidden: int = 64,
             cell: str = "lstm") -> nn.Module:
    """``model="model:char_rnn"``: :class:`CharRNN` over the ``num_classes`` characters."""
    return CharRNN(num_classes, embedding=embedding, hidden=hidden, cell=cell)


def char_attention(input_shape: tuple[int, ...], num_classes: int, *, width: int = 64,
                   heads: int = 4, layers: int = 1) -> nn.Module:
    """``model="model:char_attention"``: :class:`CharAttention` over windows of
    ``input_shape[0]`` characters."""
    return CharAttention(num_classes, input_shape[0], width=width, heads=heads, layers=layers)
