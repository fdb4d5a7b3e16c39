"""What distributed noise under secure aggregation buys: ``dpfl reproduce secagg gain``.

Local noise (every client adds its release's whole noise; the server may read every upload)
against distributed noise (``secure-aggregation=true distributed-noise=true``: each client adds
1/√n of it, the server sees only the sum) for the algorithms whose noise can be split, at the
same accountant ε against a server that follows the protocol, with n = 10 and 100 clients:

* **privacy**: record-level (ε, δ = 1e-5) per client under replace-one, calibrated by the RDP
  accountant for the full run; the distributed arm also reports ``epsilon_if_unmasked``, the
  guarantee left against a server that reads one client's upload;
* **federation**: MNIST, IID, every client every round, :data:`ROUNDS` rounds, the MNIST MLP,
  the clients' default batch (32);
* **tuning alike**: each arm's step size over the same :data:`STEPS` (the benchmark's axis for
  the algorithm's family), its clip at the point the benchmark selected at that ε, selected on a
  validation split of 5,000 training images (never the test set) at seed 0;
* **seeds**: the selected step on seeds 1–3; test accuracy mean ± std and the paired
  difference distributed − local (95% t-interval: an interval containing 0 is a tie).

PriSMA and the other algorithms whose noise enters their clients' later steps or state refuse
distributed noise (docs/privacy.md): the report says which and why.
"""

from __future__ import annotations

import statistics

from dpfl.algorithms import ALGORITHMS
from dpfl_reproductions.benchmark import NUM_VALIDATION, selected_point
from dpfl_reproductions.lab import Lab
from dpfl_reproductions.registry import experiment
from dpfl_reproductions.selection import (
    Config,
    Runner,
    accuracy,
    best,
    final_accuracy,
    mean_std,
    paired,
)

ALGORITHMS_RUN = ("dpsgd-gc", "clip21-sgd2m")
REFUSING = ("prisma",)  # the third algorithm: said why it is not run
CLIENTS = (10, 100)
EPSILONS = (2.0, 8.0)
ARMS = ("local", "distributed")
ROUNDS = 200
SELECTION_SEED = 0
SEEDS = (1, 2, 3)
#: each family's step sizes (the benchmark's learning-rate axis)
STEPS = {"dpsgd-gc": (0.3, 1.0, 3.0, 10.0), "clip21-sgd2m": (0.001, 0.01, 0.1, 1.0)}
SMOKE = {"dataset": "digits", "rounds": 8, "validation": 300, "clients": (4, 8),
         "seeds": (1, 2), "steps": 2}

Cell = tuple[str, int, float, str]  # (algorithm, clients, ε, arm)


def arm_keys(arm: str) -> Config:
    return {"secure-aggregation": True, "distributed-noise": True} if arm == "distributed" else {}


@experiment("secagg", "gain", "Local noise against distributed noise under secure aggregation "
            "(each client adds 1/√n of the noise), tuned alike, at the same accountant ε, with "
            "10 and 100 clients", axes=("algorithm", "clients", "epsilon", "arm", "seed"))
def gain(lab: Lab) -> str:
    smoke = lab.smoke
    dataset = "digits" if smoke else "mnist"
    rounds = SMOKE["rounds"] if smoke else ROUNDS
    validation = SMOKE["validation"] if smoke else NUM_VALIDATION
    algorithms = lab.restrict("algorithm", ALGORITHMS_RUN)
    counts = [int(n) for n in lab.restrict("clients", SMOKE["clients"] if smoke else CLIENTS)]
    epsilons = [float(e) for e in lab.restrict("epsilon", EPSILONS)]
    arms = lab.restrict("arm", ARMS)
    seeds = [int(s) for s in lab.restrict("seed", SMOKE["seeds"] if smoke else SEEDS)]

    def steps(algorithm: str) -> tuple[float, ...]:
        return STEPS[algorithm][:SMOKE["steps"]] if smoke else STEPS[algorithm]

    def config(cell: Cell, step: float, seed: int) -> Config:
        algorithm, n, epsilon, arm = cell
        return {"algorithm": algorithm, "dataset": dataset, "partitioner": "iid",
                "num-partitions": n, "dataset-options": f"num_validation={validation}",
                "epsilon": epsilon, "delta": 1e-5, "calibration": "accountant",
                "num-server-rounds": rounds, "eval-every": rounds, "seed": seed,
                "clip": selected_point(algorithm, epsilon)["clip"], "learning-rate": step,
                **arm_keys(arm)}

    cells = [(a, n, e, arm) for a in algorithms for n in counts for e in epsilons
             for arm in arms]
    runner = Runner(config, lab.run_many)
    # each cell's steps in increasing order: a tie takes the smaller step
    tries = [(cell, step) for cell in cells for step in sorted(steps(cell[0]))]
    tried: dict[Cell, list[tuple[float, list[dict]]]] = {}
    for (cell, step), runs in zip(tries, runner.runs(tries, [SELECTION_SEED]), strict=True):
        tried.setdefault(cell, []).append((step, runs))
    chosen = {cell: best(runs, accuracy("validation")) for cell, runs in tried.items()}
    summaries = runner.on_seeds(chosen, seeds)
    tests = {cell: [final_accuracy(s) for s in runs] for cell, runs in summaries.items()}

    tried_steps = "; ".join(f"{a}: " + ", ".join(f"{s:g}" for s in steps(a)) for a in algorithms)
    lab.text(f"""
## Protocol

{dataset}, IID, {rounds} rounds, every client every round, record-level (ε, δ = 1e-5) per client
under replace-one by the RDP accountant: the ε against a server that follows the protocol, the
same in both arms. *local*: every client adds its release's whole noise. *distributed*:
`secure-aggregation=true distributed-noise=true`, each client adds 1/√n of it and the server
sees only the sum of the n clients' uploads (quantised on a grid of at most 1/1024 of the
noise's std). Each arm's step size γ chosen ({tried_steps}) on a validation split of
{validation} training images at seed {SELECTION_SEED}, the clip at the benchmark's selected
point at that ε; then seeds {", ".join(map(str, seeds))}.
""")
    rows = []
    for a in algorithms:
        for n in counts:
            for e in epsilons:
                row = [a, f"{n}", f"{e:g}"]
                for arm in arms:
                    mean, std = mean_std(tests[(a, n, e, arm)])
                    row.append(f"{mean:.1f} ± {std:.1f} (γ = {chosen[(a, n, e, arm)]:g})")
                if set(ARMS) <= set(arms):
                    diff = paired(tests[(a, n, e, "distributed")], tests[(a, n, e, "local")])
                    row.append(f"{diff.mean:+.1f} [{diff.low:+.1f}, {diff.high:+.1f}]")
                    unmasked = [s["secure_aggregation"]["distributed_noise"]["epsilon_if_unmasked"]
                                for s in summaries[(a, n, e, "distributed")]]
                    row.append(f"{statistics.fmean(unmasked):.3g}")
                rows.append(row)
    header = ["algorithm", "clients", "ε", *[f"{arm} test accuracy (%)" for arm in arms]]
    if set(ARMS) <= set(arms):
        header += ["distributed − local (95% CI)", "ε if one upload is read unmasked"]
    lab.table("test accuracy by arm, mean ± std over seeds (the step size selected)", header,
              rows)
    lab.text("\n## Not run\n\n" + "\n".join(
        f"- `{name}`: {ALGORITHMS.get(name).secure_aggregation_refusal(None)}"
        for name in REFUSING) + "\n")
    return "What distributed noise under secure aggregation buys"
