"""examples/shakespeare, a user's own data and model by reference: the roles it builds, the
model's per-sample gradients, and its README's commands, run as written on a small slice of
the data (the slice's options replace the full run's size)."""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from tests.readme_commands import Command, dpfl_commands, on_a_slice

EXAMPLE = ROOT / "examples" / "shakespeare"
README = EXAMPLE / "README.md"
TEXT = Path(os.environ["DPFL_DATA_DIR"]) / "shakespeare" / "input.txt"  # set by conftest
#: the small slice the smoke runs take: 4 roles, 64 windows of 20 characters each
SLICE = "seq_len=20 max_clients=4 max_samples_per_client=64 max_test_samples_per_client=128"
SLICE_CLIENTS = 4
#: the private algorithms the README runs
PRIVATE = {"dp-fedavg", "dpsgd-gc", "prisma", "clip21-sgd2m-plus"}

pytestmark = pytest.mark.skipif(not TEXT.is_file(), reason=f"no {TEXT}")


@pytest.fixture
def example(monkeypatch):
    """The example's folder on the Python path, as ``PYTHONPATH="$PWD"`` puts it."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield
    for name in ("data", "model", "sweep"):
        sys.modules.pop(name, None)


def _commands(program: str) -> list[Command]:
    return dpfl_commands(README, program)


def _on_the_slice(argv: list[str], results: Path, name: str) -> list[str]:
    """``argv`` with the slice's size in place of the full run's, and a results folder."""
    return on_a_slice(argv, {r"\bnum-partitions=\d+": f"num-partitions={SLICE_CLIENTS}",
                             r"\bnum-server-rounds=\d+": "num-server-rounds=2"},
                      SLICE, results, name)


# ---- the data ------------------------------------------------------------------------------

def test_every_speech_opens_with_its_speakers_name_and_there_are_309_roles(example):
    from data import speeches

    roles = speeches(TEXT.read_text())
    assert len(roles) == 309 and sum(1 for said in roles.values() if said) == 299


def test_each_role_is_one_client_whose_windows_come_from_its_own_speech(example):
    """A kept role's training windows, in order, are windows of its training speech followed
    by the next character, and its test windows lie in its held-out speech."""
    from data import roles, speeches

    kept, vocabulary = roles(data_dir=TEXT.parents[1], seq_len=20, max_clients=3,
                             max_samples_per_client=50, max_test_samples_per_client=10)
    text = {name: "\n".join(said) for name, said in speeches(TEXT.read_text()).items()}
    assert len(vocabulary) == 65 and [r.name for r in kept] == sorted(
        text, key=lambda name: -len(text[name]))[:3]
    for role in kept:
        cut = int(len(text[role.name]) * 0.8)
        for x, y, part in ((role.train_x, role.train_y, text[role.name][:cut]),
                           (role.test_x, role.test_y, text[role.name][cut:])):
            assert x.dtype == np.int64 and x.shape[1] == 20
            for window, label in zip(x, y, strict=True):
                assert "".join(vocabulary[i] for i in [*window, label]) in part


def test_the_natural_split_gives_each_role_its_own_rows(example):
    from dpfl.problem import build_problem
    from dpfl.runconfig import RunConfig

    problem = build_problem(RunConfig({
        "dataset": "data:shakespeare", "dataset-options": SLICE, "partitioner": "natural",
        "num-partitions": SLICE_CLIENTS, "model": "model:char_attention"}))
    assert [len(rows) for rows in problem.partitions] == [64] * SLICE_CLIENTS
    assert problem.dataset.train_x.dtype == torch.int64
    assert problem.dataset.num_classes == 65


def test_validation_keeps_the_same_roles_and_never_reads_the_held_out_speech(example):
    from data import roles

    test, _ = roles(data_dir=TEXT.parents[1], max_samples_per_client=0,
                    max_test_samples_per_client=0)
    validation, _ = roles(data_dir=TEXT.parents[1], validation=True,
                          max_samples_per_client=0, max_test_samples_per_client=0)
    assert [r.name for r in test] == [r.name for r in validation]
    for held, tuned in zip(test, validation, strict=True):
        assert len(tuned.train_y) + len(tuned.test_y) < len(held.train_y)


def test_the_readmes_num_partitions_is_the_number_of_roles_the_default_options_keep(example):
    from data import roles

    kept, _ = roles(data_dir=TEXT.parents[1])
    counts = {config["num-partitions"] for _, _, config in _commands("run") + _commands("flower")}
    assert counts == {len(kept)} and f"**{len(kept)} roles**" in README.read_text()


# ---- the model -----------------------------------------------------------------------------

@pytest.mark.parametrize("builder", ["char_attention", "char_rnn"])
def test_the_models_per_sample_gradients_equal_a_per_sample_loop(example, builder):
    """dpfl's per-sample gradients of the example's model (causal attention with LayerNorm,
    or an LSTM), in float64, against one autograd pass per window."""
    from dpfl.models import FlatModel, build_model

    module = build_model(f"model:{builder}", input_shape=(12,), num_classes=65, seed=0,
                         input_dtype=torch.int64)
    flat_model = FlatModel(module.double(), "cross-entropy")
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, 65, (1, 5, 12), generator=generator)
    y = torch.randint(0, 65, (1, 5), generator=generator)
    flat = flat_model.initial_params().double()
    ours = flat_model.per_sample_gradients(flat, x, y)[0]
    loaded = flat_model.load_into(flat).double()
    params = [p for p in loaded.parameters() if p.requires_grad]
    for j in range(5):
        loss = torch.nn.functional.cross_entropy(loaded(x[0, j:j + 1]), y[0, j:j + 1])
        loop = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
        assert torch.allclose(ours[j], loop, rtol=1e-9, atol=1e-12)


# ---- the README's commands -----------------------------------------------------------------

def test_the_readme_runs_each_algorithm_at_epsilon_8_and_one_non_private_reference():
    configs = [config for _, _, config in _commands("run")]
    private = [c for c in configs if c.get("noise-multiplier") != 0]
    assert {c["algorithm"] for c in private} == PRIVATE and len(private) == len(PRIVATE)
    assert all(c["epsilon"] == 8.0 and c["delta"] == 1e-5 for c in private)
    [reference] = [c for c in configs if c.get("noise-multiplier") == 0]
    assert reference["algorithm"] == "dp-fedavg" and "epsilon" not in reference
    dp_fedavg = next(c for c in private if c["algorithm"] == "dp-fedavg")
    assert {k: v for k, v in reference.items() if k != "noise-multiplier"} == {
        k: v for k, v in dp_fedavg.items() if k not in ("epsilon", "delta")}
    for env, _, config in _commands("run") + _commands("flower"):
        assert env == {"PYTHONPATH": "$PWD"} and "dataset-options" not in config
        assert config["dataset"] == "data:shakespeare" and config["partitioner"] == "natural"
    [(_, _, flower)] = _commands("flower")
    assert flower in configs


def test_the_readmes_run_commands_train_on_a_slice(example, tmp_path, capsys):
    """Every ``dpfl run`` command of the README, 2 rounds on 4 roles: each completes with a
    finite test loss, and each private one spends ε = 8."""
    import json

    from dpfl.cli import main

    for i, (_, argv, config) in enumerate(_commands("run")):
        assert main(_on_the_slice(argv, tmp_path, f"run{i}")) == 0, capsys.readouterr().err
        summary = json.loads((tmp_path / f"run{i}" / "summary.json").read_text())
        assert math.isfinite(summary["test_loss"]), (config["algorithm"], summary["test_loss"])
        if config.get("noise-multiplier") != 0:
            assert summary["epsilon_max"] == pytest.approx(8.0, abs=0.01)


def test_the_non_private_reference_learns_above_chance_in_six_rounds(example, tmp_path):
    """On the slice (4 roles, 512 test windows), DP-FedAvg without noise and 4 local steps:
    well above the uniform guess (1/65), and a test loss below ln 65."""
    from dpfl.engine import run
    from dpfl.runconfig import RunConfig

    [(_, _, config)] = [c for c in _commands("run") if c[2].get("noise-multiplier") == 0]
    summary = run(RunConfig({**config, "dataset-options": SLICE, "local-steps": 4,
                             "num-partitions": SLICE_CLIENTS, "num-server-rounds": 6,
                             "results-dir": str(tmp_path)}), echo=False)
    assert summary["test_accuracy"] > 5 / 65 and summary["test_loss"] < math.log(65)


@pytest.mark.flower
@pytest.mark.slow
def test_the_readmes_flower_command_trains_on_a_slice(tmp_path, monkeypatch):
    """``PYTHONPATH="$PWD" dpfl flower ...``: the ServerApp and the Ray workers import the
    example's modules from the inherited (absolute) PYTHONPATH."""
    from dpfl.cli import main

    monkeypatch.chdir(EXAMPLE)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    [(_, argv, _)] = _commands("flower")
    argv = [re.sub(r"^8$", "2", word) for word in argv]  # 2 virtual SuperNodes for 4 clients
    assert main(_on_the_slice(argv, tmp_path / "results", "flower")) == 0
    assert (tmp_path / "results" / "flower" / "model.pt").is_file()


