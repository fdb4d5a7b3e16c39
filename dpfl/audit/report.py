"""An audit's folder: ``audit.json`` (the verdict and the run config), ``scores.npz`` (every
run's score) and ``scores.png`` (the two score distributions and the test's threshold)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpfl.audit import AuditResult  # noqa: E402
from dpfl.results import jsonable  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402


def verdict(result: AuditResult) -> str:
    """One line: the bound, the ledger's ε and what their ratio says."""
    b = result.bound
    ledger = result.epsilon_ledger
    head = (f"{result.algorithm}: ε_lower = {b.epsilon:.3g} ({100 * b.confidence:g}% "
            f"confidence, {b.trials} + {b.trials} evaluation runs) vs the ledger's ε = "
            f"{ledger:.4g} at δ = {result.delta:g} after {result.rounds} rounds")
    if math.isfinite(ledger) and b.epsilon > ledger:
        return f"{head}: the audit REFUTES the ledger (ratio {result.ratio:.3g})"
    return f"{head}: consistent (ratio {result.ratio:.3g})"


def plot(result: AuditResult, path: Path) -> None:
    """The score histograms of the runs without and with the canary, and the threshold."""
    b = result.bound
    fig, ax = plt.subplots(figsize=(6.4, 3.8), layout="constrained")
    out, inn = b.sign * result.scores_out, b.sign * result.scores_in
    bins = np.histogram_bin_edges(np.concatenate([out, inn]), bins=60)
    ax.hist(out, bins=bins, alpha=0.6, label="without the canary (D)")
    ax.hist(inn, bins=bins, alpha=0.6, label="with the canary (D')")
    ax.axvline(b.threshold, color="black", linestyle=":", label="threshold")
    ax.set(xlabel="score along the canary's gradient", ylabel="runs",
           title=f"{result.algorithm}: ε_lower {b.epsilon:.3g} vs ledger ε "
                 f"{result.epsilon_ledger:.3g}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=3, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: AuditResult, config: RunConfig, folder: Path) -> Path:
    """Write the audit's folder (created, with its parents) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {**result.summary(), "run_config": config.as_dict(),
              "verdict": verdict(result)}
    (folder / "audit.json").write_text(json.dumps(jsonable(record), indent=2) + "\n")
    np.savez_compressed(folder / "scores.npz", without_canary=result.scores_out,
                        with_canary=result.scores_in)
    plot(result, folder / "scores.png")
    return folder
