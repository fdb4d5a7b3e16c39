"""The engine end to end: results folder, reproducibility, budget stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpfl.engine import run


@pytest.mark.summary_plot
def test_results_folder_has_every_artifact(small_config):
    summary = run(small_config(), echo=False)
    path = summary["results"]
    from pathlib import Path

    folder = Path(path)
    assert json.loads((folder / "config.json").read_text())["run_config"]["num-partitions"] == 4
    rounds = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert set(r["epsilon"]) == {"0", "1", "2", "3"}
        for key in ("test_loss", "test_accuracy", "clip", "seconds", "epsilon_max"):
            assert r[key] is not None, key
        assert "train_loss" not in r  # a client's exact loss is never sent in the private mode
    assert rounds[-1]["epsilon_max"] > rounds[0]["epsilon_max"] > 0
    saved = json.loads((folder / "summary.json").read_text())
    assert saved["rounds_completed"] == 3 and saved["epsilon_max"] <= 8.0
    state = torch.load(folder / "model.pt")
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert (folder / "summary.png").stat().st_size > 0


def test_a_pause_adds_to_the_wall_time_not_to_the_cpu_time(small_config, monkeypatch):
    """A run's ``cpu_seconds`` is its process's CPU time: a second the run spends stopped (a
    paused or suspended sweep; here a two-second sleep in its first exchange) is in its wall
    time and not in its CPU time (which, counting every thread, may exceed the rest of the
    wall time, hence the half-second margin); a checkpoint carries both, and one written before CPU time was counted
    leaves it unknown."""
    import time

    from dpfl.engine.runner import EngineTransport
    from dpfl.rounds.report import ReportWriter

    exchange, slept = EngineTransport.send_and_receive, []

    def paused(self, *args, **kwargs):
        if not slept:
            slept.append(2.0)
            time.sleep(2.0)
        return exchange(self, *args, **kwargs)

    monkeypatch.setattr(EngineTransport, "send_and_receive", paused)
    summary = run(small_config(), echo=False)
    wall, cpu = summary["wall_seconds"], summary["cpu_seconds"]
    assert wall > 2.0 and 0 < cpu < wall - 1.5
    assert json.loads((Path(summary["results"]) / "summary.json").read_text())[
        "cpu_seconds"] == summary["cpu_seconds"]

    writer = ReportWriter(None, "engine", Path("unused"), echo=False)
    writer.load_state_dict({"records": [], "last_eval": {}, "wall_seconds": 5.0,
                            "cpu_seconds": 4.0, "round": 2})
    assert writer.cpu_seconds() >= 4.0 and writer.state_dict()["cpu_seconds"] >= 4.0
    writer.load_state_dict({"records": [], "last_eval": {}, "wall_seconds": 5.0, "round": 2})
    assert writer.cpu_seconds() is None and writer.wall_seconds() >= 5.0


def test_ctrl_c_between_the_loops_steps_still_closes_the_results_folder(small_config,
                                                                        monkeypatch):
    """Ctrl-C lands wherever the process is: here in the driver, after round 3's first exchange
    was answered and before the loop was sent the answer (outside the loop's own code). The
    loop is thrown the interrupt, closes the results folder with the two rounds done and raises
    it again."""
    from dpfl.rounds import driver

    answered = driver.answered

    def interrupted(request, transport):
        answer = answered(request, transport)
        if isinstance(request, driver.ExchangeRequest) and request.server_round == 3:
            raise KeyboardInterrupt
        return answer

    monkeypatch.setattr(driver, "answered", interrupted)
    config = small_config(num_server_rounds=5)
    with pytest.raises(KeyboardInterrupt):
        run(config, echo=False)
    folder = Path(str(config["results-dir"])) / str(config["run-name"])
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["stopped_early"] == "interrupted in round 3"
    assert summary["rounds_completed"] == 2 and (folder / "model.pt").exists()


def test_same_seed_same_model_different_seed_different_model(small_config, tmp_path):
    a = torch.load(run(small_config(run_name="a"), echo=False)["results"] + "/model.pt")
    b = torch.load(run(small_config(run_name="b"), echo=False)["results"] + "/model.pt")
    c = torch.load(run(small_config(run_name="c", seed=1), echo=False)["results"] + "/model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_max_epsilon_stops_before_the_budget_is_exceeded(small_config):
    summary = run(small_config(num_server_rounds=40, noise_multiplier=4.0, max_epsilon=0.5),
                  echo=False)
    assert 0 < summary["rounds_completed"] < 40
    assert summary["epsilon_max"] <= 0.5
    assert "max-epsilon" in summary["stopped_early"]


def test_training_reduces_the_test_loss(small_config):
    summary = run(small_config(num_server_rounds=30, epsilon=8.0, learning_rate=1.0, clip=1.0,
                               num_partitions=10, batch_size=32), echo=False)
    rounds = [json.loads(line) for line in
              open(summary["results"] + "/rounds.jsonl").read().splitlines()]
    assert rounds[-1]["test_loss"] < 0.7 * rounds[0]["test_loss"]
    assert summary["test_accuracy"] > 0.6


@pytest.mark.cpu_only("a reference by hand on the CPU (test_cuda compares GPU runs with CPU runs)")
def test_eval_train_reports_the_full_objective_and_its_gradient_norm(small_config):
    from dpfl.problem import build_problem

    config = small_config(eval_train=True, non_private_diagnostics=True, num_server_rounds=1,
                          noise_multiplier=0.0)
    summary = run(config, echo=False)
    problem = build_problem(config)
    ds = problem.dataset
    saved = torch.load(summary["results"] + "/model.pt")
    flat = torch.cat([saved[k].reshape(-1) for k in saved])
    x = flat.clone().requires_grad_()
    loss = problem.model.flat.point_losses(x, ds.train_x, ds.train_y).mean()
    (grad,) = torch.autograd.grad(loss, x)
    assert summary["grad_norm"] == pytest.approx(float(grad.norm()), rel=1e-4)
    assert summary["train_loss_full"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert summary["privacy"]["guarantee_against_server"] is False


def test_model_options_reach_the_builder_and_are_checked(small_config):
    from dpfl.errors import ConfigError
    from dpfl.problem import build_problem

    wide = build_problem(small_config(model_options="hidden=32"))
    assert wide.model.d == 64 * 32 + 32 + 32 * 10 + 10
    with pytest.raises(ConfigError, match="model-options.*'depth'.*allowed: hidden"):
        build_problem(small_config(model_options="depth=3"))


def test_summary_says_whether_the_calibration_is_optimistic_or_conservative(small_config):
    practice = run(small_config(algorithm="clip21-sgd2m", calibration="practice",
                                epsilon=27.0, run_name="practice"), echo=False)
    assert "optimistic" in practice["calibration_check"]  # §4: practice is no DP guarantee
    paper = run(small_config(calibration="paper", epsilon=4.0, num_server_rounds=100,
                             eval_every=100, run_name="paper"), echo=False)
    assert "conservative" in paper["calibration_check"]  # PriSMA's Theorem 3 is loose
    accountant = run(small_config(epsilon=4.0, run_name="acc"), echo=False)
    assert "matched" in accountant["calibration_check"]
    manual = run(small_config(noise_multiplier=1.0, run_name="manual"), echo=False)
    assert manual["calibration_check"] is None


def test_a_diverging_run_warns_once_and_the_summary_keeps_it(small_config, capsys):
    from dpfl.engine import run

    summary = run(small_config(learning_rate=500.0, run_name="diverges"))
    out = capsys.readouterr().out
    assert out.count("WARNING: the test loss diverged") == 1
    assert len(summary["warnings"]) == 1 and "lower learning-rate (now 500)" in \
        summary["warnings"][0]
    assert run(small_config(run_name="learns"), echo=False)["warnings"] == []


def test_noise_that_dwarfs_the_clipped_signal_is_named_with_its_ratio(small_config, capsys):
    """noise-multiplier 10⁴ on DPSGD-GC's mean of 16 clipped gradients: the noise's norm per
    step, σC/b·√d (the Opacus multiplier: std over the radius C/b), over C and
    √(participants), is far above 100×; the default calibration is not."""
    import math

    from dpfl.engine import run

    summary = run(small_config(noise_multiplier=1e4, num_server_rounds=1, run_name="noisy"))
    warning = next(w for w in summary["warnings"] if w.startswith("the noise dwarfs"))
    d = 19210  # the default MLP on digits
    norm = 1e4 * 1.0 / 16 * math.sqrt(d)
    assert f"noise of norm {norm:.3g} a step" in warning
    assert f"still {norm / math.sqrt(4):.3g}×" in warning  # 4 participants, 1 step
    assert capsys.readouterr().out.count("WARNING: the noise dwarfs") == 1
    assert not any(w.startswith("the noise dwarfs")
                   for w in run(small_config(run_name="calm"), echo=False)["warnings"])


def test_a_sweeps_runs_log_a_warning_they_share_once(small_config, caplog):
    """Runs that do not echo (a sweep, a reproduction) log the warning they share once per
    process, not once per run; each run's summary keeps it."""
    import logging

    from dpfl.rounds import monitor
    from dpfl.rounds.statements import NON_PRIVATE

    monitor._LOGGED.discard(NON_PRIVATE)
    with caplog.at_level(logging.WARNING, logger="dpfl"):
        summaries = [run(small_config(seed=seed, non_private_diagnostics=True, run_name=f"s{seed}"),
                         echo=False) for seed in (1, 2, 3)]
    assert sum(NON_PRIVATE in message for message in caplog.messages) == 1
    assert all(s["privacy"]["note"] == NON_PRIVATE for s in summaries)


def test_a_rounds_record_lists_the_clients_it_charged_and_the_summary_every_one(small_config):
    """Under partial participation a round's ``epsilon`` holds its participants' ε alone (a
    line the size of the cohort, however many clients took part before), and summary.json every
    client's."""
    summary = run(small_config(num_partitions=12, fraction_train=0.25, num_server_rounds=4),
                  echo=False)
    rounds = [json.loads(line) for line in
              (Path(summary["results"]) / "rounds.jsonl").read_text().splitlines()]
    assert all(len(r["epsilon"]) == r["participants"] == 3 for r in rounds)
    listed = {c for r in rounds for c in r["epsilon"]}
    assert listed == {str(c) for c in summary["epsilon"]} and len(listed) > 3
    for r in rounds:  # each as the summary has it where that client took no later part
        later = {c for s in rounds if s["round"] > r["round"] for c in s["epsilon"]}
        assert all(summary["epsilon"][int(c)] == e for c, e in r["epsilon"].items()
                   if c not in later)
