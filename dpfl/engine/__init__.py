"""In-process engine for sweeps and reproductions (``dpfl run``), and many runs batched as one
(:func:`run_many`)."""

from dpfl.engine.many import run_many
from dpfl.engine.runner import run

__all__ = ["run", "run_many"]
