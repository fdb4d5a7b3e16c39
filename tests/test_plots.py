"""``summary.png`` (dpfl/plots.py) for every kind of run: with test accuracy (three panels) and
without (two), losses spanning more than a factor 20 (log axis) or not, values that are
missing or not finite, a run stopped before its first round; no warning. Elsewhere the tests'
own runs write an empty one (tests/conftest.py)."""

from __future__ import annotations

import math
import struct

import pytest

from dpfl.plots import plot_summary

# the real drawing, and no warning from it (an empty legend warned)
pytestmark = [pytest.mark.summary_plot, pytest.mark.filterwarnings("error")]


def _size(path) -> tuple[int, int]:
    """A PNG's width and height, from its IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _rounds(n: int, **overrides) -> list[dict]:
    return [{"round": r, "test_accuracy": 0.1 + 0.02 * r, "train_loss": 2.0 / r,
             "test_loss": 2.1 / r, "epsilon_max": 0.1 * r, "epsilon_min": 0.05 * r,
             **{k: v(r) for k, v in overrides.items()}} for r in range(1, n + 1)]


@pytest.mark.parametrize("rounds, chance, panels", [
    (_rounds(30), 0.1, 3),                                         # classification
    (_rounds(30, test_accuracy=lambda r: None), None, 2),          # regression: no accuracy
    (_rounds(30, test_loss=lambda r: 100.0 / r ** 2), 0.5, 3),     # losses on a log axis
    (_rounds(5, test_loss=lambda r: math.nan if r == 3 else 1.0,   # a diverged round
             train_loss=lambda r: math.inf if r == 4 else None), 0.1, 3),
    ([], None, 2),                                                 # stopped before round 1
])
def test_summary_png_draws_every_kind_of_run(tmp_path, rounds, chance, panels):
    plot_summary(rounds, tmp_path, title="dpsgd-gc on digits, ε = 8.00", chance=chance)
    # figsize (4.2 × panels, 3.8) inches at 100 dpi
    assert _size(tmp_path / "summary.png") == (420 * panels, 380)
