"""The server side of a run, shared by the Flower strategy and the engine.

It holds the server state, picks participants, applies ``server_step`` to the
uploads (stacked in client-id order, so every runtime sums in the same order),
evaluates the global model centrally, enforces ``max-epsilon`` and writes the
results folder.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch

from dpfl.algorithms import State
from dpfl.config import check_runtime
from dpfl.privacy import Randomness
from dpfl.problem import Problem
from dpfl.results import ResultsWriter, results_path

log = logging.getLogger("dpfl")


def stack_uploads(uploads: dict[int, State]) -> tuple[list[int], State]:
    """Client ids in increasing order and their uploads stacked along axis 0."""
    ids = sorted(uploads)
    keys = uploads[ids[0]].keys() if ids else ()
    return ids, {k: torch.stack([uploads[c][k] for c in ids]) for k in keys}


class ServerRuntime:
    """Server state, central evaluation, budget stop and results of one run."""

    def __init__(self, problem: Problem, runtime: str, *, echo: bool = True) -> None:
        check_runtime(problem.config, runtime)
        self.problem = problem
        self.config = cfg = problem.config
        self.runtime = runtime
        self.echo = echo
        self.state = problem.algorithm.init_server_state(problem.x0.to(problem.device))
        self.rng = Randomness(int(cfg["seed"]), secure=bool(cfg["secure-noise"]))
        self.path = results_path(cfg, runtime)
        self.results: ResultsWriter | None = None
        self.epsilon: dict[int, float] = {}
        self.epsilon_next: dict[int, float] = {}
        self.started = time.perf_counter()
        self.round_started = self.started
        self.last_eval: dict[str, Any] = {}
        self.stop_reason = ""
        self.rounds_done = 0

    # ---- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Create the results folder (call once inputs are known to be valid)."""
        p = self.problem
        meta = {
            "runtime": self.runtime,
            "algorithm": {"name": p.algorithm.name, "protection": p.algorithm.protection,
                          "relation": p.algorithm.relation},
            "num_params": p.model.d,
            "client_sizes": [len(part) for part in p.partitions],
            "releases": {c: [r.__dict__ for r in p.releases(c)] for c in range(p.num_clients)},
        }
        self.results = ResultsWriter(self.path, self.config, meta)
        self.started = time.perf_counter()

    def should_stop(self, round: int) -> bool:
        """True (and the reason recorded) when ``round`` must not run."""
        limit = float(self.config["max-epsilon"])
        if limit > 0 and self.epsilon_next and max(self.epsilon_next.values()) > limit:
            self.stop_reason = (f"max-epsilon: round {round} would take ε to "
                                f"{max(self.epsilon_next.values()):.4g} > {limit:g}")
            return True
        return False

    def participants(self, round: int) -> list[int]:
        """The clients of ``round``, in increasing id order."""
        return sorted(self.problem.algorithm.participants(
            round, list(range(self.problem.num_clients)), self.rng))

    def broadcast(self, exchange: str, round: int) -> State:
        if exchange == self.problem.algorithm.exchanges[0]:
            self.round_started = time.perf_counter()
        return self.problem.algorithm.broadcast(exchange, self.state, round)

    def aggregate(self, exchange: str, round: int, ids: list[int], uploads: State) -> None:
        """``server_step`` on ``uploads`` stacked along axis 0 in the order of ``ids``
        (increasing client id, see ``stack_uploads``)."""
        if ids != sorted(ids):
            raise ValueError("uploads must be stacked in increasing client-id order")
        uploads = {k: v.to(self.problem.device) for k, v in uploads.items()}
        self.state = self.problem.algorithm.server_step(exchange, self.state, uploads, ids, round)

    # ---- per round -------------------------------------------------------------------
    @functools.cached_property
    def _test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        ds, device = self.problem.dataset, self.problem.device
        return ds.test_x.to(device), ds.test_y.to(device)

    @functools.cached_property
    def _train_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        ds, device = self.problem.dataset, self.problem.device
        return ds.train_x.to(device), ds.train_y.to(device)

    def evaluate(self) -> dict[str, Any]:
        """Test loss/accuracy of the global model (and, with eval-train, the full training
        objective and ‖∇F‖); data is moved to the device once per run."""
        params = self.problem.algorithm.global_params(self.state)
        with torch.no_grad():
            res = self.problem.model.evaluate(params, *self._test_set)
        out = {"test_loss": float(res["loss"]),
               "test_accuracy": None if res.get("accuracy") is None else float(res["accuracy"])}
        if self.config["eval-train"]:
            x, y = self._train_set
            with torch.no_grad():
                out["train_loss_full"] = float(self.problem.model.evaluate(params, x, y)["loss"])
            grad = self.problem.model.full_gradient(params, x, y)
            out["grad_norm"] = float(torch.linalg.vector_norm(grad.double()))
        return out

    def end_round(self, round: int, metrics: dict[int, dict[str, float]]) -> dict[str, Any]:
        """Record round ``round`` from the participants' metrics (keyed by client id)."""
        for c, m in metrics.items():
            self.epsilon[c] = float(m["epsilon"])
            self.epsilon_next[c] = float(m["epsilon-next"])
        rounds = int(self.config["num-server-rounds"])
        record: dict[str, Any] = {"round": round}
        for key in sorted({k for m in metrics.values() for k in m} - {"epsilon", "epsilon-next"}):
            values = [m[key] for m in metrics.values() if key in m]
            record[key.replace("-", "_")] = sum(values) / len(values)
        if round % int(self.config["eval-every"]) == 0 or round == rounds:
            self.last_eval = self.evaluate()
            record.update(self.last_eval)
        eps = [self.epsilon[c] for c in sorted(self.epsilon)]
        record.update({
            "epsilon": {c: self.epsilon[c] for c in sorted(self.epsilon)},
            "epsilon_max": max(eps), "epsilon_min": min(eps),
            "clip": record.pop("clip", float(self.config["clip"])),
            "participants": len(metrics),
            "seconds": time.perf_counter() - self.round_started,
        })
        self.rounds_done = round
        assert self.results is not None
        self.results.add_round(record)
        if self.echo:
            print(self.describe(record, rounds), flush=True)
        return record

    def describe(self, r: dict[str, Any], rounds: int) -> str:
        parts = [f"round {r['round']:>{len(str(rounds))}}/{rounds}"]
        if r.get("train_loss") is not None:
            parts.append(f"train loss {r['train_loss']:.4f}")
        if "test_loss" in r:
            acc = r.get("test_accuracy")
            parts.append(f"test loss {r['test_loss']:.4f}"
                         + (f" acc {100 * acc:5.2f}%" if acc is not None else ""))
        parts.append(f"ε max {r['epsilon_max']:.3g} (δ={self.config['delta']:g})")
        parts.append(f"{r['seconds']:.2f} s")
        return " | ".join(parts)

    def calibration_check(self) -> str | None:
        """How the ε the noise was calibrated for compares with the accountant's ε of the
        noise actually used (None when noise-multiplier was given directly)."""
        cfg = self.config
        if float(cfg["noise-multiplier"]) >= 0 or not self.epsilon:
            return None
        target, spent = float(cfg["epsilon"]), max(self.epsilon.values())
        if spent > target * 1.01:
            verdict = "looser than the accountant: the accountant's ε exceeds the target"
        elif spent < target * 0.99:
            verdict = "tighter than the accountant: the accountant's ε is below the target"
        else:
            verdict = "matched by the accountant"
        return (f"calibration={cfg['calibration']} for ε={target:g}: the {cfg['accountant']} "
                f"accountant gives ε={spent:.4g} at δ={cfg['delta']:g} after {self.rounds_done} "
                f"rounds; the mapping is {verdict}")

    def finish(self) -> dict[str, Any]:
        """Write summary, model and plots; returns the summary."""
        p = self.problem
        wall = time.perf_counter() - self.started
        if self.rounds_done and not self.last_eval:
            self.last_eval = self.evaluate()
        summary = {
            "runtime": self.runtime,
            "rounds_completed": self.rounds_done,
            "stopped_early": self.stop_reason or None,
            **self.last_eval,
            "epsilon_max": max(self.epsilon.values()) if self.epsilon else 0.0,
            "epsilon": {c: self.epsilon[c] for c in sorted(self.epsilon)},
            "delta": float(self.config["delta"]),
            "accountant": self.config["accountant"],
            "calibration": ("manual" if float(self.config["noise-multiplier"]) >= 0
                            else self.config["calibration"]),
            "protection": p.algorithm.protection,
            "releases": {c: [r.__dict__ for r in p.releases(c)] for c in range(p.num_clients)},
            "wall_seconds": wall,
            "seconds_per_round": wall / max(self.rounds_done, 1),
            "results": str(self.path),
        }
        summary["calibration_check"] = self.calibration_check()
        params = p.algorithm.global_params(self.state).cpu()
        assert self.results is not None
        self.results.finish(summary, p.model.load_into(params).state_dict())
        if self.echo:
            stop = f" (stopped: {self.stop_reason})" if self.stop_reason else ""
            print(f"done: {self.rounds_done} rounds in {wall:.1f} s{stop}; results in {self.path}",
                  flush=True)
            if summary["calibration_check"]:
                print(summary["calibration_check"], flush=True)
        log.info("results written to %s", self.path)
        return summary
