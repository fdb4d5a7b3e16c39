"""Bad input: one clear line naming the key (and allowed values), exit 2, no traceback,
no results folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CASES = {
    "unknown_key": ("clipp=1.0", "clipp", "unknown key (did you mean 'clip'"),
    "key_the_algorithm_does_not_use": ("beta=0.5", "beta",
                                       "not used by algorithm 'dpsgd-gc' with calibration "
                                       "'accountant'; leave it at its default 0.1 (allowed: its "
                                       "own keys batch-size, learning-rate"),
    "key_the_calibration_does_not_use": ('algorithm="clip-sgd" practice-horizon="epochs"',
                                         "practice-horizon", "not used by algorithm 'clip-sgd' "
                                         "with calibration 'accountant'"),
    "eval_train_is_non_private": ("eval-train=true", "eval-train",
                                  "set non-private-diagnostics=true"),
    "gradient_noise_with_per_sample_clipping": (
        'algorithm="clip-sgd" clipping="per-sample" gradient-noise=0.1', "gradient-noise",
        "applies to clipping='client' only"),
    "eq_4_without_a_server_clip": ('algorithm="prisma" smoothness-L=11.0', "server-clip",
                                   "give a finite server-clip"),
    "noise_key_of_a_noise_free_algorithm": ('algorithm="non-prisma" epsilon=3.0', "epsilon",
                                            "not used by algorithm 'non-prisma', which adds no "
                                            "noise"),
    "unknown_dataset_option": ('dataset-options="dup=2"', "dataset-options",
                               "dataset 'digits' has no option 'dup' (allowed: num_public)"),
    "unparsable_dataset_options": ('dataset-options="num_public"', "dataset-options",
                                   "cannot parse 'num_public' is not key=value"),
    "wrong_type": ('clip="big"', "clip", "expected float"),
    "clip_not_positive": ("clip=0.0", "clip", "must be > 0"),
    "epsilon_not_positive": ("epsilon=-1.0", "epsilon", "must be > 0"),
    "delta_zero": ("delta=0.0", "delta", "(0, 1)"),
    "delta_above_one": ("delta=1.5", "delta", "(0, 1)"),
    "more_partitions_than_samples": ("num-partitions=5000", "num-partitions", "allowed: 1..1437"),
    "unknown_dataset": ('dataset="imagenet"', "dataset", "allowed: a9a"),
    "unknown_model": ('model="gpt"', "model", "allowed:"),
    "unknown_algorithm": ('algorithm="sgd"', "algorithm",
                          "dp-fedavg, dp-fedavg-quantile, dp-scaffold, dp-sgd, dpsgd-gc"),
    "unknown_accountant": ('accountant="gdp"', "accountant", "allowed: rdp, prv"),
    "missing_data_directory": ('dataset="mnist" data-dir="/nonexistent/data"', "dataset",
                               "/nonexistent/data"),
    "calibration_not_offered": ('calibration="practice"', "calibration",
                                "allowed: accountant, paper"),
    "batch_larger_than_client": ("batch-size=1000", "batch-size", "allowed: 1.."),
}


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gives_one_clear_line(name, tmp_path, capsys):
    """Every case through the command line's entry point, in this process."""
    from dpfl.cli import main

    override, key, fragment = CASES[name]
    results = tmp_path / "results"
    assert main(["run", "--run-config",
                 f'{override} results-dir="{results}" num-server-rounds=1']) == 2
    out = capsys.readouterr()
    line = _one_line(out.err)
    assert f"'{key}'" in line and fragment in line
    assert "Traceback" not in out.err + out.out
    assert not results.exists() or not any(results.iterdir())


# One case of each stage that can refuse: parsing a key, the schema, loading data, building
# the federation. A process per case costs seconds of imports, so the others run in-process.
@pytest.mark.parametrize("name", ["unknown_key", "key_the_algorithm_does_not_use",
                                  "missing_data_directory", "batch_larger_than_client"])
def test_bad_input_stops_the_process_with_status_2_and_no_traceback(name, tmp_path):
    override, key, fragment = CASES[name]
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "dpfl", "run", "--run-config",
         f'{override} results-dir="{results}" num-server-rounds=1'],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert f"'{key}'" in line and fragment in line
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not results.exists() or not any(results.iterdir())


def test_flower_refuses_the_fast_engine_mode_before_starting_anything(tmp_path):
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "dpfl", "flower", "--run-config",
         f'engine-mode="fast" results-dir="{results}" num-server-rounds=1'],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "FLWR_HOME": str(tmp_path / "flwr")})
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert "'engine-mode'" in line and "allowed: exact" in line
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not results.exists() and not (tmp_path / "flwr").exists()
