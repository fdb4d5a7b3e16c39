"""A model by reference (``model="package.module:callable"``): built from the run's seed as a zoo
model, the same through the engine and Flower's code path, every bad reference one line; and
docs/your-own-model.md's commands, run as the page writes them."""

from __future__ import annotations

import json
import re
import shlex
import zipfile

import pytest
import torch

from dpfl.engine import run
from dpfl.models import build_model
from dpfl.runconfig import RunConfig
from tests.conftest import ROOT, bash_blocks

USER = "tests.fixtures.user_code"
PAGE = ROOT / "docs" / "your-own-model.md"


def _weights(seed: int, **options: object) -> dict[str, torch.Tensor]:
    return build_model(f"{USER}:small_mlp", input_shape=(64,), num_classes=10, seed=seed,
                       **options).state_dict()


def test_a_referenced_model_draws_the_same_weights_from_the_same_seed():
    first, second, other = _weights(3, hidden=8), _weights(3, hidden=8), _weights(4, hidden=8)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["1.weight"], other["1.weight"])


def test_a_referenced_model_draws_its_weights_as_a_zoo_model_does():
    """The same seeding as the zoo's ``mlp``: the same first layer for the same widths."""
    mine = _weights(5, hidden=256)
    zoo = build_model("mlp", input_shape=(64,), num_classes=10, seed=5).state_dict()
    assert all(torch.equal(mine[k], zoo[k]) for k in zoo)


def test_the_callable_receives_only_the_arguments_its_signature_names():
    model = build_model(f"{USER}:fixed_head", input_shape=(64,), num_classes=3, seed=0)
    assert model(torch.zeros(2, 64)).shape == (2, 3)


def _values(tmp_path, **changes: object) -> dict[str, object]:
    return {"model": f"{USER}:small_mlp", "model-options": "hidden=8", "num-partitions": 3,
            "num-server-rounds": 2, "batch-size": 16, "seed": 2, "results-dir": str(tmp_path),
            **changes}


