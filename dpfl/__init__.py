"""dpfl: differentially private federated learning with clipping-aware optimizers on Flower."""

__version__ = "0.1.0"
