"""Paper reproductions: ``dpfl reproduce <paper> <experiment> [--smoke]``."""

from dpfl.experiments import clip21  # noqa: F401  (registers)
from dpfl.experiments.lab import Lab
from dpfl.experiments.registry import EXPERIMENTS, Experiment, experiment

__all__ = ["EXPERIMENTS", "Experiment", "Lab", "experiment"]
