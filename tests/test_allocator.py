"""Large freed blocks kept for reuse (dpfl/allocator.py): on by the engine, off by
``DPFL_MALLOC=system``, and no number of a run depends on it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# a short engine run (the defaults' dataset and algorithm)
RUN = {"num-partitions": 40, "num-server-rounds": 2, "batch-size": 8}
# a fresh interpreter (the setting is once per process): the allocator's answer, then RUN
# with its final model in the folder named by argv[1]
PROGRAM = f"""
import sys, torch
from dpfl.allocator import keep_freed_memory
from dpfl.engine import run
from dpfl.runconfig import RunConfig
print("kept" if keep_freed_memory() else "system")
summary = run(RunConfig({{**{RUN!r}, "results-dir": sys.argv[1], "run-name": "r"}}), echo=False)
"""


def _run_with_system_malloc(folder: Path) -> tuple[str, dict]:
    env = {**os.environ, "DPFL_MALLOC": "system",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(folder)], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.split()[0], torch.load(folder / "r" / "model.pt")


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_kept_by_default_off_with_system_and_the_model_is_the_same(tmp_path, monkeypatch):
    """The default in this process (a test worker), ``DPFL_MALLOC=system`` in a fresh one (a
    process of its own costs seconds of imports)."""
    from dpfl.allocator import keep_freed_memory
    from dpfl.engine import run
    from dpfl.runconfig import RunConfig

    monkeypatch.delenv("DPFL_MALLOC", raising=False)
    assert keep_freed_memory()
    run(RunConfig({**RUN, "results-dir": str(tmp_path / "kept"), "run-name": "r"}), echo=False)
    model = torch.load(tmp_path / "kept" / "r" / "model.pt")
    system, reference = _run_with_system_malloc(tmp_path / "system")
    assert system == "system"
    assert model.keys() == reference.keys()
    assert all(torch.equal(model[k], reference[k]) for k in model)


def test_elsewhere_than_glibc_it_does_nothing(monkeypatch):
    from dpfl import allocator

    monkeypatch.setattr(allocator, "_done", False)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("", ""))
    assert allocator.keep_freed_memory() is False
