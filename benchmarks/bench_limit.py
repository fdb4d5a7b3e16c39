"""The hardware limit: an engine round of every algorithm family against the work it cannot avoid.

For each workload, the engine's seconds per round (exact mode, the median of rounds 2..T-1 of a
``dpfl run``: the last round evaluates) is divided by the limit: one plain, non-private forward
and backward pass of the ``nn.Module`` (mean loss, ``backward()``) over all the samples the round
trains on, batched in one call, plus, for a noisy algorithm, one ``torch.randn`` of as many
Gaussians as the round draws. Both counts are measured, not assumed: short runs count the
samples every training forward pass sees and the Gaussians every draw makes in rounds 2 and 3
(the first round may be another exchange, e.g. PriSMA's initial one). A ratio of 1
means the engine is at the limit; what lies above it is per-sample clipping, per-client keyed
noise streams, the algorithm's own vector arithmetic and the round's bookkeeping (ledger,
records). The engine run and the limit alternate ``--repeats`` times; the row gives the median
and spread of the per-repeat ratio. One torch thread (what each ``dpfl reproduce`` worker has).

A third row divides the engine round by the same plain passes made client by client (each
client's share of the samples in a call of its own, then the Gaussians): the engine computes
every client on its own, so that a client's numbers do not depend on who else is in its cohort
(a Flower node alone, or the engine's whole federation: bit for bit the same), and on a CPU
many small calls cost more than one large one even for the plain module. That row separates
what the per-client design costs from what the engine adds on top of it; it has no target.

Targets: ≤ 1.5× in exact mode for the MLP and the Clip21 CNN (:data:`TARGETS`); the projection
family ≤ 2× its floor (:data:`FLOOR_TARGETS`).

A stateful algorithm also does vector arithmetic on its ``[C, d]`` client state that the limit
does not count and no implementation can skip (Clip21-SGD2M: the momentum, v − g, its float64
norms, the scaling, the g update). For those (:data:`ORACLES`) a second row divides the engine
round by the limit plus that arithmetic alone: the algorithm's own ``client_step``, called
directly (no runtime: no noise, no checks) with its gradient oracle handing back a precomputed
gradient. The projection family (PCDP-SGD, PDP-SGD, FedPCDP) computes a public eigenspace
for every subspace, work no implementation of the algorithm skips: its floor adds the
eigenspaces a round makes (counted): each one's float64 Gram matrix of the public gradients,
timed alone from the span the run built, and its eigendecomposition, timed alone on a random
Gram matrix of the same size (the public forward and backward passes are in the limit already:
they are counted among the samples). There the target is read on the second row: what lies
above that floor is the engine's (per-sample work, keyed noise streams, sampling, checks,
bookkeeping). A third row, without a target, adds the family's dense k × d arithmetic, which any
implementation with a dense basis also does: every lift Va of a step's k coordinates into R^d
and every projection Vᵀg of a d-vector (PDP-SGD's clipped mean, FedPCDP's upload), each timed
alone on the run's own basis and vector.

On the CPU by default; ``--device cuda`` runs the engine and the limit on the GPU (the
noise is drawn on the CPU from the keyed streams whatever the device, so there the Gaussians
are part of the engine's price, not the limit's: the limit draws them on the GPU).

    .venv/bin/python benchmarks/bench_limit.py [--quick] [--rows FILE] [--device cuda]
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (  # noqa: E402
    Row,
    arguments,
    best_of_three,
    emit,
    parse,
    ratios,
    round_seconds,
    scratch,
    synchronize,
)

from dpfl.algorithms import (
    ClientContext,  # noqa: E402
    projected,  # noqa: E402
)
from dpfl.algorithms.subspace import GradientBasis  # noqa: E402
from dpfl.engine import run  # noqa: E402
from dpfl.models.flat import FlatParameters  # noqa: E402
from dpfl.models.span import GradientSpan  # noqa: E402
from dpfl.models.tape import TapeEngine  # noqa: E402
from dpfl.privacy.randomness import Randomness  # noqa: E402
from dpfl.problem import build_problem  # noqa: E402
from dpfl.runconfig import RunConfig  # noqa: E402

CLIENTS, BATCH = 10, 64
BASE = {"dataset": "mnist", "model": "mlp", "num-partitions": CLIENTS, "batch-size": BATCH,
        "epsilon": 8.0, "engine-mode": "exact", "seed": 0}
# (family, algorithm, model, overrides): one or two algorithms per family, on the MLP, and the
# one-step families on the Clip21 CNN too
WORKLOADS: list[tuple[str, str, str, dict]] = [
    ("clip21", "clip21-sgd2m", "mlp", {}),
    ("clip21", "clip21-sgd2m", "clip21-cnn", {}),
    ("prisma", "dpsgd-gc", "mlp", {}),
    ("prisma", "dpsgd-gc", "clip21-cnn", {}),
    ("prisma", "prisma", "mlp", {}),
    ("adaptive", "adaptdp-fedavg", "mlp", {"local-steps": 2}),
    ("adaptive", "dp-fedavg", "mlp", {"local-steps": 2}),
    ("quantile", "dp-fedavg-quantile", "mlp", {}),
    ("scaffold", "dp-scaffold", "mlp", {"local-steps": 2}),
    ("projected", "dp-sgd", "mlp", {"local-steps": 2}),
    ("projected", "pcdp-sgd", "mlp", {"local-steps": 2}),
    ("projected", "pdp-sgd", "mlp", {"local-steps": 2}),
    ("projected", "fedpcdp", "mlp", {"local-steps": 2}),
]
ORACLES = {"clip21-sgd2m": "gradient"}  # algorithm: its gradient oracle (a method)
# the targets, by family: 1.5× the limit (or the floor of an algorithm with its own unavoidable
# work), the projection family with its eigendecompositions 2× its floor
TARGETS = {"clip21": 1.5, "prisma": 1.5, "adaptive": 1.5, "quantile": 1.5, "scaffold": 1.5,
           "projected": 1.5}
FLOOR_TARGETS = {"pcdp-sgd": 2.0, "pdp-sgd": 2.0, "fedpcdp": 2.0}


@contextmanager
def counting() -> Iterator[dict]:
    """Count the samples of every training forward pass (grad enabled) of any ``FlatModel``
    (a clients' joint pass too; not a joint layout's one-off check, which passes twice),
    every Gaussian any ``Randomness.normal`` draws and the size of every public Gram matrix the
    projection family decomposes (:func:`~dpfl.algorithms.projected.top_eigenspace`), and keep
    the spans whose Gram matrix is formed and every dense lift and projection a public basis
    makes (the basis and its argument), while the block runs."""
    counts: dict = {"samples": 0, "gaussians": 0, "eigenspaces": [], "grams": [], "dense": []}
    forward, normal = FlatParameters.forward_with, Randomness.normal
    stacked, check = TapeEngine.record_stacked, TapeEngine.same_jointly
    eigenspace = projected.top_eigenspace
    gram_of, lift_into, coords = GradientSpan.gram, GradientBasis.lift_into, GradientBasis.coords

    def counted_forward(self, params, x):
        if torch.is_grad_enabled() and not counts.get("checking"):
            counts["samples"] += x.shape[0]
        return forward(self, params, x)

    def counted_stacked(self, params, x, y, losses_out=None):
        if not counts.get("checking"):
            counts["samples"] += x.shape[0]
        return stacked(self, params, x, y, losses_out)

    def uncounted_check(self, group, clip, results):  # a joint layout's one-off check
        counts["checking"] = True
        try:
            return check(self, group, clip, results)
        finally:
            counts["checking"] = False

    def counted_normal(self, clients, server_round, purpose, shape, std, **kwargs):
        counts["gaussians"] += len(clients) * math.prod(shape)
        return normal(self, clients, server_round, purpose, shape, std, **kwargs)

    def counted_eigenspace(gram, k):
        counts["eigenspaces"].append((len(gram), k))
        return eigenspace(gram, k)

    def counted_gram(self):
        counts["grams"].append(self)
        return gram_of(self)

    def counted_lift(self, a, out):
        counts["dense"].append((self, "lift", a.clone(), out.dtype))
        return lift_into(self, a, out)

    def counted_coords(self, g):
        counts["dense"].append((self, "coords", g.clone(), None))
        return coords(self, g)

    FlatParameters.forward_with, Randomness.normal = counted_forward, counted_normal  # type: ignore
    TapeEngine.record_stacked = counted_stacked  # type: ignore[method-assign]
    TapeEngine.same_jointly = uncounted_check  # type: ignore[method-assign]
    projected.top_eigenspace = counted_eigenspace
    GradientSpan.gram = counted_gram  # type: ignore[method-assign]
    GradientBasis.lift_into, GradientBasis.coords = counted_lift, counted_coords  # type: ignore
    try:
        yield counts
    finally:
        FlatParameters.forward_with, Randomness.normal = forward, normal  # type: ignore
        TapeEngine.record_stacked = stacked  # type: ignore[method-assign]
        TapeEngine.same_jointly = check  # type: ignore[method-assign]
        projected.top_eigenspace = eigenspace
        GradientSpan.gram = gram_of  # type: ignore[method-assign]
        GradientBasis.lift_into, GradientBasis.coords = lift_into, coords  # type: ignore


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def eigenspace_seconds(sizes: list[tuple[int, int]]) -> float:
    """Seconds of the eigendecompositions of public Gram matrices of ``sizes`` ((m, k) each),
    random positive semi-definite ones, the best of three."""
    total = 0.0
    for m, k in sizes:
        g = torch.randn(m, 4 * m, dtype=torch.float64)
        gram = g @ g.t()
        total += best_of_three(lambda gram=gram, k=k: projected.top_eigenspace(gram, k))
    return total


def gram_seconds(spans: list[GradientSpan]) -> float:
    """Seconds of forming each span's float64 Gram matrix from its tapes as the run did
    (converting the factors to float64 included), each alone, the best of three."""
    def fresh(span: GradientSpan) -> GradientSpan:
        again = copy.copy(span)
        again.factors = dict([next(iter(span.factors.items()))])  # the tapes' own dtype only
        return again
    return sum(best_of_three(lambda s=span: fresh(s).gram()) for span in spans)


def dense_seconds(calls: list[tuple]) -> float:
    """Seconds of each lift Va and projection Vᵀg the run made, on its own basis and vector,
    each alone, the best of three."""
    total = 0.0
    for basis, kind, arg, dtype in calls:
        if kind == "lift":
            out = torch.empty(basis.span.model.d, dtype=dtype, device=arg.device)
            total += best_of_three(lambda b=basis, a=arg, o=out: b.lift_into(a, o))
        else:
            total += best_of_three(lambda b=basis, g=arg: b.coords(g))
    return total


def config(algorithm: str, model: str, overrides: dict, rounds: int, folder: Path,
           name: str) -> RunConfig:
    return RunConfig({**BASE, "algorithm": algorithm, "model": model, **overrides,
                      "num-server-rounds": rounds, "eval-every": rounds,
                      "results-dir": str(folder), "run-name": name})


def engine_round(cfg: RunConfig) -> float:
    """Median seconds of rounds 2..T-1 of ``cfg`` run on the engine."""
    run(cfg, echo=False)
    return statistics.median(
        round_seconds(Path(str(cfg["results-dir"])) / str(cfg["run-name"]))[1:-1])


def limit_step(cfg: RunConfig, samples: int, gaussians: int, calls: int = 1) -> float:
    """Seconds of one plain forward+backward over ``samples`` samples in ``calls`` equal calls
    (1: one batched call), plus one draw of ``gaussians`` standard normals."""
    problem = build_problem(cfg)
    module = problem.model.load_into(problem.x0)
    x = torch.randn(samples, *problem.dataset.train_x.shape[1:], device=problem.device)
    y = torch.randint(0, 10, (samples,), device=problem.device)
    parts = list(zip(x.chunk(calls), y.chunk(calls)))
    synchronize()
    start = time.perf_counter()
    for xs, ys in parts:
        F.cross_entropy(module(xs), ys).backward()
    if gaussians:
        torch.randn(gaussians, device=problem.device)
    synchronize()
    return time.perf_counter() - start


def state_arithmetic(cfg: RunConfig, oracle: str, steps: int = 6) -> float:
    """Median seconds of the last half of ``steps`` calls of the algorithm's own ``client_step``
    for every client (exchange of round 2; the first calls warm the allocator up, as a run's
    first rounds do), with its gradient oracle ``oracle`` handing back a precomputed gradient
    and no runtime around it: its arithmetic on the client state alone."""
    problem = build_problem(cfg)
    algorithm = problem.algorithm
    gradients = [torch.randn(problem.num_clients, problem.model.d, device=problem.device) / 100
                 for _ in range(steps)]
    setattr(algorithm, oracle, lambda *args: gradients.pop())  # fresh, as the oracle's are
    states = {k: torch.randn_like(v) / 100
              for k, v in algorithm.init_client_state(problem.num_clients).items()}
    exchange = algorithm.round_exchanges(2)[0].name
    broadcast = algorithm.broadcast(exchange, algorithm.init_server_state(problem.x0), 2)
    cohort = problem.full_cohort()
    ctx = ClientContext(server_round=2, rng=Randomness(0), clients=list(cohort.ids),
                        releases=[{r.name: r for r in problem.releases(c)} for c in cohort.ids],
                        device=problem.device)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        _, states = algorithm.client_step(exchange, states, broadcast, cohort, ctx)
        synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[steps // 2:])


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0], device=True)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--algorithms", nargs="+", metavar="NAME",
                        help="only the workloads of these algorithms")
    args = parse(parser)
    repeats, rounds = (2, 4) if args.quick else (args.repeats or 3, 8)
    BASE["device"] = args.device
    torch.set_num_threads(1)
    folder = scratch("dpfl-bench-limit-")
    rows = []
    for family, algorithm, model, overrides in WORKLOADS:
        if args.algorithms and algorithm not in args.algorithms:
            continue
        counted = {}
        for rounds_counted in (1, 3):  # rounds 2 and 3: the timed rounds' exchanges
            with counting() as counted[rounds_counted]:
                run(config(algorithm, model, overrides, rounds_counted, folder,
                           f"{algorithm}-{model}-count{rounds_counted}"), echo=False)
        samples, gaussians = ((counted[3][k] - counted[1][k]) // 2 for k in ("samples",
                                                                             "gaussians"))
        # one round's: the half of rounds 2 and 3's that came first
        eigen, grams, dense = (extra[:len(extra) // 2] for extra in (
            counted[3][k][len(counted[1][k]):] for k in ("eigenspaces", "grams", "dense")))
        engine, limit, floor, own, per_client, beyond = [], [], [], [], [], []
        oracle = ORACLES.get(algorithm)
        for repeat in range(repeats + 1):  # the first pair warms up
            cfg = config(algorithm, model, overrides, rounds, folder,
                         f"{algorithm}-{model}-{repeat}")
            e = engine_round(cfg)
            lim = min(limit_step(cfg, samples, gaussians) for _ in range(3))
            alone = min(limit_step(cfg, samples, gaussians, max(1, round(samples / BATCH)))
                        for _ in range(3))
            work = ((state_arithmetic(cfg, oracle) if oracle else 0.0)
                    + (eigenspace_seconds(eigen) + gram_seconds(grams) if eigen else 0.0))
            lifts = dense_seconds(dense)
            if repeat:
                engine.append(e)
                limit.append(lim)
                per_client.append(alone)
                if oracle or eigen:
                    floor.append(lim + work)
                    own.append(work)
                if dense:
                    beyond.append(lifts)
        workload = (f"{algorithm}, MNIST {model}, {CLIENTS} clients × batch {BATCH}"
                    + "".join(f", {k} {v}" for k, v in overrides.items())
                    + f" ({samples:,} samples, {gaussians:,} Gaussians a round; engine "
                    f"{1e3 * statistics.median(engine):.1f} ms, limit "
                    f"{1e3 * statistics.median(limit):.1f} ms)")
        target = FLOOR_TARGETS.get(algorithm, TARGETS.get(family))
        bare = target is not None and not floor  # else the target is read against the floor
        rows.append(Row.of("hardware limit", "engine round ÷ (plain fwd+bwd + Gaussians)",
                           workload, family, ratios(engine, limit), "×",
                           target=f"≤ {target}×" if bare else "",
                           limit=target if bare else None))
        print(rows[-1].markdown(), flush=True)
        if floor:
            what = ("the [C, d] state arithmetic (its client step alone, gradient oracle "
                    "stubbed)" if oracle else
                    f"{plural(len(eigen), 'public eigenspace')}: the {eigen[0][0]}×{eigen[0][0]} "
                    "Gram matrix in float64 and its eigendecomposition")
            rows.append(Row.of(
                "hardware limit", "engine round ÷ (plain fwd+bwd + Gaussians + the algorithm's "
                "own unavoidable work)", f"{algorithm}, MNIST {model} ({what}: "
                f"{1e3 * statistics.median(own):.1f} ms; floor "
                f"{1e3 * statistics.median(floor):.1f} ms)", family, ratios(engine, floor), "×",
                target=f"≤ {target}×" if target else "", limit=target))
            print(rows[-1].markdown(), flush=True)
        if beyond:
            lifted = sum(kind == "lift" for _, kind, _, _ in dense)
            projected_vectors = sum(len(arg.reshape(-1, arg.shape[-1]))
                                    for _, kind, arg, _ in dense if kind == "coords")
            rows.append(Row.of(
                "hardware limit", "engine round ÷ (the floor above + the dense k × d lifts and "
                "projections)", f"{algorithm}, MNIST {model} ({plural(lifted, 'lift')} Va, "
                f"{plural(projected_vectors, 'projection')} Vᵀg: "
                f"{1e3 * statistics.median(beyond):.1f} ms)", family,
                ratios(engine, [f + b for f, b in zip(floor or limit, beyond)]), "×"))
            print(rows[-1].markdown(), flush=True)
        alone = [a + w for a, w in zip(per_client, own or [0.0] * len(per_client))]
        rows.append(Row.of(
            "hardware limit", "engine round ÷ (plain fwd+bwd client by client + Gaussians"
            + (" + own work" if own else "") + ")",
            f"{algorithm}, MNIST {model} (each client's batch of {BATCH} in a call "
            f"of its own: {1e3 * statistics.median(per_client):.1f} ms)", family,
            ratios(engine, alone), "×"))
        print(rows[-1].markdown(), flush=True)
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
