"""The run monitor: the warnings a run says once and keeps for its summary — divergence, noise
that dwarfs the signal, a node whose ledger disagrees with the server's."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from dpfl.algorithms import Exchange
from dpfl.privacy import Accounting
from dpfl.problem import Problem

log = logging.getLogger("dpfl")

NOISE_WARNING = 100.0  # noise norm of the participants' average over the clip, to warn above

_LOGGED: set[str] = set()  # what runs that do not echo (sweeps, reproductions) logged so far


def log_once(text: str) -> None:
    """Log a run's warning once per process: a sweep's runs share their warnings (their
    summaries keep them, each its own)."""
    if text not in _LOGGED:
        _LOGGED.add(text)
        log.warning(text)


def say(text: str, echo: bool) -> None:
    """``text`` as a warning: on the console when the run echoes, else in the log (once)."""
    if echo:
        print(f"WARNING: {text}", flush=True)
    else:
        log_once(text)


class RunMonitor:
    """Checks a run's progress and says what it finds once (console, or the log when not
    echoing), keeping it for the summary (:attr:`warnings`)."""

    def __init__(self, problem: Problem, echo: bool) -> None:
        self.problem = problem
        self.echo = echo
        self.warnings: list[str] = []  # said once each, kept in the summary
        self.first_loss: float | None = None  # the initial model's test loss
        self.noise_checked: set[tuple[str, str]] = set()  # (exchange, upload) compared
        self.reported: dict[int, dict[str, int]] = {}  # each client's counts, as its node said
        self.flagged: set[int] = set()  # clients whose node lost its ledger

    def warn(self, text: str) -> None:
        """Say ``text`` once and keep it for the summary."""
        if text not in self.warnings:
            self.warnings.append(text)
            say(text, self.echo)

    def check_divergence(self, server_round: int, loss: float) -> None:
        """Warn, once, when the test loss is not finite or has grown past 10× that of the
        initial model: the step size (or the noise) is too large for the model to learn."""
        first, config = self.first_loss, self.problem.config
        if not math.isfinite(loss) or (first is not None and first > 0 and loss > 10 * first):
            if any(w.startswith("the test loss diverged") for w in self.warnings):
                return
            start = ("" if first is None or not math.isfinite(loss)
                     else f", {loss / first:.3g}× the initial model's {first:.4g}")
            steps = [f"{key} (now {config[key]:g})"
                     for key in ("learning-rate", "server-learning-rate")
                     if key == "learning-rate" or config[key] != 1]
            self.warn(f"the test loss diverged: {loss:.4g} at round {server_round}{start}; "
                      f"lower {' or '.join(steps)}, or the noise")

    def check_noise(self, exchange: Exchange, sums: dict[str, torch.Tensor], participants: int,
                    clip: float) -> None:
        """Warn, once per upload, when the noise a client adds to it dwarfs what its clip
        lets through: the noise's norm, std·√(entries), over the clip radius ``clip`` that
        bounds the upload's signal, is above :data:`NOISE_WARNING` even after averaging over
        the participants (a ratio that public quantities give: no reply is read)."""
        pending = {n: u for n, u in exchange.uploads.items()
                   if (exchange.name, n) not in self.noise_checked}
        if not pending or not clip or not math.isfinite(clip):
            return
        releases = {r.name: r for r in self.problem.releases(0)}
        for name, upload in pending.items():
            self.noise_checked.add((exchange.name, name))
            release = releases.get(upload.release)
            if (upload.sent_as_returned or release is None or not release.noise_multiplier
                    or name not in sums):
                continue
            radius = release.radius if release.radius is not None else clip
            std = release.std(radius)
            norm = std * math.sqrt(sums[name].numel())
            # K noisy steps add K clipped signals but only √K noises
            ratio = norm / clip / math.sqrt(release.steps * participants)
            if ratio > NOISE_WARNING:
                # without sampling amplification (every record behind every release), a
                # larger batch does not lower the noise
                levers = ("epsilon, batch-size or the clients per round"
                          if release.sample_rate < 1 else "epsilon or the clients per round")
                self.warn(f"the noise dwarfs the signal: each client's upload {name!r} gets "
                          f"noise of norm {norm:.3g} a step (std {std:.3g} on each of "
                          f"{sums[name].numel()} entries), {norm / clip:.3g}× the clip "
                          f"{clip:.3g} that bounds a step's signal; over {release.steps} "
                          f"step(s) and {participants} participants still {ratio:.3g}×: "
                          f"expect little learning (raise {levers})")

    def check_reports(self, server_round: int, reported: dict[int, dict[str, int]],
                      accounting: Accounting) -> None:
        """Reconcile the server's ledger ``accounting``, the authority, with each client's
        counts of the run's releases as its node reports them (``reported``: client → release
        name → count). What a node counts beyond the server's ledger was released (an
        interrupted attempt's rounds after its checkpoint, a round answered again with fresh
        noise): charge it, and say so. A node that counts fewer than the server, or than it
        reported before, lost its ledger (a wiped state folder): say so, once per client; the ε
        reported stays the server's."""
        for c, counts in sorted(reported.items()):
            behind, extra = accounting.reconcile(c, counts)
            before = self.reported.get(c, {})
            self.reported[c] = dict(counts)
            if extra:
                what = ", ".join(f"{n} × {name!r}" for name, n in sorted(extra.items()))
                self.warn(f"client {c}'s node reports releases the server's ledger did not "
                          f"hold ({what}, by round {server_round}): an interrupted attempt's "
                          f"after its checkpoint, or a round answered again with fresh noise; "
                          f"they are charged")
            fell = any(counts.get(name, 0) < n for name, n in before.items())
            if c in self.flagged or not (behind or fell):
                continue
            self.flagged.add(c)
            self.warn(f"client {c}'s node reports fewer releases at round {server_round} than "
                      f"the server's ledger holds: it lost its ledger (its state folder wiped) "
                      f"and its own budget guard restarted with it; the ε reported here is the "
                      f"server's ledger, which keeps every round")

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the monitor."""
        return {"warnings": self.warnings, "first_loss": self.first_loss,
                "noise_checked": [list(k) for k in sorted(self.noise_checked)],
                "reported": self.reported, "flagged": sorted(self.flagged)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.warnings = list(saved["warnings"])
        self.first_loss = saved["first_loss"]
        self.noise_checked = {(e, u) for e, u in saved["noise_checked"]}
        self.reported = {int(c): dict(counts) for c, counts in saved["reported"].items()
                         if isinstance(counts, dict)}
        self.flagged = set(saved["flagged"])
