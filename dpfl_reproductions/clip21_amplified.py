"""The Clip21 paper's E5: Clip21-SGD2M+ against example-wise Clip-SGD, both with per-sample
clipping and amplification by sampling (Islamov et al., arXiv:2502.11682, App. J.2, Fig. J.1):
``dpfl reproduce clip21 amplified``.

The paper: "Clip21-SGD2M+ achieves competitive performance to Clip-SGD" on MNIST (E3's 25
clients, batch 32), τ_in = 0.1, β = 0.1, β̂ = 0.01 fixed, τ_out ∈ {0.01, 0.03, 0.1, 0.3, 1} ×
γ ∈ {0.01, 0.1, 1, 10} for Clip21-SGD2M+, the same clip and step grids for Clip-SGD with
example-wise clipping; its ε values are not given. Here, in the matched-ε protocol
(:mod:`dpfl_reproductions.benchmark`):

* record-level (ε, δ = 1e-3) per client, E3's δ, the noise calibrated by the RDP accountant over
  the batches' sampling (``calibration="accountant"``: both methods' per-sample sums are
  amplified by it), at ε ∈ :data:`EPSILONS` (E3's grid's ends and middle; ``--only epsilon=``
  any);
* E3's federation (MNIST, 25 IID clients, every client every round), batch 32, the MLP,
  :data:`EPOCHS` epochs;
* each method's 20 grid points by successive halving on a validation split of 5,000 training
  images at seed 0, the full-length confirmation, then seeds 1–3 on the test set (4–10 where
  three cannot separate the two: :func:`~dpfl_reproductions.benchmark.seed_runs`);
* the claim decided per ε by the paired interval of Clip21-SGD2M+ − Clip-SGD: "competitive"
  (confirmed) unless the interval lies wholly below 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpfl.config import format_options
from dpfl_reproductions.benchmark import (
    SELECTION_SEED,
    Cell,
    Plan,
    Setting,
    run_protocol,
)
from dpfl_reproductions.lab import Lab
from dpfl_reproductions.pcdp import interval
from dpfl_reproductions.registry import experiment
from dpfl_reproductions.selection import LEVEL, Config, decided, final_accuracy, grid, paired

EPSILONS = (3.0, 9.0, 27.0)
EPOCHS = 150
CLIENTS, BATCH = 25, 32
ROUNDS = EPOCHS * (60_000 // CLIENTS // BATCH)  # 75 rounds an epoch, drop_last
NUM_VALIDATION = 5000
SEEDS = (1, 2, 3)
#: method: its keys outside the grid
METHODS: dict[str, Config] = {
    "clip-sgd": {"algorithm": "clip-sgd", "clipping": "per-sample"},
    "clip21-sgd2m-plus": {"algorithm": "clip21-sgd2m-plus", "clip-inner": 0.1, "beta": 0.1,
                          "beta-hat": 0.01},
}
#: the paper's grids: τ_out (Clip-SGD's τ) × γ, the same for both
GRID = {"clip": (0.01, 0.03, 0.1, 0.3, 1.0), "learning-rate": (0.01, 0.1, 1.0, 10.0)}
REFERENCE, CHALLENGER = "clip-sgd", "clip21-sgd2m-plus"
SMOKE = {"dataset": "digits", "clients": 4, "rounds": 8, "validation": 200,
         "epsilons": (8.0,), "seeds": (1, 2),
         "grid": {"clip": (0.1, 1.0), "learning-rate": (0.1, 1.0)}}


@dataclass(frozen=True)
class AmplifiedPlan(Plan):
    """The benchmark's plan on E3's federation (``settings``: the dataset)."""

    clients: int = CLIENTS

    def families(self) -> dict[str, tuple[str, ...]]:
        return {"Fig. J.1": tuple(METHODS)}

    def caption(self, setting: Setting) -> str:
        return "δ = 1e-3"

    def points(self, algorithm: str) -> list[Config]:
        axes = SMOKE["grid"] if self.smoke else GRID
        return grid(**{k.replace("-", "_"): v for k, v in axes.items()})

    def config(self, cell: Cell, point: Config, seed: int, share: int = 1) -> Config:
        setting, method, epsilon = cell
        rounds = self.rounds // share
        return {"dataset": setting.dataset,
                "dataset-options": format_options({"num_validation": self.validation}),
                "partitioner": "iid", "num-partitions": self.clients, "model": "mlp",
                "batch-size": BATCH, "epsilon": epsilon, "delta": 1e-3,
                "calibration": "accountant", "num-server-rounds": rounds,
                "calibration-rounds": self.rounds, "eval-every": rounds, "seed": seed,
                **METHODS[method], **point}


def plan_of(lab: Lab) -> AmplifiedPlan:
    smoke = lab.smoke
    epsilons = tuple(float(e) for e in lab.restrict("epsilon", SMOKE["epsilons"] if smoke
                                                     else EPSILONS))
    clients = SMOKE["clients"] if smoke else CLIENTS
    return AmplifiedPlan(
        settings=(Setting(SMOKE["dataset"] if smoke else "mnist", f"n{clients}-iid"),),
        algorithms=tuple(lab.restrict("method", list(METHODS))), epsilons=epsilons,
        seeds=tuple(int(s) for s in lab.restrict("seed", SMOKE["seeds"] if smoke else SEEDS)),
        rounds=SMOKE["rounds"] if smoke else ROUNDS,
        validation=SMOKE["validation"] if smoke else NUM_VALIDATION, smoke=smoke,
        clients=clients)


@experiment("clip21", "amplified", "E5: Clip21-SGD2M+ against example-wise Clip-SGD, per-sample "
            "clipping amplified by sampling (Fig. J.1), each tuned alike on validation",
            axes=("method", "epsilon", "seed"))
def amplified(lab: Lab) -> str:
    plan = plan_of(lab)
    lab.text(f"""
