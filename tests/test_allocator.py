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

# a fresh interpreter (the setting is once per process): the allocator's answer, then a short
# engine run whose final model goes to the file named by argv[1]
PROGRAM = """
import sys, torch
from dpfl.allocator import keep_freed_memory
from dpfl.engine import run
from dpfl.runconfig import RunConfig
print("kept" if keep_freed_memory() else "system")
summary = run(RunConfig({"num-partitions": 40, "num-server-rounds": 2, "batch-size": 8,
                         "results-dir": sys.argv[1], "run-name": "r"}), echo=False)
"""


def _run(tmp_path: Path, name: str, malloc: str | None) -> tuple[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "DPFL_MALLOC"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if malloc is not None:
        env["DPFL_MALLOC"] = malloc
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / name)], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.split()[0], torch.load(tmp_path / name / "r" / "model.pt")


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_kept_by_default_off_with_system_and_the_model_is_the_same(tmp_path):
    kept, model = _run(tmp_path, "kept", None)
    system, reference = _run(tmp_path, "system", "system")
    assert (kept, system) == ("kept", "system")
    assert model.keys() == reference.keys()
    assert all(torch.equal(model[k], reference[k]) for k in model)


def test_elsewhere_than_glibc_it_does_nothing(monkeypatch):
    from dpfl import allocator

    monkeypatch.setattr(allocator, "_done", False)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("", ""))
    assert allocator.keep_freed_memory() is False