@pytest.mark.parametrize("page", [ROOT / "examples" / "README.md", README],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_examples_links_find_their_files_and_headings(page):
    from tests.test_project import anchors, local_links

    for file, anchor in local_links(page):
        target = page.parent / file if file else page
        assert target.exists(), file
        assert not anchor or anchor in set(anchors(target)), f"{file}#{anchor}"


@pytest.mark.slow
def test_the_sweep_runs_the_protocol_and_regenerates_its_report_from_its_archive(example,
                                                                                  tmp_path):
    """``sweep.py --smoke``: 9 tuning points a method on the validation split, the chosen one
    on three seeds, the table with the unigram baseline; run again from the archive alone, it
    runs nothing and writes the same table."""
    import sweep

    assert sweep.main(["--smoke", "--results-dir", str(tmp_path / "first")]) == 0
    first = (tmp_path / "first" / "smoke" / "report.md").read_text()
    table = first[first.index("### Next-character"):first.index("![")]
    assert all(f"| {name} |" in table for name in sweep.METHODS)
    assert "| unigram (most frequent character) |" in table
    archive = tmp_path / "first" / "smoke" / "runs.jsonl.gz"
    assert sweep.main(["--smoke", "--results-dir", str(tmp_path / "again"),
                       "--reuse", str(archive)]) == 0
    again = (tmp_path / "again" / "smoke" / "report.md").read_text()
    assert again[again.index("### Next-character"):again.index("![")] == table
    assert not (tmp_path / "again" / "smoke" / "runs").exists()  # nothing ran
