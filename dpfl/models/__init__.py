"""Models of the four papers, their losses, and the flat-parameter per-sample gradient engine."""

from dpfl.models.functional import FlatModel
from dpfl.models.losses import LOSSES, Loss
from dpfl.models.zoo import MODELS, build_model

__all__ = ["FlatModel", "LOSSES", "Loss", "MODELS", "build_model"]
