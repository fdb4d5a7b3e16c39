"""PNG plots of a run's per-round records (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(rounds: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["round"], r[key]) for r in rounds if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_rounds(rounds: list[dict[str, Any]], folder: Path) -> None:
    """``metrics.png`` (loss and accuracy vs round) and ``epsilon.png`` (ε vs round)."""
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("train_loss", "train loss (client batches)"), ("test_loss", "test loss")):
        ax_loss.plot(*_series(rounds, key), label=label)
    ax_loss.set(xlabel="round", ylabel="loss")
    ax_loss.legend()
    ax_acc.plot(*_series(rounds, "test_accuracy"), color="tab:green")
    ax_acc.set(xlabel="round", ylabel="test accuracy")
    fig.tight_layout()
    fig.savefig(folder / "metrics.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(*_series(rounds, "epsilon_max"), label="max over clients")
    ax.plot(*_series(rounds, "epsilon_min"), label="min over clients", linestyle="--")
    ax.set(xlabel="round", ylabel="ε (accountant)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "epsilon.png", dpi=100)
    plt.close(fig)
