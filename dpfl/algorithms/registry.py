"""The ``algorithm=`` registry."""

from dpfl.registry import Registry

ALGORITHMS: Registry = Registry("algorithm")
