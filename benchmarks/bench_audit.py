"""Every algorithm audited: the canary method's ε lower bound and the Gaussian-DP fit's
estimate beside the ledger's ε, as a Markdown table (the README's and docs/audit.md's).

    .venv/bin/python benchmarks/bench_audit.py [--trials 1000] [--workers 2]
        [--out reports/audit] [--only ALGORITHM[,ALGORITHM...]]

``--only`` audits those algorithms' rows again and, with ``--out``, replaces them in the
archive there (the other rows are kept).

All on digits with logistic regression, 10 IID clients, 5 rounds, δ = 1e-5, the gradient
canary (:mod:`dpfl.audit.gradient_canary`) unless a column says "input canary":

* ``defaults``: ``dpfl audit`` at the algorithm's defaults (ε = 8, the accountant calibration,
  its own batch size): what a user's first audit shows;
* ``full batch``: every batch is the audited client's whole data (the client with the fewest
  records), at ε = 8: no sampling amplification, so the canary is in every step and the
  audit is as tight as this method gets; the input canary's figures beside the gradient
  canary's;
* ``full batch, ε = 1`` and ``ε = 4``: the same at other budgets, for the algorithms whose
  tightness is measured (:data:`TIGHT`; at ε = 1 with 5,000 runs a side, :data:`TRIALS`);
* ``full batch, k′ = d`` (RPDP-SGD): the same with the random subspace the whole space, where
  a canary's gradient keeps its whole norm in it (at k′ < d a fixed canary keeps a k′/d share);
* ``paper``: as ``full batch`` with ``calibration="paper"`` at ε = 2 (within the audit's
  reach), for every algorithm that offers the paper's own σ formula: the ε the paper claims,
  the accountant's ε for the noise it gives, and whether the audit refutes the claim;
* ``paper, ε = 8, own batches`` (AdaptDP-FedAvg): its paper's subsampled-RDP formula at the
  defaults' sampled batches, the one setting here where it gives a σ (none at ε = 2, nor with
  whole-data batches);
* ``practice``: the same with the Clip21 family's ``calibration="practice"`` (the related
  public code's σ formula, which claims less ε than the accountant gives).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfl.algorithms import ALGORITHMS  # noqa: E402
from dpfl.privacy.calibration import CALIBRATIONS  # noqa: E402
from dpfl.results import jsonable  # noqa: E402

ROUNDS = 5


#: the algorithms whose tightness is measured at ε = 1, 4 and 8
TIGHT = ("dp-sgd", "dpsgd-gc", "dp-fedavg", "pcdp-sgd", "fedpcdp", "dp-fedavg-quantile")
#: settings of one algorithm only, with their keys (RPDP-SGD's subspace as the whole space:
#: ``projection-dim`` above d keeps every row of the rotation; AdaptDP-FedAvg's paper mapping
#: where it has a σ: none at ε = 2)
EXTRA = {"rpdp-sgd": [("full batch, k′ = d", {"projection-dim": 10**9})],
         "adaptdp-fedavg": [("paper, ε = 8, own batches",
                             {"epsilon": 8.0, "calibration": "paper"})]}
#: settings audited at the algorithm's own batch size (the others: full batches)
SAMPLED = ("defaults", "paper, ε = 8, own batches")
#: runs a side where the default leaves μ's standard error a fifth of μ (ε = 1: μ ≈ 0.24)
TRIALS = {"full batch, ε = 1": 5000}


def job_list(names: list[str]) -> list[tuple[str, str, dict]]:
    jobs = []
    for name in names:
        jobs.append((name, "defaults", {}))
        jobs.append((name, "full batch", {}))
        jobs += [(name, setting, keys) for setting, keys in EXTRA.get(name, [])]
        if name in TIGHT:
            jobs += [(name, f"full batch, ε = {e:g}", {"epsilon": e}) for e in (1.0, 4.0)]
        for calibration in ("paper", "practice"):
            if calibration in CALIBRATIONS.offered(name):
                jobs.append((name, calibration, {"epsilon": 2.0, "calibration": calibration}))
    return jobs


def one(job: tuple[str, str, dict, int]) -> dict:
    import torch

    from dpfl.audit import audit, full_batch
    from dpfl.runconfig import RunConfig

    name, setting, keys, trials = job
    torch.set_num_threads(1)
    values = {"algorithm": name, "model": "logistic", "num-server-rounds": ROUNDS, **keys}
    config, client = (RunConfig(values), 0) if setting in SAMPLED else full_batch(values)
    if setting not in SAMPLED and "batch-size" in config.reads:
        values = {**values, "batch-size": config["batch-size"]}
    try:
        result = audit(config, trials=trials, client=client)
    except ValueError as exc:  # a paper's formula that has no σ for this setting
        if "calibration" not in keys:
            raise
        return {"algorithm": name, "setting": setting, "run_config": values,
                "error": f"the paper's formula gives no noise for this setting: {exc}"}
    row = {"algorithm": name, "setting": setting, "run_config": values, **result.summary()}
    if setting == "full batch":
        by_input = audit(config, trials=trials, client=client, canary="input").summary()
        row["input_canary"] = {k: by_input[k] for k in ("epsilon_lower", "gdp_epsilon",
                                                        "gdp_epsilon_lower", "seconds")}
    return row


#: the figures an archived row may hold as ∞, which JSON keeps as null
INFINITE = ("epsilon_ledger", "epsilon_lower", "gdp_epsilon", "gdp_epsilon_lower")


def restored(row: dict) -> dict:
    """An archived row (audits.json) with its infinite figures back (a row whose audit ran
    has every one of :data:`INFINITE`, so null there means ∞)."""
    if "error" in row:
        return row
    row = {**row, **{k: math.inf for k in INFINITE if row[k] is None}}
    if row.get("input_canary"):
        row["input_canary"] = {k: math.inf if v is None else v
                               for k, v in row["input_canary"].items()}
    return row


def fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return "∞" if math.isinf(x) else f"{x:.3g}"


def refutes(r: dict, key: str) -> bool:
    """Whether ``r[key]`` is above the ledger's ε or the ε claimed."""
    return (math.isfinite(r["epsilon_ledger"]) and r[key] > r["epsilon_ledger"]) or (
        r["epsilon_target"] is not None and r[key] > r["epsilon_target"])


