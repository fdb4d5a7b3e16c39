"""An ε lower bound from two score distributions, with Clopper-Pearson confidence.

A membership test on the audit's observations: call "canary in" when a run's score is at or
above a threshold t. If the mechanism is (ε, δ)-DP, every such test has
``FPR + e^ε·FNR ≥ 1 − δ`` and ``FNR + e^ε·FPR ≥ 1 − δ`` (Kairouz, Oh & Viswanath, "The
Composition Theorem for Differential Privacy", arXiv:1311.0776, Thm. 2.1), so

    ε ≥ max( ln((1 − δ − FPR)/FNR), ln((1 − δ − FNR)/FPR) ).

The rates are estimated from finite runs: Clopper-Pearson upper bounds on both (each at
confidence 1 − α/2, so both hold with probability ≥ 1 − α) give an ε that is a lower bound
with confidence 1 − α (Jagielski, Ullman & Oprea, "Auditing Differentially Private Machine
Learning: How Private is Private SGD?", arXiv:2006.07709, §3). The direction of the score and
the threshold are chosen on one half of the runs and the bound is computed on the other half,
so the choice does not bias the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta


def clopper_pearson_upper(errors: np.ndarray | int, trials: int,
                          confidence: float) -> np.ndarray:
    """One-sided upper confidence bound(s) on a rate from ``errors`` of ``trials``."""
    errors = np.asarray(errors)
    bound = beta.ppf(confidence, errors + 1, np.maximum(trials - errors, 1))
    return np.where(errors >= trials, 1.0, bound)


def epsilon_of_rates(fpr: float, fnr: float, delta: float) -> float:
    """The largest ε the two rates refute at ``delta`` (0 when they refute none)."""
    best = 0.0
    for a, b in ((fpr, fnr), (fnr, fpr)):
        if 1 - delta - a > 0:
            best = max(best, math.inf if b <= 0 else math.log((1 - delta - a) / b))
    return best


@dataclass(frozen=True)
class Bound:
    """The audit's verdict: ``epsilon`` is an ε lower bound with probability ≥
    ``confidence``; ``threshold`` and ``sign`` define the test (``sign·score ≥ threshold``
    says "in"), whose rates on the evaluation half are ``fpr``/``fnr`` of ``trials`` runs
    each."""

    epsilon: float
    confidence: float
    threshold: float
    sign: int
    fpr: float
    fnr: float
    trials: int
    empirical: float  # ε of the evaluation half's rates, without confidence intervals


def _best_threshold(out: np.ndarray, inn: np.ndarray, delta: float,
                    confidence: float) -> tuple[float, int]:
    """The threshold and sign whose rates, with their Clopper-Pearson bounds at
    ``confidence``, give the largest ε on the selection half."""
    best = (-1.0, 0.0, 1)
    for sign in (1, -1):
        o, i = np.sort(sign * out), np.sort(sign * inn)
        thresholds = np.unique(np.concatenate([o, i]))
        false_pos = len(o) - np.searchsorted(o, thresholds, side="left")
        false_neg = np.searchsorted(i, thresholds, side="left")
        fpr = clopper_pearson_upper(false_pos, len(o), confidence)
        fnr = clopper_pearson_upper(false_neg, len(i), confidence)
        eps = [epsilon_of_rates(a, b, delta) for a, b in zip(fpr, fnr, strict=True)]
        k = int(np.argmax(eps))
        if eps[k] > best[0]:
            best = (eps[k], float(thresholds[k]), sign)
    return best[1], best[2]


def epsilon_lower_bound(out: np.ndarray, inn: np.ndarray, *, delta: float,
                        confidence: float = 0.95) -> Bound:
    """The audit's ε lower bound from scores of runs without (``out``) and with (``inn``)
    the canary: the test is chosen on the first half of each, evaluated on the second."""
    out, inn = np.asarray(out, dtype=np.float64), np.asarray(inn, dtype=np.float64)
    if not (np.isfinite(out).all() and np.isfinite(inn).all()):
        raise ValueError("the audit's scores are not all finite: the runs diverged")
    half_o, half_i = len(out) // 2, len(inn) // 2
    alpha = 1 - confidence
    threshold, sign = _best_threshold(out[:half_o], inn[:half_i], delta, 1 - alpha / 2)
    o, i = sign * out[half_o:], sign * inn[half_i:]
    false_pos, false_neg = int((o >= threshold).sum()), int((i < threshold).sum())
    fpr_u = float(clopper_pearson_upper(false_pos, len(o), 1 - alpha / 2))
    fnr_u = float(clopper_pearson_upper(false_neg, len(i), 1 - alpha / 2))
    return Bound(epsilon=epsilon_of_rates(fpr_u, fnr_u, delta), confidence=confidence,
                 threshold=threshold, sign=sign, fpr=false_pos / len(o), fnr=false_neg / len(i),
                 trials=min(len(o), len(i)),
                 empirical=epsilon_of_rates(false_pos / len(o), false_neg / len(i), delta))