## Protocol

{plan.settings[0].dataset}, {plan.clients} IID clients taking part in every round (E3's federation), batch {BATCH},
the MLP, {plan.rounds} rounds ({EPOCHS} epochs in the full run). Record-level (ε, δ = 1e-3) per
client, replace-one neighbours, the noise calibrated by the RDP accountant over the batches'
sampling for the full-length run. Clip21-SGD2M+ with τ_in = 0.1, β = 0.1, β̂ = 0.01 (the
paper's); Clip-SGD clipping each example. Each method's {len(plan.points(REFERENCE))} points
(τ_out × γ, the paper's grids) by successive halving on {plan.validation:,} validation images at
seed {SELECTION_SEED} (a quarter of the rounds, the best 4 half, the best 2 all, then a
full-length confirmation with the quarter rung's best 4 and the neighbouring ε's points), then
seeds {', '.join(map(str, plan.seeds))}. "Competitive" (the paper's word) is decided per ε by
the paired {LEVEL:.0%} interval of Clip21-SGD2M+ − Clip-SGD: confirmed unless it lies wholly
below 0.
""")
    _, results = run_protocol(lab, plan, "clip21/amplified")
    setting = plan.settings[0]
    rows = []
    for epsilon in plan.epsilons:
        ours, theirs = (results.get((setting, m, epsilon)) for m in (CHALLENGER, REFERENCE))
        if ours is None or theirs is None:
            continue
        diff = paired([final_accuracy(s) for s in ours], [final_accuracy(s) for s in theirs],
                      common=True)
        rows.append([f"{epsilon:g}", f"{diff.mean:+.2f}", interval(diff),
                     decided(diff, competitive=True)])
    lab.table(f"Is Clip21-SGD2M+ competitive with example-wise Clip-SGD? Clip21-SGD2M+ − "
              f"Clip-SGD in test accuracy (points), paired by seed, {LEVEL:.0%} t-interval",
              ["ε", "mean difference", "interval", "verdict"], rows)
    return "Clip21 E5: Clip21-SGD2M+ against example-wise Clip-SGD, amplified by sampling"
