"""dpfl's public API in a Flower app of one's own (docs/your-own-app.md):
``examples/quickstart-pytorch-dp``, Flower's quickstart-pytorch made private with
:class:`dpfl.PrivateFederation`, runs under a plain ``flwr run``, trains privately, and equals
dpfl's engine on the same run bit for bit; bad settings stop in one line naming the key."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import dpfl
from dpfl.algorithms import ALGORITHMS
from dpfl.config import format_overrides
from dpfl.errors import ConfigError
from dpfl.launch import BIN, final_status, simulation_env, started_processes, stop
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "quickstart-pytorch-dp"
SMALL = {"num-clients": 4, "num-server-rounds": 2, "max-train-records": 2000}


@pytest.fixture
def example(monkeypatch):
    """The example's package, importable as its apps import it."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield __import__("quickstart_dp.task").task
    for name in [m for m in sys.modules if m.startswith("quickstart_dp")]:
        del sys.modules[name]


def _run_config(**changes) -> dict:
    import tomllib

    config = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"]
    return {**config, **changes}


@pytest.mark.flower
def test_flwr_run_of_the_example_is_private_and_equals_the_engine(tmp_path, example):
    home = tmp_path / "home"
    env = {**simulation_env(home), "DPFL_DATA_DIR": os.environ["DPFL_DATA_DIR"]}
    try:
        flwr = subprocess.run(
            [str(BIN / "flwr"), "run", str(EXAMPLE), "--stream", "--run-config",
             format_overrides(SMALL), "--federation-config", "num-supernodes=4"],
            env=env, cwd=tmp_path, text=True, capture_output=True, timeout=600)
        status, details = final_status(BIN / "flwr", env, tmp_path)
    finally:
        stop(started_processes(home))
    assert status == "finished:completed", flwr.stdout[-3000:] + details
    assert "round 2/2" in flwr.stdout and "Traceback" not in flwr.stdout
    (folder,) = (tmp_path / "results").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and 7.9 < summary["epsilon_max"] <= 8.0
    # the ServerApp's own final model, from the strategy's Result, is the run's model
    final = torch.load(tmp_path / "final_model.pt")
    flower = torch.load(folder / "model.pt")
    assert final.keys() == flower.keys() and all(torch.equal(final[k], flower[k]) for k in final)
    net = example.Net()
    net.load_state_dict(final)  # the user's model, trained
    # the ServerApp's own evaluate_fn saw the model of each round: its accuracy is dpfl's
    for line in (folder / "rounds.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["evaluate_fn"]["accuracy"] == pytest.approx(record["test_accuracy"],
                                                                  abs=1e-6)
    # the same federation on dpfl's engine: the same model, bit for bit
    private = example.federation(_run_config(**SMALL))
    engine_run = dpfl.PrivateFederation(
        **{**{f.name: getattr(private, f.name) for f in dataclasses.fields(private)},
           "options": {**private.options, "results-dir": str(tmp_path), "run-name": "engine"}})
    assert engine_run.run(echo=False)["rounds_completed"] == 2
    engine = torch.load(tmp_path / "engine" / "model.pt")
    assert all(torch.equal(engine[k], flower[k]) for k in flower)


@pytest.mark.flower
def test_the_example_over_real_supernodes_draws_secret_noise(tmp_path):
    """The same apps over a SuperLink and three SuperNodes of their default policy: the run
    completes, every node drew secret noise, and the ε holds against the server."""
    from dpfl.federation import LocalFederation

    with LocalFederation(tmp_path) as federation:
        federation.env["DPFL_CACHE_DIR"] = str(tmp_path / "cache")
        federation.env["DPFL_STATE_DIR"] = str(tmp_path / "state")
        env = federation.start(["0", "1", "2"])
        done = subprocess.run(
            [str(BIN / "flwr"), "run", str(EXAMPLE), "local-deployment", "--stream",
             "--run-config", format_overrides({**SMALL, "num-clients": 3})],
            env=env, cwd=tmp_path, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (summary_file,) = tmp_path.rglob("summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["rounds_completed"] == 2
    assert summary["privacy"]["guarantee_against_server"] is True
    assert summary["privacy"]["noise"] == {"secure": 3}
    (final,) = tmp_path.rglob("final_model.pt")
    assert torch.load(final).keys() == torch.load(summary_file.parent / "model.pt").keys()


def test_hyperparameters_as_the_algorithms_dataclass_give_the_same_run(example):
    given = example.federation(_run_config(**SMALL))
    typed = given.run_config.hyperparameters
    assert type(typed) is ALGORITHMS.get("dpsgd-gc").Hyperparameters
    again = dpfl.PrivateFederation("dpsgd-gc", model=example.Net, data=example.load_mnist,
                                   num_clients=4, num_rounds=2, hyperparameters=typed,
                                   options={"dataset-options": "max_train_records=2000"})
    assert dict(again.run_config) == dict(given.run_config)


@pytest.mark.parametrize(("arguments", "key"), [
    ({"algorithm": "dp-sdg"}, "algorithm"),
    ({"model": lambda input_shape, num_classes: None}, "model"),
    ({"hyperparameters": {"clip": -1.0}}, "clip"),
    ({"options": {"epsilon": 4.0}}, "epsilon"),
    ({"hyperparameters": {"learnng-rate": 0.1}}, "learnng-rate"),
])
def test_bad_settings_stop_in_one_line_naming_the_key(example, arguments, key):
    settings = {"algorithm": "dpsgd-gc", "model": example.Net, "data": example.load_mnist,
                "num_clients": 4, "num_rounds": 2, **arguments}
    with pytest.raises(ConfigError) as error:
        dpfl.PrivateFederation(**settings)
    assert error.value.key == key
    assert "\n" not in str(error.value)


def test_importing_dpfl_loads_neither_torch_nor_flower():
    code = ("import sys, dpfl; assert dpfl.__all__; "
            "print(sorted(m for m in ('torch', 'flwr') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True,
                         check=True).stdout
    assert out.strip() == "[]"
