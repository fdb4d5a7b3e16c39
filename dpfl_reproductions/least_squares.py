"""A vectorised simulator of PriSMA and DPSGD-GC on a linear least-squares problem, for sweeps.

PriSMA's Figure 1 tunes thousands of configurations of up to 32,000 rounds each on a problem
with d = 10: per round, the work of one configuration is a few hundred multiply-adds per sample,
far less than the engine's per-round bookkeeping. :class:`LeastSquaresSweep` runs many
configurations of one federation (same data, batch size and seed) in lock step, in float64:

* the randomness is the engine's (:class:`~dpfl.privacy.Randomness`, the same keyed streams:
  each client's batch from ``(seed, client, round, "batch")``, its noise from ``(seed, client,
  round, "noise")``), drawn once per round and shared by every configuration, which differ only
  in how they scale it; so a configuration here follows the ``dpfl run`` of the same run config
  up to float32 rounding (the engine computes in float32; its normals are the float64 ones
  rounded, for d < 16, which the simulator requires);
* for a linear model, every per-sample quantity PriSMA needs is a scalar per sample: with
  r_j = a_jᵀx − y_j and g = ∇ of the regulariser at x, the sample's gradient is r_j·a_j + g, so
  its norm, its clip factor s_j, the norm of the difference of two clipped gradients and that
  difference's clip factor t_j follow from a_jᵀx, a_jᵀg, ‖a_j‖² and the configuration's
  ‖g‖², g·g̃ (no ``[configurations, b, d]`` tensor), and each client's message is one product of
  its batch with a vector of per-sample coefficients (eq. (20)):
  Σ_j [γ s_j r_j + (1 − γ) t_j α_j] a_j + Σ_j [γ s_j + (1 − γ) t_j s_j]·g − (1 − γ) Σ_j t_j s̃_j·g̃
  with α_j = s_j r_j − s̃_j r̃_j (tildes at x^{t−1});
* configurations may have different numbers of rounds (T sets the noise as √T): they share the
  draws of their common rounds and leave the batch when they end.

DPSGD-GC is PriSMA with γ = 1 and C2 = ∞ (the same releases, streams and step), which the engine
checks bitwise (tests). Eq. (4) (``smoothness-L``) and add/remove neighbours (Poisson batches)
are not simulated. The metric is the full
gradient norm ‖∇F(x^T)‖ of the training objective (all M·N records), and its running mean over
the rounds (1/T)·Σ_t ‖∇F(x^t)‖, the quantity of the paper's theorems.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dpfl.algorithms import ALGORITHMS
from dpfl.algorithms.prisma import Prisma
from dpfl.privacy import Randomness, stds
from dpfl.problem import Problem, build_problem
from dpfl.runconfig import RunConfig

#: run-config keys a sweep's configurations may vary; every other key is the federation's
VARYING = ("algorithm", "learning-rate", "clip", "gamma", "server-clip", "clip-diff", "eval-every",
           "smoothness-L", "num-server-rounds", "relation", "calibration", "epsilon", "delta",
           "noise-multiplier", "accountant", "run-name", "results-dir")
log = logging.getLogger(__name__)
CHUNK = 200_000  # per-sample values formed at once: a few MB (cache-sized), ~16 configurations
# at b = 1200, M = 10

SIMULATED = ("prisma", "dpsgd-gc", "non-prisma")


@dataclass(frozen=True)
class Point:
    """One configuration's constants, PriSMA's symbols (DPSGD-GC: γ = 1, C2 = ∞)."""

    rounds: int  # T
    learning_rate: float  # η
    clip: float  # C1
    gamma: float  # γ
    server_clip: float  # C2
    clip_diff: float  # C3
    init_std: float  # σ_0 of one client's message
    momentum_std: float  # σ_1


def point(problem: Problem) -> Point:
    """The constants of ``problem``'s configuration, its noise from the library's calibration
    (the releases a ``dpfl run`` of it would use)."""
    hp = problem.algorithm.hp
    if not isinstance(problem.algorithm, Prisma) and problem.algorithm.name != "dpsgd-gc":
        raise ValueError(f"cannot simulate {problem.algorithm.name!r}: one of {SIMULATED}")
    releases = {r.name: r for r in problem.releases(0)}
    if problem.algorithm.relation != "replace-one":
        raise ValueError("relation='add-remove' (Poisson batches) is not simulated: the "
                         "simulator draws fixed-size batches")
    if isinstance(problem.algorithm, Prisma):
        if hp.smoothness_L > 0:
            raise ValueError("eq. (4) (smoothness-L > 0) is not simulated")
        init, momentum = (float(stds([releases[n]])[0]) for n in ("init", "momentum"))
        return Point(int(problem.config["num-server-rounds"]), hp.learning_rate, hp.clip,
                     hp.gamma, hp.server_clip, hp.clip_diff, init, momentum)
    std = float(stds(list(releases.values()))[0])
    return Point(int(problem.config["num-server-rounds"]), hp.learning_rate, hp.clip, 1.0,
                 math.inf, math.inf, std, std)


@dataclass
class _Batch:
    """The live configurations of a batch: constants ``[K]`` and state (x, x^{t−1} ``[K, d]``,
    the clients' v ``[K, M, d]``, the running Σ_t‖∇F(x^t)‖); ``live`` maps a row to its
    configuration's position in the request."""

    live: Tensor
    rounds: Tensor
    eta: Tensor
    c1: Tensor
    gamma: Tensor
    c2: Tensor
    c3: Tensor
    s0: Tensor
    s1: Tensor
    x: Tensor
    x_prev: Tensor
    v: Tensor
    norm_sum: Tensor

    @classmethod
    def of(cls, points: list[Point], *, clients: int, x0: Tensor) -> _Batch:
        def column(name: str) -> Tensor:
            return torch.tensor([getattr(p, name) for p in points], dtype=torch.float64)

        k, dim = len(points), len(x0)
        x = x0.double().expand(k, dim).clone()
        return cls(torch.arange(k), torch.tensor([p.rounds for p in points]),
                   column("learning_rate"), column("clip"), column("gamma"),
                   column("server_clip"), column("clip_diff"), column("init_std"),
                   column("momentum_std"), x, x.clone(),
                   torch.zeros(k, clients, dim, dtype=torch.float64),
                   torch.zeros(k, dtype=torch.float64))

    def keep(self, rows: Tensor) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name)[rows])


