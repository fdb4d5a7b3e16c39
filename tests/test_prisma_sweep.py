"""PriSMA's Figure 1 machinery: the vectorised least-squares simulator against the engine, its
batching, the lab's batched runs and their resumption, and the smoke reproduction."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from dpfl import cli
from dpfl.engine.runner import EngineTransport
from dpfl_reproductions import least_squares
from dpfl_reproductions.lab import ARCHIVE, Lab
from dpfl_reproductions.prisma import config_of, estimate_seconds
from dpfl_reproductions.selection import axis_neighbours, neighbours
from dpfl.problem import build_problem
from dpfl.rounds import RoundLoop, drive
from dpfl.runconfig import RunConfig

PRISMA = {"learning-rate": 0.1, "clip": 5.0, "gamma": 0.05, "clip-diff": 0.01,
          "num-server-rounds": 40}
DPSGD = {"learning-rate": 0.1, "clip": 5.0, "num-server-rounds": 40}


def _config(method, point, tmp_path, *, size=2000, seed=3, **changes):
    values = {**config_of(method, point, size, seed), "batch-size": 40,
              "results-dir": str(tmp_path), **changes}
    return RunConfig(values)


def _engine_iterate(config):
    problem = build_problem(config)
    loop = RoundLoop(problem, "engine", echo=False)
    drive(loop, EngineTransport(problem))
    return loop.algorithm.global_params(loop.state).double()


@pytest.mark.parametrize("method, point", [("prisma", PRISMA), ("dpsgd-gc", DPSGD),
                                           ("prisma", {**PRISMA, "clip": 0.5})])
@pytest.mark.cpu_only("the float64 simulator runs on the CPU")
def test_the_simulator_follows_the_engine_to_float32_rounding(tmp_path, method, point):
    """Same seed, same draws: the float64 simulator and the float32 engine reach the same x^T
    (PriSMA eq. (20) with C2 = 1 and C3 active, DPSGD-GC, and C1 clipping most samples)."""
    config = _config(method, point, tmp_path)
    expected = _engine_iterate(config)
    (result,) = least_squares.LeastSquaresSweep(config).run([config])
    assert result["rounds"] == 40
    assert torch.allclose(result["x"], expected, rtol=1e-4, atol=1e-5)
    assert (result["x"] - expected).abs().max() > 0  # two computations, not one
    sweep = least_squares.LeastSquaresSweep(config)
    assert result["grad_norm"] == pytest.approx(
        float(torch.linalg.vector_norm(sweep.gradient(expected[None]))), rel=1e-4)


def test_a_configuration_does_not_depend_on_its_batch(tmp_path):
    """Configurations share the draws, not their arithmetic: alone or among others (of other
    horizons, methods and chunks), a configuration reaches the same iterate."""
    base = _config("prisma", PRISMA, tmp_path)
    sweep = least_squares.LeastSquaresSweep(base)
    alone = sweep.run([base])[0]
    others = [_config("dpsgd-gc", {**DPSGD, "num-server-rounds": 20}, tmp_path)] + [
        _config("prisma", {**PRISMA, "learning-rate": 0.01 * k}, tmp_path) for k in range(1, 40)]
    batched = sweep.run(others[:20] + [base] + others[20:])[20]
    assert torch.allclose(batched["x"], alone["x"], rtol=1e-12, atol=1e-14)


def test_the_fused_kernels_compute_what_the_eager_ones_do(tmp_path):
    config = _config("prisma", PRISMA, tmp_path)
    eager = least_squares.LeastSquaresSweep(config).run([config])[0]
    saved = least_squares._clipped_coefficients, least_squares._increment_coefficients
    try:
        if not least_squares.compile_kernels():
            pytest.skip("torch.compile is not available on this machine")
        fused = least_squares.LeastSquaresSweep(config).run([config])[0]
    finally:
        least_squares._clipped_coefficients, least_squares._increment_coefficients = saved
    assert torch.allclose(fused["x"], eager["x"], rtol=1e-10, atol=1e-12)


def test_the_simulator_refuses_what_it_does_not_simulate(tmp_path):
    config = _config("prisma", PRISMA, tmp_path)
    sweep = least_squares.LeastSquaresSweep(config)
    with pytest.raises(ValueError, match="batch-size"):
        sweep.run([_config("prisma", PRISMA, tmp_path, **{"batch-size": 20})])
    with pytest.raises(ValueError, match="eq. \\(4\\)"):
        sweep.run([_config("prisma", {**PRISMA, "smoothness-L": 11.0, "clip-diff": 0.5},
                           tmp_path)])
    with pytest.raises(ValueError, match="d < 16"):
        least_squares.LeastSquaresSweep(_config("prisma", PRISMA, tmp_path,
                                                **{"dataset-options": "dim=16"}))
    with pytest.raises(ValueError, match="cannot simulate"):
        sweep.run([_config("dpsgd-gc", DPSGD, tmp_path, algorithm="clip-sgd")])


def test_the_lab_runs_batches_once_and_resumes_from_its_archive(tmp_path):
    calls = []

    def simulate(group):
        calls.append(len(group))
        return [{"rounds_completed": 1, "derived": {"grad_norm": float(c["learning-rate"])}}
                for c in group]

    configs = [config_of("dpsgd-gc", {**DPSGD, "learning-rate": lr, "num-server-rounds": t},
                         2000, 0) for lr in (0.1, 0.2) for t in (10, 20)]
    lab = Lab(tmp_path / "lab", smoke=True)
    first = lab.run_batched(configs, federation=lambda c: c["num-server-rounds"],
                            simulate=simulate)
    assert calls == [2, 2] and [s["derived"]["grad_norm"] for s in first] == [0.1, 0.1, 0.2, 0.2]
    with gzip.open(tmp_path / "lab" / ARCHIVE, "rt") as f:
        assert len([json.loads(line) for line in f]) == 4
    again = Lab(tmp_path / "lab", smoke=True)  # a new invocation: reads its own archive
    assert again.run_batched(configs, federation=lambda c: 0, simulate=simulate) == first
    assert calls == [2, 2]
    # a resumed invocation that runs more keeps the earlier runs in every archive it rewrites
    extra = {**configs[0], "learning-rate": 0.3}
    third = Lab(tmp_path / "lab", smoke=True)
    third.run_batched([extra, *configs], federation=lambda c: 0, simulate=simulate)
    assert calls == [2, 2, 1]
    with gzip.open(tmp_path / "lab" / ARCHIVE, "rt") as f:
        assert len([json.loads(line) for line in f]) == 5


def test_neighbours_step_once_on_every_axis_and_stop_at_the_grid_ends():
    axes = {"a": (1, 2, 3), "b": (0.1, 0.2)}
    assert len(neighbours({"a": 2, "b": 0.1}, axes)) == 3 * 2
    assert {p["a"] for p in neighbours({"a": 3, "b": 0.2}, axes)} == {2, 3}


def test_axis_neighbours_step_on_one_axis_at_a_time():
    """Two a coordinate inside the grid (8 on four axes, where any axes at once give 80), one
    at a grid end, the point itself first."""
    axes = {k: (1, 2, 3) for k in "abcd"}
    middle = dict.fromkeys("abcd", 2)
    points = axis_neighbours(middle, axes)
    assert points[0] == middle and len(points) == 1 + 2 * 4 and len(neighbours(middle, axes)) == 81
    assert all(sum(p[k] != 2 for k in "abcd") == 1 for p in points[1:])
    assert len(axis_neighbours({**middle, "a": 3}, axes)) == 1 + 1 + 2 * 3


def test_the_cost_estimate_grows_with_rounds_records_and_configurations():
    one = config_of("prisma", {**PRISMA, "num-server-rounds": 1000}, 2000, 0)
    assert estimate_seconds([one]) > 0
    assert estimate_seconds([{**one, "num-server-rounds": 2000}]) == pytest.approx(
        2 * estimate_seconds([one]))
    big = config_of("prisma", {**PRISMA, "num-server-rounds": 1000}, 12000, 0)
    assert estimate_seconds([big]) > 3 * estimate_seconds([one])


@pytest.mark.smoke
def test_the_smoke_reproduction_reports_figure_1(tmp_path, capsys):
    assert cli.main(["reproduce", "prisma", "least-squares", "--smoke",
                     "--results-dir", str(tmp_path)]) == 0
    folder = tmp_path / "reproduce-prisma-least-squares-smoke"
    report = (folder / "report.md").read_text()
    for text in ("Figure 1 numbers", "PriSMA below DPSGD-GC at every N", "fitted slopes",
                 "dpfl run --run-config", "accountant ε", "Cost estimate"):
        assert text in report
    assert (folder / "figure1.png").stat().st_size > 0
    with gzip.open(folder / ARCHIVE, "rt") as f:
        assert sum(1 for _ in f) > 100


@pytest.mark.smoke
def test_the_smoke_table_1_runs_on_synthetic_cifar_shaped_data(tmp_path):
    """§5.2's pipeline end to end (the DP-FTRL CNN, both methods, tuning, trials, the paper's
    numbers beside ours) on synthetic CIFAR-shaped images: CIFAR-10 and a GPU are for the full
    size."""
    assert cli.main(["reproduce", "prisma", "cifar10", "--smoke",
                     "--results-dir", str(tmp_path)]) == 0
    report = (tmp_path / "reproduce-prisma-cifar10-smoke" / "report.md").read_text()
    assert "| 8 | PriSMA |" in report and "| 8 | DPSGD-GC |" in report
    assert "61.20 ± 0.19" in report  # the paper's cell beside ours
    assert 'model="dpftrl-cnn"' in report and "server-clip=2.0" in report  # C2 = min(4, C1/2)


def test_the_cifar_grid_is_the_papers():
    from dpfl_reproductions.prisma import cifar_config, cifar_grid

    assert len(cifar_grid("prisma", False, coarse=False)) == 675
    assert len(cifar_grid("dpsgd-gc", False, coarse=False)) == 45
    assert len(cifar_grid("prisma", False, coarse=True)) == 180
    config = cifar_config("prisma", {"clip": 16.0}, 4.0, 0, False)
    assert config["server-clip"] == 4.0 and config["batch-size"] == 512
    assert config["num-server-rounds"] == 1000 and config["delta"] == 1e-5


def test_cifar10_scaling_is_checked_before_any_data_is_read():
    from dpfl.datasets import load_dataset
    from dpfl.errors import ConfigError

    with pytest.raises(ConfigError, match="dataset-options.*standardised, symmetric"):
        load_dataset("cifar10", seed=0, scaling="unit")


def test_a_reproduction_without_its_data_stops_with_one_line_and_writes_nothing(
        tmp_path, monkeypatch, capsys):
    """CIFAR-10 absent: the dataset is loaded once before any run, in this process, so the
    experiment stops with the loader's line (exit 2) before its folder exists; and a
    ConfigError raised in a worker process would cross back whole."""
    import pickle

    from dpfl.errors import ConfigError

    monkeypatch.setenv("DPFL_DATA_DIR", str(tmp_path / "empty"))
    code = cli.main(["reproduce", "prisma", "cifar10", "--only", "epsilon=8", "--only",
                     "method=dpsgd-gc", "--results-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "'cifar10' is not available locally" in err[0]
    assert not (tmp_path / "out").exists()
    error = pickle.loads(pickle.dumps(ConfigError("clip", "must be > 0", allowed="0..1")))
    assert str(error) == "run config key 'clip': must be > 0 (allowed: 0..1)"
