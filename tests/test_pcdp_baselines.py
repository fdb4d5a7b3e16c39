"""``dpfl reproduce pcdp federated-mnist-baselines|federated-fmnist-baselines|noniid-tuned``:
FedLRS, MOON and simplified PFA beside FedPCDP, each at its own server step, and the runs of the
paper's other methods unchanged by their addition; Fig. 4 with every method at its own server
step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dpfl.runconfig import RunConfig
from dpfl_reproductions.lab import Lab
from dpfl_reproductions.pcdp import SETTINGS, config_of
from dpfl_reproductions.pcdp_tuned import NONIID_METHODS, SERVER_LRS, plan_of


@pytest.mark.parametrize("method", ["fedlrs", "moon", "pfa-simplified"])
def test_each_baseline_runs_the_federations_local_setting_with_its_own_keys(tmp_path, method):
    values = RunConfig({**config_of(SETTINGS["federated-mnist"], method, 4.0, 1, "code",
                                    server_lr=3.0), "results-dir": str(tmp_path)})
    assert values["algorithm"] == method and values["noise-multiplier"] == 4.0
    assert (values["batch-size"], values["local-steps"], values["fraction-train"]) == (250, 5, 0.8)
    assert values["server-learning-rate"] == 3.0 and values["clip"] == 0.01
    if method == "pfa-simplified":  # projected onto the public records' 100 dimensions
        assert values["projection-dim"] == 100 and values["momentum"] == 0.9
    else:  # local DP-SGD on the whole gradient, Poisson batches, plain SGD
        assert values["sampling"] == "poisson"


def test_the_other_methods_runs_are_those_their_archives_hold():
    fedavg = config_of(SETTINGS["federated-mnist"], "dp-fedavg", 4.0, 1, "code")
    assert fedavg["sampling"] == "poisson" and fedavg["momentum"] == 0.9
    assert "projection-dim" not in fedavg
    scaffold = config_of(SETTINGS["noniid"], "dp-scaffold", 4.0, 1, "code")
    assert "momentum" not in scaffold and scaffold["sampling"] == "poisson"
    fedpcdp = config_of(SETTINGS["federated-mnist"], "fedpcdp", 4.0, 1, "code")
    assert fedpcdp["projection-dim"] == 100 and "sampling" not in fedpcdp


@pytest.mark.smoke
def test_the_smoke_run_decides_each_baseline_against_fedpcdp(tmp_path):
    from dpfl.cli import main

    assert main(["reproduce", "pcdp", "federated-mnist-baselines", "--smoke", "--only",
                 "method=fedpcdp,fedlrs,moon,pfa-simplified", "--results-dir",
                 str(tmp_path)]) == 0
    report = next(tmp_path.glob("*/report.md")).read_text()
    for text in ("## Does FedLRS beat FedPCDP?", "| FedLRS − FedPCDP | 4 |",
                 "| MOON − FedPCDP | 4 |", "| simplified PFA − FedPCDP | 4 |"):
        assert text in report, text


def test_fig4_tuned_decides_every_method_against_fedpcdp_at_its_own_step(tmp_path):
    plan = plan_of(Lab(tmp_path, smoke=False), replace(SETTINGS["noniid"], sigmas=(4,),
                                                        server_lrs=SERVER_LRS),
                   NONIID_METHODS, NONIID_METHODS[1:], NONIID_METHODS[0])
    # with DP-FedAvg without DP (σ = 0), the non-private reference
    assert set(plan.cells) == {(m, 4.0) for m in NONIID_METHODS} | {("dp-fedavg", 0.0)}
    assert plan.server_lrs == SERVER_LRS and plan.baseline == "fedpcdp"
    for cell in plan.cells:
        values = RunConfig({**plan.config(cell, 8.0, 1), "results-dir": str(tmp_path)})
        assert values["shards-per-partition"] == 1 and values["server-learning-rate"] == 8.0
