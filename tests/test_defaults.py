"""Per-algorithm defaults: keys left at "auto" take the selected algorithm's own value, a given
value wins, and every algorithm learns on digits at its defaults (the test loss falls)."""

from __future__ import annotations

import pytest

from dpfl.algorithms import ALGORITHMS
from dpfl.config import AUTO
from dpfl.engine import run
from dpfl.runconfig import RunConfig, all_params


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_an_algorithms_defaults_are_per_algorithm_keys_it_reads(name):
    algorithm = ALGORITHMS.get(name)
    params = all_params()
    reads = RunConfig({"algorithm": name}).reads
    for key, value in algorithm.defaults.items():
        assert params[key].per_algorithm, key
        assert key in reads, key
        assert params[key].parse(value) == value


@pytest.fixture
def untuned(monkeypatch):
    """The algorithms' own defaults: no benchmarked points (:mod:`dpfl.algorithms.tuned`)."""
    from dpfl.algorithms import tuned

    monkeypatch.setattr(tuned, "POINTS", {})


def test_auto_takes_the_algorithms_value_and_a_given_value_wins(untuned):
    algorithm = ALGORITHMS.get("clip21-sgd2m")
    config = RunConfig({"algorithm": "clip21-sgd2m"})
    assert config["learning-rate"] == algorithm.defaults["learning-rate"]
    assert config.hyperparameters.learning_rate == algorithm.defaults["learning-rate"]
    assert {"learning-rate", "clip", "beta-hat", "dataset-options"} <= set(config.automatic)
    given = RunConfig({"algorithm": "clip21-sgd2m", "learning-rate": 0.5, "clip": AUTO})
    assert given["learning-rate"] == 0.5 and given["clip"] == algorithm.defaults["clip"]
    assert "learning-rate" not in given.automatic
    # a key the algorithm does not name takes the key's own default
    assert RunConfig({"algorithm": "dpsgd-gc"})["dataset-options"] == ""
    # replace() keeps an "auto" key following the algorithm, and a given one fixed
    switched = given.replace(algorithm="dpsgd-gc")
    assert switched["learning-rate"] == 0.5
    assert switched["clip"] == RunConfig({"algorithm": "dpsgd-gc"})["clip"]


def test_projection_algorithms_default_to_public_records():
    config = RunConfig({"algorithm": "pcdp-sgd"})
    assert "num_public=" in str(config["dataset-options"])


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_learns_on_digits_at_its_defaults(name, tmp_path):
    """A few rounds at the defaults (ε = 8 calibrated for them): the test loss falls below the
    initial model's, and nothing diverges."""
    summary = run(RunConfig({"algorithm": name, "num-server-rounds": 8,
                             "results-dir": str(tmp_path), "run-name": name}), echo=False)
    assert summary["test_loss"] < summary["initial_test_loss"]
    assert not any(w.startswith("the test loss diverged") for w in summary["warnings"])


def test_dpfl_keys_prints_what_auto_gives_the_algorithm(capsys, monkeypatch):
    from dpfl.algorithms import tuned
    from dpfl.cli import main

    assert main(["keys", "clip21-sgd2m"]) == 0
    lr = tuned.POINTS["clip21-sgd2m"][8.0]["learning-rate"]
    assert f"learning-rate={lr!r}  [auto: follows ε, here ε = 8" in capsys.readouterr().out
    monkeypatch.setattr(tuned, "POINTS", {})
    assert main(["keys", "clip21-sgd2m"]) == 0
    out = capsys.readouterr().out
    lr = ALGORITHMS.get("clip21-sgd2m").defaults["learning-rate"]
    assert f"learning-rate={lr!r}  [auto: clip21-sgd2m's own]" in out
    assert main(["keys"]) == 0
    assert 'dataset-options="auto"' in capsys.readouterr().out


def test_a_run_names_the_values_auto_gave(tmp_path, capsys, untuned):
    run(RunConfig({"algorithm": "clip21-sgd2m", "num-server-rounds": 1,
                   "results-dir": str(tmp_path), "run-name": "named"}))
    defaults = ALGORITHMS.get("clip21-sgd2m").defaults
    assert (f"clip21-sgd2m's defaults: learning-rate={defaults['learning-rate']!r} "
            f"clip={defaults['clip']!r}") in capsys.readouterr().out


def test_the_readmes_demo_line_is_what_the_default_run_prints_now(tmp_path, capsys):
    """The README quotes the demo's last round line; the default run (the engine: ``make run``'s
    ``flwr run`` gives the same model bit for bit, and ``tests/test_docs.py`` checks the
    printed line there too) prints it now. It went stale once when the "auto" defaults began
    to follow ε."""
    import re

    from tests.conftest import ROOT

    quoted = re.search(r"`(round 30/30 \| [^`]*)`", (ROOT / "README.md").read_text()).group(1)
    run(RunConfig({"results-dir": str(tmp_path)}), echo=True)
    printed = re.search(r"^(round 30/30 \| .*\(δ=[^)]*\))", capsys.readouterr().out, re.M)
    assert printed is not None and quoted == printed.group(1)
