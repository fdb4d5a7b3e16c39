"""Peak memory of a per-sample clipped step under ``FlatModel(chunk_bytes=...)``.

Each figure is one fresh process of ``benchmarks/bench_memory.py --point`` (its docstring
describes the measurement: the peak resident set during the step less the resident set just
before it, from ``/proc/self/status``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_memory.py"
MIB = 2**20


def _peak(model: str, batch: int, budget: int | None) -> dict[str, float]:
    spec = json.dumps([model, batch, 1, budget, "cpu"])
    done = subprocess.run([sys.executable, str(BENCH), "--point", spec], check=True,
                          capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_chunk_byte_budget_bounds_the_peak_memory_of_a_clipped_step():
    """Clip21 CNN, batch 512: chunks of 256 samples (the default) hold ~40 MiB of counted
    per-sample values; a 4 MiB budget cuts the chunk to ~25 samples, and the step's peak falls
    with it, to a few times the budget (the count leaves out backward's temporaries)."""
    free = _peak("clip21-cnn", 512, None)
    bounded = _peak("clip21-cnn", 512, 4 * MIB)
    assert free["chunk"] == 256 and bounded["counted"] <= 4 * MIB < 2 * bounded["counted"]
    figures = f"without a budget {free}, with {bounded}"
    assert bounded["peak"] < free["peak"] / 3, figures
    assert bounded["peak"] < 5 * 4 * MIB, figures


def test_the_chunk_bytes_key_reaches_the_model_and_changes_only_rounding(small_config, tmp_path):
    """``chunk-bytes`` sets the model's budget (chunks of a few samples here); the run's model
    equals the default chunking's to float32 rounding."""
    import torch

    from dpfl.engine import run
    from dpfl.problem import build_problem

    tight = small_config(chunk_bytes=20_000, run_name="tight")
    problem = build_problem(tight)
    x = problem.dataset.train_x[:16].unsqueeze(0)
    assert problem.model.chunk_length(problem.x0, x, problem.dataset.train_y[:16].unsqueeze(0),
                                      rows=False) < 16
    run(tight, echo=False)
    run(small_config(run_name="default"), echo=False)
    models = [torch.load(tmp_path / "results" / name / "model.pt") for name in ("tight", "default")]
    for key, value in models[1].items():
        torch.testing.assert_close(models[0][key], value, rtol=1e-5, atol=1e-6)
