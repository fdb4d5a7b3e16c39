"""In-process engine for sweeps and reproductions (``dpfl run``)."""

from dpfl.engine.runner import run

__all__ = ["run"]
