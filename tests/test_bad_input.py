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
    "secure_aggregation_of_in_step_noise": (
        'algorithm="dp-fedavg" secure-aggregation=true', "secure-aggregation",
        "algorithm 'dp-fedavg' cannot have its uploads summed securely"),
    "distributed_noise_without_secure_aggregation": (
        "distributed-noise=true", "distributed-noise", "it needs secure-aggregation=true"),
    "gradient_noise_with_per_sample_clipping": (
        'algorithm="clip-sgd" clipping="per-sample" gradient-noise=0.1', "gradient-noise",
        "applies to clipping='client' only"),
    "eq_4_without_a_server_clip": ('algorithm="prisma" smoothness-L=11.0', "server-clip",
                                   "give a finite server-clip"),
    "noise_key_of_a_noise_free_algorithm": ('algorithm="non-prisma" epsilon=3.0', "epsilon",
                                            "not used by algorithm 'non-prisma', which adds no "
                                            "noise"),
    "unknown_dataset_option": ('dataset-options="dup=2"', "dataset-options",
                               "dataset 'digits' has no option 'dup' (allowed: num_public, "
                               "num_validation)"),
    "unparsable_dataset_options": ('dataset-options="num_public"', "dataset-options",
                                   "cannot parse 'num_public' is not key=value"),
    "wrong_type": ('clip="big"', "clip", "expected float, got str 'big' (allowed: a float, or "
                   '"auto" for the algorithm\'s own value)'),
    "clip_not_positive": ("clip=0.0", "clip", "must be > 0"),
    "epsilon_not_positive": ("epsilon=-1.0", "epsilon", "must be > 0"),
    "delta_zero": ("delta=0.0", "delta", "(0, 1)"),
    "delta_above_one": ("delta=1.5", "delta", "(0, 1)"),
    "more_partitions_than_samples": ("num-partitions=5000", "num-partitions", "allowed: 1..1437"),
    "unknown_dataset": ('dataset="imagenet"', "dataset", "allowed: a9a"),
    "unknown_model": ('model="gpt"', "model", "allowed:"),
    "unknown_algorithm": ('algorithm="sgd"', "algorithm",
                          "dp-fedavg-quantile, dp-fedavg-user, dp-fedavg-user-local, dp-ftrl, "
                          "dp-scaffold"),
    "unknown_accountant": ('accountant="gdp"', "accountant", "allowed: rdp, prv"),
    "missing_data_directory": ('dataset="mnist" data-dir="/nonexistent/data"', "dataset",
                               "/nonexistent/data"),
    "calibration_not_offered": ('calibration="practice"', "calibration",
                                "allowed: accountant, paper"),
    "batch_larger_than_client": ("batch-size=1000", "batch-size", "allowed: 1.."),
    # what fuzzing found: non-finite values, sizes, folders, the run-config syntax
    "clip_infinite": ("clip=inf", "clip", "must be a finite number, got inf"),
    "clip_overflowing_to_infinity": ("clip=1e999", "clip", "must be a finite number"),
    "noise_multiplier_infinite": ("noise-multiplier=inf", "noise-multiplier",
                                  "must be a finite number"),
    "learning_rate_infinite": ("learning-rate=inf", "learning-rate", "must be a finite number"),
    "epsilon_infinite": ("epsilon=inf", "epsilon", "must be a finite number"),
    "epsilon_beyond_calibration": ("epsilon=1e7", "epsilon", "must be <= 1000000.0"),
    "epsilon_beyond_the_prv_search": ('epsilon=1000.0 accountant="prv"', "epsilon",
                                      "beyond what the prv accountant's search handles"),
    "max_epsilon_infinite": ("max-epsilon=inf", "max-epsilon", "must be a finite number"),
    "seed_beyond_the_loaders": ("seed=4294967296", "seed", "must be <= 4294967295"),
    "int_beyond_64_bits": ("batch-size=99999999999999999999", "batch-size",
                           "does not fit a 64-bit integer"),
    "model_options_negative_width": ('model-options="hidden=-5"', "model-options",
                                     "hidden must be a size in 1..1048576, got -5"),
    "model_options_huge_width": ('model-options="hidden=99999999999"', "model-options",
                                 "allowed: 1..1048576"),
    "model_options_wrong_kind": ('model="logistic" model-options="bias=1"', "model-options",
                                 "option bias must be bool, got int 1"),
    "model_options_twice": ('model-options="hidden=5 hidden=6"', "model-options",
                            "'hidden' is given twice"),
    "model_options_torch_refuses": ('model="resnet20" model-options="norm_groups=3"',
                                    "model-options", "must be divisible by num_groups"),
    "model_not_taking_the_inputs": ('model="clip21-cnn"', "model",
                                    "does not take inputs of shape (64,)"),
    "results_dir_unwritable": ('results-dir="{tmp}/a-file/results"', "results-dir",
                               "cannot create"),
    "results_dir_empty": ('results-dir=""', "results-dir", "must name a folder"),
    "results_dir_name_too_long": ('results-dir="{tmp}/' + 'a' * 300 + '"', "results-dir",
                                  "File name too long"),
    "run_name_escaping_results_dir": ('run-name="../escaped-run"', "run-name",
                                      "must be a plain folder name"),
    "run_name_absolute": ('run-name="/tmp/elsewhere"', "run-name", "must be a plain folder name"),
    "run_name_a_path": ('run-name="a/b"', "run-name", "must be a plain folder name"),
    "run_name_dot_dot": ('run-name=".."', "run-name", "must be a plain folder name"),
    "key_without_value": ("clip=", "clip", "no value after '='"),
    "bare_key": ("clip", "run-config", "'clip' is not a key=value pair"),
    "garbage_after_a_pair": ("clip=1.0 garbage", "run-config",
                             "'garbage' is not a key=value pair"),
    "spaces_around_equals": ("clip = 1.0", "run-config", "no spaces around"),
    "string_without_quotes": ("dataset=digits", "dataset", "cannot read 'dataset=digits': a "
                              "string value needs quotes (allowed: dataset=\"digits\""),
    "word_for_a_number": ("num-server-rounds=ten", "num-server-rounds",
                          "'ten' is not an integer (allowed: an integer, e.g. "
                          "num-server-rounds=30)"),
    "word_for_a_flag": ("secure-noise=yes", "secure-noise", "'yes' is not true or false"),
    "key_given_twice": ("clip=1.0 clip=0.5", "clip", "given twice"),
    "fraction_train_under_prisma": ('algorithm="prisma" fraction-train=0.5', "fraction-train",
                                    "not used by algorithm 'prisma'"),
    "beta_under_clip21_sgd": ('algorithm="clip21-sgd" beta=0.5', "beta",
                              "not used by algorithm 'clip21-sgd'"),
    "dirichlet_that_cannot_fill_partitions": (
        'partitioner="dirichlet" alpha=0.01 num-partitions=140', "num-partitions",
        "use fewer partitions"),
    "clip_below_float32": ("clip=1e-320", "clip", "outside float32's range"),
    "clip_above_float32": ("clip=1e39", "clip", "outside float32's range"),
    "rounds_beyond_any_run": ("num-server-rounds=1000000000000", "num-server-rounds",
                              "must be <= 10000000"),
    "local_steps_beyond_any_round": ('algorithm="dp-fedavg" local-steps=1000000000000',
                                     "local-steps", "must be <= 1000000"),
    "dataset_option_wrong_kind": ('dataset-options="num_public=1.5"', "dataset-options",
                                  "option num_public must be int, got float 1.5"),
}


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def _run_config(override: str, tmp_path) -> str:
    """``override`` with ``{tmp}`` filled in, plus a results folder under ``tmp_path`` and one
    round, unless it names them."""
    (tmp_path / "a-file").write_text("")
    extra = {"results-dir": f'"{tmp_path / "results"}"', "num-server-rounds": "1"}
    return " ".join([override.replace("{tmp}", str(tmp_path))]
                    + [f"{k}={v}" for k, v in extra.items() if k not in override])