def test_the_flower_code_path_equals_the_engine_bit_for_bit_with_a_referenced_model(tmp_path):
    from tests.inprocess_grid import run_flower_code_path

    values = _values(tmp_path, dataset=f"{USER}:blobs")
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": i} for i in range(3)])
    engine, flower = (torch.load(tmp_path / name / "model.pt") for name in ("engine", "flower"))
    assert engine.keys() == flower.keys() and all(torch.equal(engine[k], flower[k])
                                                  for k in engine)
    rounds = [[{k: v for k, v in json.loads(line).items() if k != "seconds"}
               for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
              for name in ("engine", "flower")]
    assert rounds[0] == rounds[1]


BAD = {
    "module_not_found": ('model="nosuch.mod:f"', "model",
                         "'nosuch.mod:f': module 'nosuch' is not on the Python path"),
    "attribute_missing": (f'model="{USER}:nope"', "model", "user_code has no attribute 'nope'"),
    "not_callable": (f'model="{USER}:NOT_CALLABLE"', "model",
                     "is not callable (it is of type int)"),
    "returns_no_module": (f'model="{USER}:not_a_model"', "model",
                          "TypeError: returned a str, not a torch.nn.Module"),
    "batch_norm": (f'model="{USER}:batch_norm"', "model", "BatchNorm"),
    "malformed": ('model="a:b:c"', "model", "'a:b:c' is not a reference"),
    "unknown_option": (f'model="{USER}:small_mlp" model-options="width=3"', "model-options",
                       "model 'tests.fixtures.user_code:small_mlp' has no option 'width' "
                       "(allowed: hidden)"),
    "option_of_another_kind": (f'model="{USER}:small_mlp" model-options="hidden=1.5"',
                               "model-options", "option hidden must be int, got float 1.5"),
    "not_taking_the_inputs": (f'model="{USER}:one_hot"', "model",
                              "failed on inputs of shape (64,) (torch.float32)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_model_reference_gives_one_line_naming_the_key(name, tmp_path, capsys):
    from dpfl.cli import main

    override, key, fragment = BAD[name]
    results = tmp_path / "results"
    code = main(["run", "--run-config", f'{override} num-server-rounds=1 batch-size=8 '
                 f'results-dir="{results}"'])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"dpfl: error: run config key '{key}': ") and fragment in lines[0]
    assert not results.exists()


# ---- docs/your-own-model.md ----------------------------------------------------------------

def _page_files(folder) -> None:
    """Write the page's Python blocks, each to the file its first line names (``# name.py``),
    and the CSV its Hugging Face example reads (numeric columns and ``label``)."""
    for block in re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M):
        name = block.splitlines()[0].removeprefix("# ")
        (folder / name).write_text(block)
    rows = ["a,b,label"] + [f"{i % 7 * 0.5},{i % 5},{i % 3}" for i in range(1500)]
    (folder / "table.csv").write_text("\n".join(rows) + "\n")


def _page_commands(program: str) -> list[tuple[dict[str, str], list[str]]]:
    """The page's ``... dpfl PROGRAM`` lines: their environment assignments and arguments."""
    found = []
    for block in bash_blocks(PAGE):
        for line in block.splitlines():
            words = shlex.split(line)
            env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
            rest = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
            if rest[:2] == ["dpfl", program]:
                found.append((env, rest[1:]))
    return found


def test_the_pages_run_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """Every ``dpfl run`` line of the page, from a folder holding its files, with ``$PWD`` that
    folder (a results folder added)."""
    from dpfl.cli import main

    _page_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # what PYTHONPATH="$PWD" does
    commands = _page_commands("run")
    assert len(commands) == 4
    for env, argv in commands:
        assert set(env) <= {"PYTHONPATH", "DPFL_DATA_DIR"} and set(env.values()) == {"$PWD"}
        if "DPFL_DATA_DIR" in env:
            monkeypatch.setenv("DPFL_DATA_DIR", str(tmp_path))
        assert main([*argv, "-c", f'results-dir="{tmp_path / "results"}"']) == 0, \
            capsys.readouterr().err


@pytest.mark.flower
def test_the_pages_flower_command_finds_the_module_in_every_process(tmp_path, monkeypatch):
    """``PYTHONPATH="$PWD" dpfl flower ...``: the ServerApp and the Ray workers import the
    user's module from the inherited PYTHONPATH."""
    from dpfl.cli import main

    _page_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    [(env, argv)] = _page_commands("flower")
    assert env == {"PYTHONPATH": "$PWD"}
    assert main([*argv, "-c", f'results-dir="{tmp_path / "results"}" run-name="flower"']) == 0
    assert (tmp_path / "results" / "flower" / "model.pt").is_file()


def test_a_fab_of_the_exported_app_carries_the_users_module(tmp_path):
    """The page's way to ship a module to SuperNodes: ``dpfl export-app app``, the module in the
    app folder and in ``fab-include``; ``flwr build`` packs it."""
    import os
    import subprocess

    from dpfl.federation import BIN
    from dpfl.flower_app import write_app

    app = write_app(tmp_path / "app")
    (app / "mymodel.py").write_text("")
    (app / "mydata.py").write_text("")
    toml = re.search(r"^```toml\n(fab-include = .*)\n```", PAGE.read_text(), re.M).group(1)
    project = app / "pyproject.toml"
    project.write_text(re.sub(r"^fab-include = .*$", toml, project.read_text(), flags=re.M))
    subprocess.run([str(BIN / "flwr"), "build"], cwd=app, check=True, capture_output=True,
                   env={**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}, timeout=120)
    [fab] = app.glob("*.fab")
    names = zipfile.ZipFile(fab).namelist()
    assert {"mymodel.py", "mydata.py", "dpfl/reference.py"} <= set(names)
