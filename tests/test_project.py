"""The project surface: every run-config key is in pyproject.toml and the README."""

from __future__ import annotations

import tomllib

from dpfl.runconfig import all_params
from tests.conftest import ROOT


def test_pyproject_lists_every_key_with_its_default():
    flwr_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"]
    assert flwr_config == {k: p.default for k, p in all_params().items()}


def test_readme_documents_every_key():
    readme = (ROOT / "README.md").read_text()
    missing = [k for k in all_params() if f"`{k}`" not in readme]
    assert not missing, missing


def test_torchvision_imports_and_runs_an_op():
    import torch
    import torchvision

    boxes = torch.tensor([[0.0, 0.0, 2.0, 2.0], [0.5, 0.5, 2.0, 2.0], [5.0, 5.0, 6.0, 6.0]])
    keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
