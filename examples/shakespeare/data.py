"""Tiny Shakespeare split by speaking role: next-character prediction, one client per role.

This is the federated Shakespeare benchmark of McMahan et al. 2017 ("Communication-efficient
learning of deep networks from decentralized data", AISTATS 2017, §3), as LEAF builds it from
the complete works, here built from ``shakespeare/input.txt`` (Tiny Shakespeare, char-rnn's
40,000-line selection) in the run's data folder:

* The file is a sequence of speeches separated by blank lines; each speech opens with its
  speaker's name on a line of its own, ending in ``:``. A role is a speaker's name. Names are
  not qualified by play (the file does not mark plays), so ``GLOUCESTER`` of Richard III and of
  Henry VI are one role, as are the ``First Citizen`` of every play. The file has 309 roles
  (299 with at least one line of speech).
* A role's text is its speeches in the order of the file, without the name lines, joined by
  newlines. Its first ``1 - test_fraction`` of characters are its training speech, the rest its
  held-out speech (McMahan et al. hold out the last 20% of each role's lines).
* ``validation=true`` leaves the held-out speech out and splits the training speech the same
  way again: its last ``test_fraction`` becomes the held-out part that the run evaluates on, for
  choosing hyperparameters without the held-out speech.
* A record is a window of ``seq_len`` characters labelled by the character after it; windows
  start every ``stride`` characters and lie wholly inside one part, so no evaluation record
  shares a character with a training record.
* A role is kept if, split for validation, it gives at least ``min_samples`` training windows
  and at least one validation window (so at least ``seq_len + 1`` characters there: with the
  defaults, a role needs about 500 characters of speech). The rule does not depend on
  ``validation``, so both settings keep the same roles. ``max_clients`` keeps the roles with
  the most speech (ties by name); ``max_samples_per_client`` and
  ``max_test_samples_per_client`` then keep that many of each role's training and evaluation
  windows, drawn with the run's seed and kept in their order.
* Characters are token ids (int64) over a fixed vocabulary: the sorted characters of the whole
  file (65), so ``num_classes`` is the same whichever roles are kept.

Each kept role is one client (``clients``: one role per training record, in the order of the
roles above): run it with ``partitioner="natural"`` and ``num-partitions`` the number of roles
kept (``python data.py`` prints it for the default options).

A record is one window. With ``stride`` s below ``seq_len + 1`` a character is in up to
⌈(seq_len + 1)/s⌉ windows, so record-level DP protects one window; a line of speech is covered
only through group privacy over the windows that hold it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE = Path("shakespeare") / "input.txt"


@dataclass(frozen=True)
class Role:
    """One speaking role: its name, its training windows and its evaluation windows (token
    ids; the held-out speech's, or with ``validation`` the validation part's)."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


def speeches(text: str) -> dict[str, list[str]]:
    """Each speaker's speeches, in the order of the file, without the name lines (a speech
    with no line besides the name adds nothing)."""
    by_role: dict[str, list[str]] = {}
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if not lines[0].endswith(":"):
            raise ValueError(f"a speech does not open with its speaker's name: {lines[0]!r}")
        by_role.setdefault(lines[0][:-1], [])
        if len(lines) > 1:
            by_role[lines[0][:-1]].append("\n".join(lines[1:]))
    return by_role


def windows(ids: np.ndarray, *, seq_len: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows ``ids[s : s + seq_len]`` labelled by ``ids[s + seq_len]``, for s = 0, stride,
    2·stride, ...: ``[n, seq_len]`` and ``[n]``."""
    starts = np.arange(0, max(len(ids) - seq_len, 0), stride)
    x = ids[starts[:, None] + np.arange(seq_len)[None, :]]
    return x.reshape(len(starts), seq_len), ids[starts + seq_len]


def _some(rng: np.random.Generator, x: np.ndarray, y: np.ndarray, most: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """``most`` of the windows ``x, y``, drawn without replacement, in their order (all at 0)."""
    if not 0 < most < len(y):
        return x, y
    keep = np.sort(rng.choice(len(y), most, replace=False))
    return x[keep], y[keep]


def roles(*, data_dir: Path, seed: int = 0, seq_len: int = 80, stride: int = 1,
          test_fraction: float = 0.2, validation: bool = False, min_samples: int = 64,
          max_samples_per_client: int = 1000, max_test_samples_per_client: int = 200,
          max_clients: int = 0) -> tuple[list[Role], str]:
    """The kept roles (module docstring), most speech first, and the vocabulary. The caps at 0
    keep everything."""
    if seq_len < 1 or stride < 1 or not 0 < test_fraction < 1:
        raise ValueError("seq_len and stride must be at least 1, test_fraction in (0, 1)")
    text = (Path(data_dir) / FILE).read_text(encoding="utf-8")
    vocabulary = "".join(sorted(set(text)))
    lookup = np.zeros(max(map(ord, vocabulary)) + 1, dtype=np.int64)
    lookup[[ord(c) for c in vocabulary]] = np.arange(len(vocabulary))
    texts = {name: "\n".join(said) for name, said in speeches(text).items()}

    def split(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cut = int(len(ids) * (1 - test_fraction))
        return ids[:cut], ids[cut:]

    rng = np.random.default_rng(seed)
    kept = []
    for name in sorted(texts, key=lambda name: (-len(texts[name]), name)):
        train, test = split(lookup[np.frombuffer(texts[name].encode("ascii"), dtype=np.uint8)])
        fit, held = split(train)
        if (len(windows(fit, seq_len=seq_len, stride=stride)[1]) < min_samples
                or len(windows(held, seq_len=seq_len, stride=stride)[1]) == 0):
            continue
        if validation:
            train, test = fit, held
        train_x, train_y = windows(train, seq_len=seq_len, stride=stride)
        test_x, test_y = windows(test, seq_len=seq_len, stride=stride)
        kept.append(Role(name, *_some(rng, train_x, train_y, max_samples_per_client),
                         *_some(rng, test_x, test_y, max_test_samples_per_client)))
        if len(kept) == max_clients:
            break
    return kept, vocabulary


def shakespeare(*, data_dir: Path, seed: int, seq_len: int = 80, stride: int = 1,
                test_fraction: float = 0.2, validation: bool = False, min_samples: int = 64,
                max_samples_per_client: int = 1000, max_test_samples_per_client: int = 200,
                max_clients: int = 0) -> dict[str, object]:
    """The data callable: ``dataset="data:shakespeare"`` (module docstring). The test set is
    every kept role's evaluation windows."""
    kept, vocabulary = roles(
        data_dir=data_dir, seed=seed, seq_len=seq_len, stride=stride,
        test_fraction=test_fraction, validation=validation, min_samples=min_samples,
        max_samples_per_client=max_samples_per_client,
        max_test_samples_per_client=max_test_samples_per_client, max_clients=max_clients)
    if not kept:
        raise ValueError("no role has min_samples training windows; lower min_samples")
    return {"train_x": np.concatenate([role.train_x for role in kept]),
            "train_y": np.concatenate([role.train_y for role in kept]),
            "test_x": np.concatenate([role.test_x for role in kept]),
            "test_y": np.concatenate([role.test_y for role in kept]),
            "num_classes": len(vocabulary),
            "clients": np.repeat(np.arange(len(kept)), [len(role.train_y) for role in kept])}


if __name__ == "__main__":  # the roles the default options keep, for num-partitions
    found, characters = roles(data_dir=Path(os.environ["DPFL_DATA_DIR"]))
    print(f"{len(found)} roles, {sum(len(r.train_y) for r in found)} training windows, "
          f"{sum(len(r.test_y) for r in found)} test windows, {len(characters)} characters")
