"""Flower strategies: one generic strategy drives every registered algorithm."""

from dpfl.strategies.algorithm import AlgorithmStrategy, FederationError

__all__ = ["AlgorithmStrategy", "FederationError"]
