"""An audit's folder: ``audit.json`` (the verdict and the run config), ``scores.npz`` (every
run's score) and ``scores.png`` (the two score distributions and the test's threshold; the
empirical, fitted and ledger trade-off curves)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy.stats import norm  # noqa: E402

from dpfl.audit import AuditResult  # noqa: E402
from dpfl.audit.one_run import OneRunResult  # noqa: E402
from dpfl.results import jsonable  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402


def verdict(result: AuditResult) -> str:
    """One line: the bound, the ledger's ε and what their ratio says."""
    b = result.bound
    ledger = result.epsilon_ledger
    head = (f"{result.algorithm}: ε_lower = {b.epsilon:.3g} ({100 * b.confidence:g}% "
            f"confidence, {b.trials} + {b.trials} evaluation runs) vs the ledger's ε = "
            f"{ledger:.4g} at δ = {result.delta:g} after {result.rounds} rounds")
    g = result.gaussian
    fitted = (f"; Gaussian-DP fit: μ = {g.mu:.3g}, ε ≈ {g.epsilon:.3g} ({g.epsilon_lower:.3g} at "
              f"{100 * g.confidence:g}% confidence under the fit's Gaussian model)")
    if math.isfinite(ledger) and b.epsilon > ledger:
        return f"{head}: the audit REFUTES the ledger (ratio {result.ratio:.3g}){fitted}"
    if math.isfinite(ledger) and g.epsilon_lower > ledger:
        return (f"{head}: consistent (ratio {result.ratio:.3g}){fitted}: the fit puts ε above "
                f"the ledger's, which the ledger's noise cannot give if the scores are Gaussian")
    return f"{head}: consistent (ratio {result.ratio:.3g}){fitted}"


def trade_off(out: np.ndarray, inn: np.ndarray, sign: int) -> tuple[np.ndarray, np.ndarray]:
    """The empirical trade-off curve of the tests "``sign``·score ≥ t says in" over every
    threshold t: (false positive rate, false negative rate) pairs, FPR decreasing."""
    o, i = np.sort(sign * out), np.sort(sign * inn)
    thresholds = np.concatenate([[-np.inf], np.unique(np.concatenate([o, i])), [np.inf]])
    fpr = 1 - np.searchsorted(o, thresholds, side="left") / len(o)
    fnr = np.searchsorted(i, thresholds, side="left") / len(i)
    return fpr, fnr


def plot(result: AuditResult, path: Path) -> None:
    """Left: the score histograms of the runs without and with the canary, and the threshold.
    Right: the trade-off curves (type II error against type I), empirical over every threshold,
    of the fitted μ-GDP (Φ(Φ⁻¹(1 − α) − μ)) and of the ledger's (ε, δ) (the lowest any
    (ε, δ)-DP mechanism allows); a curve below the ledger's would refute it."""
    b, g = result.bound, result.gaussian
    fig, (ax, tr) = plt.subplots(1, 2, figsize=(10.4, 4.0), layout="constrained")
    out, inn = b.sign * result.scores_out, b.sign * result.scores_in
    bins = np.histogram_bin_edges(np.concatenate([out, inn]), bins=60)
    ax.hist(out, bins=bins, alpha=0.6, label="without the canary (D)")
    ax.hist(inn, bins=bins, alpha=0.6, label="with the canary (D')")
    ax.axvline(b.threshold, color="black", linestyle=":", label="threshold")
    ax.set(xlabel="score along the canary's gradient", ylabel="runs",
           title=f"{result.algorithm}: ε_lower {b.epsilon:.3g}, Gaussian fit ε ≈ "
                 f"{g.epsilon:.3g}, ledger ε {result.epsilon_ledger:.3g}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=3, frameon=False)
    alpha = np.linspace(0, 1, 401)
    fpr, fnr = trade_off(result.scores_out, result.scores_in, b.sign)
    tr.step(fpr, fnr, where="post", label="empirical")
    if math.isfinite(g.mu):
        tr.plot(alpha, norm.cdf(norm.ppf(1 - alpha) - g.mu), label=f"{g.mu:.3g}-GDP (fit)")
    eps, delta = result.epsilon_ledger, result.delta
    if math.isfinite(eps):
        ledger = np.maximum.reduce([np.zeros_like(alpha), 1 - delta - math.exp(eps) * alpha,
                                    math.exp(-eps) * (1 - delta - alpha)])
        tr.plot(alpha, ledger, linestyle="--", color="black", label=f"ledger (ε = {eps:.3g})")
    tr.set(xlabel="type I error (FPR)", ylabel="type II error (FNR)", xlim=(0, 1),
           ylim=(0, 1), aspect="equal", title="trade-off curves")
    tr.legend(loc="upper right", frameon=False)
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


def write_one_run(result: OneRunResult, config: RunConfig, folder: Path) -> tuple[Path, str]:
    """Write a one-run audit's folder (``audit.json``) and return it with its verdict line."""
    line = (f"{result.algorithm}: one run, {result.canaries} canaries, {result.correct} of "
            f"{result.guesses} guesses right: ε_lower = {result.epsilon_lower:.3g} "
            f"({100 * result.confidence:g}% confidence) vs the ledger's ε = "
            f"{result.epsilon_ledger:.4g} at δ = {result.delta:g} after {result.rounds} rounds: "
            + ("the audit REFUTES the ledger" if result.epsilon_lower > result.epsilon_ledger
               else "consistent"))
    folder.mkdir(parents=True, exist_ok=True)
    record = {**result.summary(), "method": "one-run", "run_config": config.as_dict(),
              "verdict": line}
    (folder / "audit.json").write_text(json.dumps(jsonable(record), indent=2) + "\n")
    return folder, line
