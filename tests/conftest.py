"""Shared test setup: offline data from ``$DPFL_DATA_DIR``, small fast configurations."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DPFL_DATA_DIR", str((ROOT.parent / "shared" / "data").resolve()))


@pytest.fixture
def small_config(tmp_path):
    """A few rounds of DPSGD-GC on digits with 4 clients (seconds on 2 cores)."""
    from dpfl.runconfig import RunConfig

    def make(**changes):
        values = {"num-partitions": 4, "num-server-rounds": 3, "batch-size": 16,
                  "results-dir": str(tmp_path / "results"), "run-name": "t"}
        values.update({k.replace("_", "-"): v for k, v in changes.items()})
        return RunConfig(values)

    return make
