"""The math of every algorithm, batched over clients (see ``base``)."""

from dpfl.algorithms import (
    clip21,  # noqa: F401  (registers)
    dpsgd_gc,  # noqa: F401  (registers)
)
from dpfl.algorithms.base import Algorithm, Cohort, Release, State, StepContext
from dpfl.algorithms.registry import ALGORITHMS

__all__ = ["ALGORITHMS", "Algorithm", "Cohort", "Release", "State", "StepContext"]