def table(rows: list[dict]) -> str:
    lines = ["| algorithm | setting | ε claimed | accountant ε | ε_lower (95%) | "
             "Gaussian fit ε (95% lower) | input canary: ε_lower, fit ε | trials | time (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | {r['setting']} | 2 | – | – | – | – | – | – |")
            continue
        mark = " **refutes**" if refutes(r, "epsilon_lower") else ""
        fit_mark = " **refutes**" if refutes(r, "gdp_epsilon_lower") else ""
        given = r.get("input_canary")
        by_input = (f"{fmt(given['epsilon_lower'])}, {fmt(given['gdp_epsilon'])}" if given
                    else "")
        seconds = r["seconds"] + (given["seconds"] if given else 0.0)
        lines.append(f"| {r['algorithm']} | {r['setting']} | {fmt(r['epsilon_target'])} | "
                     f"{fmt(r['epsilon_ledger'])} | {fmt(r['epsilon_lower'])}{mark} | "
                     f"{fmt(r['gdp_epsilon'])} ({fmt(r['gdp_epsilon_lower'])}){fit_mark} | "
                     f"{by_input} | {r['trials_per_side']} + {r['trials_per_side']} | "
                     f"{seconds:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default=None, help="comma-separated algorithm names")
    args = parser.parse_args()
    names = ALGORITHMS.names() if args.only is None else args.only.split(",")
    unknown = sorted(set(names) - set(ALGORITHMS.names()))
    if unknown:
        parser.error(f"--only: unknown algorithm {unknown[0]!r}; one of "
                     f"{', '.join(ALGORITHMS.names())}")
    kept = []
    if args.only is not None and args.out is not None and (args.out / "audits.json").exists():
        kept = [restored(r) for r in json.loads((args.out / "audits.json").read_text())
                if r["algorithm"] not in names]
    jobs = [(*job, max(args.trials, TRIALS.get(job[1], 0))) for job in job_list(names)]
    started = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(args.workers) as pool:
        for row in pool.map(one, jobs):
            rows.append(row)
            print(f"{row['algorithm']:20s} {row['setting']:10s} "
                  + (row["error"] if "error" in row else
                     f"ε_lower {row['epsilon_lower']:.3g} fit {row['gdp_epsilon']:.3g} "
                     f"ledger {row['epsilon_ledger']:.4g} ({row['seconds']:.0f} s)"), flush=True)
    order = {name: i for i, name in enumerate(ALGORITHMS.names())}
    rows = sorted(kept + rows, key=lambda r: order[r["algorithm"]])  # stable: settings' order
    text = table(rows)
    print(text)
    print(f"{len(rows)} audits in {time.perf_counter() - started:.0f} s on {args.workers} "
          f"workers")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "audits.json").write_text(json.dumps(jsonable(rows), indent=1) + "\n")
        (args.out / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