def _nothing_written(tmp_path) -> bool:
    """Nothing but the file the cases use and (empty) the results folder."""
    results = tmp_path / "results"
    return ({p.name for p in tmp_path.iterdir()} <= {"a-file", "results"}
            and (not results.exists() or not any(results.iterdir())))


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gives_one_clear_line(name, tmp_path, capsys):
    """Every case through the command line's entry point, in this process."""
    from dpfl.cli import main

    override, key, fragment = CASES[name]
    assert main(["run", "--run-config", _run_config(override, tmp_path)]) == 2
    out = capsys.readouterr()
    line = _one_line(out.err)
    assert line.startswith(f"dpfl: error: run config key '{key}'") and fragment in line, line
    assert "Traceback" not in out.err + out.out
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("name", ["clip_infinite", "model_options_negative_width",
                                  "run_name_escaping_results_dir", "garbage_after_a_pair",
                                  "model_not_taking_the_inputs"])
def test_flower_refuses_bad_input_before_starting_anything(name, tmp_path, capsys, monkeypatch):
    """``dpfl flower`` checks the data and the model too before Flower starts."""
    from dpfl import launch
    from dpfl.cli import main

    started = []
    monkeypatch.setattr(launch, "stream", lambda *a, **k: started.append(a) or (1, None))
    override, key, fragment = CASES[name]
    assert main(["flower", "--run-config", _run_config(override, tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"'{key}'" in line and fragment in line
    assert not started and _nothing_written(tmp_path)


@pytest.mark.parametrize("supernodes", [5, 0])
def test_flower_refuses_more_supernodes_than_clients_before_starting_anything(
        supernodes, tmp_path, capsys, monkeypatch):
    """Five SuperNodes for three clients: refused naming --num-supernodes, exit status 2, before
    Flower or Ray start (it used to fail after a minute, naming the wrong flag)."""
    from dpfl import launch
    from dpfl.cli import main

    started = []
    monkeypatch.setattr(launch, "stream", lambda *a, **k: started.append(a) or (1, None))
    assert main(["flower", "--num-supernodes", str(supernodes), "--run-config",
                 _run_config("num-partitions=3", tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"dpfl: error: --num-supernodes {supernodes}: 3 clients")
    assert "allowed: 1 to 3" in line
    assert not started and _nothing_written(tmp_path)


@pytest.mark.parametrize("argv", [["run", "--bogus"], ["run", "-c"], ["nope"], []])
def test_a_bad_command_line_option_gives_one_line(argv, capsys):
    from dpfl.cli import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert _one_line(capsys.readouterr().err).startswith("dpfl: error: dpfl")


def test_dpsgd_gc_reads_fraction_train():
    """Not a key it ignores: DPSGD-GC samples clients as the Clip21 family it extends."""
    from dpfl.runconfig import RunConfig

    assert "fraction-train" in RunConfig({"fraction-train": 0.5}).reads


# One case of each stage that can refuse: parsing a key, the schema, loading data, building
# the federation. A process per case costs seconds of imports, so the others run in-process.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["unknown_key", "key_the_algorithm_does_not_use",
                                  "missing_data_directory", "batch_larger_than_client"])
def test_bad_input_stops_the_process_with_status_2_and_no_traceback(name, tmp_path):
    override, key, fragment = CASES[name]
    proc = subprocess.run(
        [sys.executable, "-m", "dpfl", "run", "--run-config", _run_config(override, tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert f"'{key}'" in line and fragment in line
    assert "Traceback" not in proc.stderr + proc.stdout
    assert _nothing_written(tmp_path)


@pytest.mark.slow
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
