"""Paper reproductions: ``dpfl reproduce <paper> <experiment> [--smoke]``.

A client of the library, outside it (as pfl-research and Opacus keep their benchmarks): it
builds runs from run configurations and reads their results, and the ``dpfl`` package never
imports it (but for the ``reproduce`` command, which it names). One module per paper (its grids, federations, tables and figures), over shared machinery:
:mod:`~dpfl_reproductions.lab` runs configurations and archives and reports them,
:mod:`~dpfl_reproductions.selection` tunes a table's cells, :mod:`~dpfl_reproductions.registry`
names the experiments, :mod:`~dpfl_reproductions.migrate` carries an archive across a change of
run-config keys.
"""

from dpfl_reproductions import (  # noqa: F401  (registers)
    adaptive,
    adaptive_interpolation,
    benchmark,
    clip21,
    clip21_amplified,
    clip21_validated,
    cross_device,
    pcdp,
    pcdp_clipping,
    pcdp_tuned,
    prisma,
    prisma_verdict,
    secure,
)
from dpfl_reproductions.lab import Lab
from dpfl_reproductions.registry import EXPERIMENTS, Experiment, experiment

__all__ = ["EXPERIMENTS", "Experiment", "Lab", "experiment"]
