"""Paper reproductions: ``dpfl reproduce <paper> <experiment> [--smoke]``.

One module per paper (its grids, federations, tables and figures), over shared machinery:
:mod:`~dpfl.experiments.lab` runs configurations and archives and reports them,
:mod:`~dpfl.experiments.selection` tunes a table's cells, :mod:`~dpfl.experiments.registry`
names the experiments, :mod:`~dpfl.experiments.migrate` carries an archive across a change of
run-config keys.
"""

from dpfl.experiments import (  # noqa: F401  (registers)
    adaptive,
    adaptive_interpolation,
    benchmark,
    clip21,
    pcdp,
    pcdp_tuned,
    prisma,
    prisma_verdict,
    secure,
)
from dpfl.experiments.lab import Lab
from dpfl.experiments.registry import EXPERIMENTS, Experiment, experiment

__all__ = ["EXPERIMENTS", "Experiment", "Lab", "experiment"]