class LeastSquaresSweep:
    """Configurations of one least-squares federation (``base``: dataset, partition, model,
    batch size, seed) run together. ``run(configs)`` returns one result per configuration:
    ``grad_norm`` (‖∇F(x^T)‖), ``grad_norm_mean`` ((1/T)Σ_{t<T}‖∇F(x^t)‖), ``rounds`` and the
    final iterate ``x``."""

    def __init__(self, base: RunConfig) -> None:
        self.base = base
        self.problem = build_problem(base)
        model = self.problem.model
        layer = None if model.linear is None else model.linear.layer
        if layer is None or layer.bias is not None or model.d != layer.weight.numel() \
                or self.problem.dataset.task != "regression":
            raise ValueError("the sweep simulates a bias-free linear least-squares model")
        if model.d >= 16:
            raise ValueError("the sweep simulates d < 16: from 16 values on, torch draws float64 "
                             "normals other than the float32 ones the engine draws")
        self.reg = model.nonconvex_reg
        ds = self.problem.dataset
        self.a = ds.train_x.reshape(len(ds.train_x), -1).double()
        self.y = ds.train_y.reshape(-1).double()
        n = len(self.a)
        self.hessian = self.a.T @ self.a / n  # ∇F(x) = H x − h + λ·x/(1 + x²)²
        self.target = self.a.T @ self.y / n
        self.indices = [torch.from_numpy(p) for p in self.problem.partitions]
        # the clients' records back to back, so that a round's batches are one gather
        order = torch.cat(self.indices)
        self.client_a, self.client_y = self.a[order], self.y[order]
        self.client_sq = self.client_a.square().sum(dim=1)
        self.offsets = torch.tensor([0, *itertools.accumulate(len(i) for i in self.indices)][:-1])
        self.batch_size = int(base.hyperparameters.batch_size)
        self.rng = Randomness(int(base["seed"]))

    def problem_of(self, config: RunConfig) -> Problem:
        """``config``'s problem on this sweep's data (it may differ from ``base`` only in
        :data:`VARYING`)."""
        for key in config:
            if key not in VARYING and config[key] != self.base[key]:
                raise ValueError(f"{key!r} differs from the sweep's federation: "
                                 f"{config[key]!r} vs {self.base[key]!r}")
        algorithm = ALGORITHMS.get(str(config["algorithm"]))(
            config.hyperparameters, self.problem.model, num_clients=self.problem.num_clients)
        return dataclasses.replace(self.problem, config=config, algorithm=algorithm,
                                   _releases={}, _server_releases=None, _cohorts={})

    def gradient(self, x: Tensor) -> Tensor:
        """``[K, d]`` full gradients ∇F of the training objective."""
        return x @ self.hessian - self.target + self._reg(x)

    def _reg(self, x: Tensor) -> Tensor:
        return self.reg * x / (1 + x.square()).square()

    def draws(self, server_round: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Round ``server_round``'s batch ``a [M, b, d]``, ``y [M, b]``, its ‖a_j‖² ``[M, b]`` and
        standard normals ``[M, d]`` (the engine's draws for every client)."""
        clients = list(range(len(self.indices)))
        picks = self.rng.sample_without_replacement(
            clients, [len(i) for i in self.indices], server_round, "batch", self.batch_size)
        rows = (torch.stack(picks) + self.offsets[:, None]).reshape(-1)
        z = self.rng.normal(clients, server_round, "noise", (self.a.shape[1],),
                            torch.ones(len(clients)), dtype=torch.float64)
        shape = (len(clients), self.batch_size)
        return (self.client_a.index_select(0, rows).view(*shape, -1),
                self.client_y.index_select(0, rows).view(shape),
                self.client_sq.index_select(0, rows).view(shape), z)

    def run(self, configs: Sequence[RunConfig]) -> list[dict[str, Any]]:
        with _once(logging.getLogger("dpfl.algorithms.prisma")):  # a warning per setting
            points = [point(self.problem_of(c)) for c in configs]
        batch = _Batch.of(points, clients=len(self.indices), x0=self.problem.x0)
        results: list[dict[str, Any]] = [{} for _ in points]
        chunk = max(1, CHUNK // (len(self.indices) * self.batch_size))
        ends, total = {p.rounds for p in points}, max(p.rounds for p in points)
        for t in range(total):
            self._round(t, batch, *self.draws(t + 1), chunk)
            if t + 1 in ends:
                self._finish(t + 1, batch, results)
        return results

    def _round(self, t: int, b: _Batch, a: Tensor, y: Tensor, sq: Tensor, z: Tensor,
               chunk: int) -> None:
        """Round t + 1 (the paper's t) of every configuration of ``b``."""
        b.norm_sum += torch.linalg.vector_norm(self.gradient(b.x), dim=1)
        q = torch.cat([self._messages(*part, a, y, sq, t == 0) for part in zip(
            *(u.split(chunk) for u in (b.x, b.x_prev, b.c1, b.c3, b.gamma)), strict=True)]
        ) / self.batch_size
        if t == 0:
            b.v = q + b.s0[:, None, None] * z
        else:
            b.v = (1 - b.gamma)[:, None, None] * b.v + q + b.s1[:, None, None] * z
        mean = b.v.mean(dim=1)
        factor = torch.clamp(b.c2 / torch.linalg.vector_norm(mean, dim=1), max=1.0)
        b.x, b.x_prev = b.x - (b.eta * factor)[:, None] * mean, b.x

    def _finish(self, rounds: int, b: _Batch, results: list[dict[str, Any]]) -> None:
        """The configurations of ``rounds`` rounds record their results and leave ``b``."""
        done = b.rounds == rounds
        final = torch.linalg.vector_norm(self.gradient(b.x[done]), dim=1)
        for k, g, s, x in zip(b.live[done].tolist(), final.tolist(), b.norm_sum[done].tolist(),
                              b.x[done], strict=True):
            results[k] = {"grad_norm": g, "grad_norm_mean": s / rounds, "rounds": rounds, "x": x}
        b.keep(~done)

    def _messages(self, x: Tensor, x_prev: Tensor, c1: Tensor, c3: Tensor, gamma: Tensor,
                  a: Tensor, y: Tensor, sq: Tensor, first: bool) -> Tensor:
        """``[K, M, d]``: each client's Σ_j clip_C1(∇f_ij(x)) (``first``: round t = 0) or b·q_i^t
        of eq. (20) (see the module docstring); ``sq`` are the batch's ‖a_j‖²."""
        g, gp = self._reg(x), self._reg(x_prev)
        both = torch.cat([x, g] if first else [x, g, x_prev, gp])  # one product for all
        products = (both @ a.reshape(-1, a.shape[2]).T).view(len(both), *a.shape[:2]).split(len(x))
        r, ag = products[0] - y, products[1]
        gg = g.square().sum(dim=1)[:, None, None]
        if first:
            coeff, g_sum, gp_sum = _clipped_coefficients(r, ag, sq, gg, c1[:, None, None])
        else:
            rp, agp = products[2] - y, products[3]
            coeff, g_sum, gp_sum = _increment_coefficients(
                r, ag, rp, agp, sq, gg, gp.square().sum(dim=1)[:, None, None],
                (g * gp).sum(dim=1)[:, None, None], c1[:, None, None], c3[:, None, None],
                gamma[:, None, None])
        return (torch.bmm(coeff.transpose(0, 1), a).transpose(0, 1) + g_sum[..., None] * g[:, None]
                - gp_sum[..., None] * gp[:, None])


@contextlib.contextmanager
def _once(logger: logging.Logger) -> Iterator[None]:
    """Within the block, ``logger`` emits each distinct message once (a calibration warning
    that every configuration of a batch would repeat)."""
    seen: set[str] = set()

    def first(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        new = message not in seen
        seen.add(message)
        return new

    logger.addFilter(first)
    try:
        yield
    finally:
        logger.removeFilter(first)


def _clip_factor(norm_sq: Tensor, clip: Tensor) -> Tensor:
    """min(1, C/‖·‖) from a squared norm (1 at zero, as :func:`~dpfl.privacy.clip_factors`)."""
    norm = norm_sq.clamp_min(0).sqrt()
    return torch.where(norm > clip, clip / norm, 1.0)


def _clipped_coefficients(r: Tensor, ag: Tensor, sq: Tensor, gg: Tensor, c1: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """Σ_j clip_C1(r_j a_j + g) = Σ_j (s_j r_j) a_j + (Σ_j s_j)·g: ``(s·r, Σ s, 0)``."""
    s = _clip_factor(r * (r * sq + 2 * ag) + gg, c1)
    return s * r, s.sum(dim=-1), torch.zeros_like(s[..., 0])


def _increment_coefficients(r: Tensor, ag: Tensor, rp: Tensor, agp: Tensor, sq: Tensor,
                            gg: Tensor, ggp: Tensor, g_gp: Tensor, c1: Tensor, c3: Tensor,
                            gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. (20)'s per-sample coefficients of a_j, and the sums multiplying g and g̃: the sample's
    clipped gradients are c_j = s_j(r_j a_j + g), c̃_j = s̃_j(r̃_j a_j + g̃); their difference is
    α_j a_j + w_j with α_j = s_j r_j − s̃_j r̃_j, w_j = s_j g − s̃_j g̃, clipped by t_j."""
    s = _clip_factor(r * (r * sq + 2 * ag) + gg, c1)
    sp = _clip_factor(rp * (rp * sq + 2 * agp) + ggp, c1)
    alpha = s * r - sp * rp
    aw = s * ag - sp * agp
    ww = s * s * gg - 2 * s * sp * g_gp + sp * sp * ggp
    t = _clip_factor(alpha * (alpha * sq + 2 * aw) + ww, c3)
    rest = (1 - gamma) * t
    return gamma * s * r + rest * alpha, (gamma * s + rest * s).sum(dim=-1), \
        (rest * sp).sum(dim=-1)


def compile_kernels() -> bool:
    """Fuse the per-sample arithmetic with ``torch.compile`` (about 30 times faster on a CPU
    than one pass per operation; the first call compiles, about 20 s); where compilation is not
    available (no C++ compiler) the eager functions stay, with a warning. Returns whether it
    compiled."""
    global _clipped_coefficients, _increment_coefficients
    try:
        fused = [torch.compile(f, dynamic=True)
                 for f in (_clipped_coefficients, _increment_coefficients)]
        r = torch.ones(2, 3, 4, dtype=torch.float64)  # sizes > 1: no specialisation to 1
        c = torch.ones(2, 1, 1, dtype=torch.float64)
        fused[0](r, r, r[0], c, c)
        fused[1](r, r, r, r, r[0], c, c, c, c, c, c)
    except Exception as error:  # noqa: BLE001 - any backend failure leaves the eager path
        log.warning("torch.compile is not available here (%s): the sweep runs unfused, "
                    "about 30 times slower", type(error).__name__)
        return False
    _clipped_coefficients, _increment_coefficients = fused
    return True


def federation(config: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """What configurations must share to run in one batch: every key but :data:`VARYING`."""
    return tuple(sorted((k, v) for k, v in config.items() if k not in VARYING))


_SWEEPS: dict[tuple[tuple[str, Any], ...], LeastSquaresSweep] = {}
_FUSED: list[bool] = []


def simulate(configs: list[dict[str, Any]], *, fused: bool = True) -> list[dict[str, Any]]:
    """Run ``configs`` (one :func:`federation`) as one batch; a summary per configuration, as a
    ``dpfl run`` would archive it: ``rounds_completed``, the batch's ``wall_seconds`` shared
    out evenly, and ``derived`` (``grad_norm``, ``grad_norm_mean``). ``fused``: compile the
    per-sample arithmetic (:func:`compile_kernels`) once per process."""
    if fused and not _FUSED:
        _FUSED.append(compile_kernels())
    key = federation(configs[0])
    if key not in _SWEEPS:
        _SWEEPS.clear()
        _SWEEPS[key] = LeastSquaresSweep(RunConfig(configs[0]))
    started = time.perf_counter()
    results = _SWEEPS[key].run([RunConfig(c) for c in configs])
    share = (time.perf_counter() - started) / len(configs)
    return [{"rounds_completed": r["rounds"], "wall_seconds": share,
             "derived": {"grad_norm": r["grad_norm"], "grad_norm_mean": r["grad_norm_mean"]}}
            for r in results]
