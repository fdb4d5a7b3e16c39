"""``summary.png``: a run's accuracy, loss and ε against the round, in one figure that names
the run (matplotlib, no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def _series(rounds: list[dict[str, Any]], key: str, scale: float = 1.0
            ) -> tuple[list[int], list[float]]:
    pts = [(r["round"], scale * r[key]) for r in rounds
           if r.get(key) is not None and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_summary(rounds: list[dict[str, Any]], folder: Path, *, title: str,
                 chance: float | None) -> None:
    """``summary.png``: test accuracy in % on a 0–100 axis with chance level (``chance``, a
    fraction; None for a task without accuracy) marked, the losses (log axis when they span
    more than a factor 20), and ε of the most and least spent clients; ``title`` names the
    run. Legends sit below the axes, off the data."""
    accuracy = _series(rounds, "test_accuracy", 100.0)
    panels = 3 if accuracy[0] else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), layout="constrained")
    fig.suptitle(title)
    if accuracy[0]:
        ax = axes[0]
        ax.plot(*accuracy, color="tab:green", label="test accuracy")
        if chance is not None:
            ax.axhline(100 * chance, color="grey", linestyle=":", label="chance")
        ax.set(xlabel="round", ylabel="test accuracy (%)", ylim=(0, 100))
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=2, frameon=False)
    ax = axes[-2]
    losses = []
    for key, label in (("train_loss", "train loss (client batches)"), ("test_loss", "test loss")):
        series = _series(rounds, key)
        if series[0]:
            ax.plot(*series, label=label)
            losses += series[1]
    if losses and min(losses) > 0 and max(losses) > 20 * min(losses):
        ax.set_yscale("log")
    ax.set(xlabel="round", ylabel="loss")
    if losses:  # a run stopped before its first evaluation has none
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=2, frameon=False)
    ax = axes[-1]
    ax.plot(*_series(rounds, "epsilon_max"), label="most spent client")
    ax.plot(*_series(rounds, "epsilon_min"), linestyle="--", label="least spent client")
    ax.set(xlabel="round", ylabel="ε (accountant)")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=2, frameon=False)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    fig.savefig(folder / "summary.png", dpi=100)
    plt.close(fig)
