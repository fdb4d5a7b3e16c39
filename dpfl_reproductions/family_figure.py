"""Accuracy against ε as small multiples: one panel per family of algorithms (matplotlib, no
display needed).

Each panel draws its family's algorithms, a colour and a marker each, mean ± std over the seeds
as error bars nudged apart along ε, over a grey band: the best algorithm of any family at each
ε, the same band in every panel, so that a family reads against the whole field. The panels
share a y axis zoomed to the algorithms that learn: one whose every mean is below half of the
best (at chance, in the benchmark) is left below the axis and named so in its panel's legend,
with its range. Legends sit below their panels, off the data."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from dpfl_reproductions.selection import mean_std  # noqa: E402

Stats = list[tuple[float, float]]  # per ε: mean and std over the seeds

OTHER = "other"  # the panel of the algorithms in no family
COLUMNS = 3
LINE = 11  # characters of a heading per inch of the figure's width
PANEL = (3.4, 3.3)  # inches per panel, legend included: three fit a README's width
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
           "tab:pink", "tab:olive", "tab:cyan")
MARKERS = "osD^v<>pP"
NUDGE = 0.04  # log-ε distance between neighbouring algorithms' points in a panel
OFF_AXIS = 0.5  # below this share of the best mean at every ε: left below the axis
BEST_LABEL = "grey: the best algorithm of any family at each ε"
HIDDEN_LABEL = "; ↓: below the axis, at its range"
BEST = {"color": "0.55", "linewidth": 7, "alpha": 0.35, "solid_capstyle": "round", "zorder": 0}


def panels(algorithms: Sequence[str], families: Mapping[str, Sequence[str]]
           ) -> dict[str, list[str]]:
    """``algorithms`` grouped by ``families`` (their order, each family's own order), the
    families with none of them dropped; those of no family last, under :data:`OTHER`."""
    grouped = {name: [a for a in members if a in algorithms]
               for name, members in families.items()}
    listed = {a for members in families.values() for a in members}
    grouped[OTHER] = [a for a in algorithms if a not in listed]
    return {name: members for name, members in grouped.items() if members}


def best_means(stats: Mapping[str, Stats]) -> list[float]:
    """Per ε, the highest mean of any algorithm."""
    return [max(column) for column in zip(*([m for m, _ in s] for s in stats.values()),
                                          strict=True)]


def off_axis(stats: Mapping[str, Stats], best: Sequence[float]) -> set[str]:
    """The algorithms whose every mean is below :data:`OFF_AXIS` of the best mean."""
    floor = OFF_AXIS * max(best)
    return {a for a, s in stats.items() if all(m < floor for m, _ in s)}


def y_limits(stats: Mapping[str, Stats], hidden: set[str]) -> tuple[float, float]:
    """The mean ± std of every algorithm not ``hidden``, padded, on multiples of 5 in 0–100."""
    ends = [(m - sd, m + sd) for a, s in stats.items() if a not in hidden for m, sd in s]
    low, high = min(e[0] for e in ends), max(e[1] for e in ends)
    pad = max(1.0, 0.05 * (high - low))
    return max(0.0, 5 * math.floor((low - pad) / 5)), min(100.0, 5 * math.ceil((high + pad) / 5))


def label(algorithm: str, stats: Stats, hidden: set[str]) -> str:
    """The algorithm's name; for one below the axis, with the range of its means."""
    if algorithm not in hidden:
        return algorithm
    means = [m for m, _ in stats]
    return f"{algorithm} (↓ {min(means):.0f}–{max(means):.0f}%)"


def draw_family(ax: Axes, family: str, stats: Mapping[str, Stats], epsilons: Sequence[float],
                best: Sequence[float], hidden: set[str]) -> None:
    """One panel: the family's algorithms (``stats``, in order) over the band of ``best``."""
    ax.plot(epsilons, best, **BEST)
    for i, (algorithm, s) in enumerate(stats.items()):
        shift = math.exp(NUDGE * (i - (len(stats) - 1) / 2))
        ax.errorbar([e * shift for e in epsilons], [m for m, _ in s], yerr=[sd for _, sd in s],
                    color=COLOURS[i % len(COLOURS)], marker=MARKERS[i % len(MARKERS)],
                    markersize=5, linewidth=1.6, capsize=2.5,
                    label=label(algorithm, s, hidden))
    ax.set_title(family, fontsize=11)
    ax.set(xscale="log", xlabel="ε", xlim=(min(epsilons) / 1.3, max(epsilons) * 1.3))
    ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
    ax.minorticks_off()
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False, fontsize=9,
              handlelength=1.8)


def family_figure(title: str, epsilons: Sequence[float],
                  accuracies: Mapping[str, Sequence[Sequence[float]]],
                  families: Mapping[str, Sequence[str]]) -> Figure:
    """Test accuracy (%) against ε, a panel per family present (:func:`panels`);
    ``accuracies``: per algorithm, per ε (in ``epsilons``' order), each seed's accuracy."""
    stats = {a: [mean_std(seeds) for seeds in per_epsilon]
             for a, per_epsilon in accuracies.items()}
    best = best_means(stats)
    hidden = off_axis(stats, best)
    groups = panels(list(accuracies), families)
    rows, columns = math.ceil(len(groups) / COLUMNS), min(len(groups), COLUMNS)
    width = PANEL[0] * max(columns, 2)  # the title and the band's legend fit in two
    fig, axes = plt.subplots(rows, columns, sharey=True, squeeze=False, layout="constrained",
                             figsize=(width, PANEL[1] * rows + 0.4))
    for ax, (family, members) in zip(axes.flat, groups.items()):
        draw_family(ax, family, {a: stats[a] for a in members}, epsilons, best, hidden)
    for ax in axes.flat[len(groups):]:
        ax.remove()
    axes[0, 0].set_ylim(*y_limits(stats, hidden))
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)")
    key = textwrap.fill(BEST_LABEL + (HIDDEN_LABEL if hidden else ""), int(LINE * (width - 1)))
    legend = fig.legend(handles=[Line2D([], [], **BEST)], labels=[key], frameon=False,
                        loc="outside upper center", fontsize=10, alignment="center",
                        title=textwrap.fill(title, int(LINE * width)), title_fontsize=12)
    legend.get_title().set_multialignment("center")
    return fig
