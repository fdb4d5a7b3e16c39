"""AdaptDP-FedAvg's T2–T4 in the interpolation regime: the specifications searched, the
non-private search runs, the rule that picks the regime, and the smoke reproduction."""

from __future__ import annotations

import pytest

from dpfl import cli
from dpfl_reproductions.adaptive_interpolation import (
    REGIME,
    Found,
    Spec,
    first_in_regime,
    non_private,
    specs,
    task_at,
)
from dpfl.runconfig import RunConfig


def test_the_search_starts_at_the_papers_model_as_the_reproduction_reads_it():
    t3 = specs("t3", smoke=False)
    assert t3[0] == Spec("unit", "default", "relu")  # `adaptive t3`'s model
    assert len(t3) == len(set(t3)) == 3 * 2 * 3
    assert [s.scaling for s in t3[:6]] == ["unit"] * 6  # one change at a time outward
    t2 = specs("t2", smoke=False)
    assert {s.scaling for s in t2} == {None} and len(t2) == 6  # the bank has no pixels


def test_a_specification_changes_only_the_model_and_the_pixels():
    task = task_at("t4", Spec("raw", "normal", "tanh"))
    assert task.data["model-options"] == 'hidden=512 activation="tanh" init="normal"'
    assert task.data["dataset-options"] == 'num_train={n} scaling="raw"'
    assert task.data["dataset"] == "fashion-mnist" and (task.rounds, task.local_steps) == (1000, 15)
    bank = task_at("t2", Spec(None, "default", "sigmoid"))
    assert "dataset-options" not in bank.data and "hidden=128" in bank.data["model-options"]


def test_the_search_runs_without_noise_but_with_the_clip():
    config = non_private(task_at("t3", Spec("unit", "default", "relu")),
                         {"learning-rate": 0.3, "clip": 0.05}, smoke=False)
    assert config["noise-multiplier"] == 0.0 and "noise-size" not in config
    assert config["clip"] == 0.05 and config["algorithm"] == "dp-fedavg"
    RunConfig(config)  # a valid run


def test_the_regime_is_the_first_specification_that_reaches_it():
    found = [Found(Spec(s, "default", "relu"), {}, {"derived": {"min_train_loss": loss}})
             for s, loss in (("unit", 0.3), ("standardised", 5e-4), ("raw", 1e-6))]
    assert first_in_regime(found, REGIME) is found[1]  # not the lowest: the nearest
    assert first_in_regime(found[:1], REGIME) is None


@pytest.mark.smoke
def test_the_smoke_search_then_runs_the_tasks_protocol_at_its_regime(tmp_path, capsys):
    assert cli.main(["reproduce", "adaptive", "interpolation", "--smoke",
                     "--results-dir", str(tmp_path)]) == 0
    assert "adaptive/interpolation: ≈" in capsys.readouterr().out
    report = (tmp_path / "reproduce-adaptive-interpolation-smoke" / "report.md").read_text()
    for text in ("Cost estimate", "the search, without noise", "**chosen**",
                 "# T3: MNIST, random features, pixels unit, init default, relu",
                 "Table 2: lowest training loss", "Reruns of the selected points"):
        assert text in report
