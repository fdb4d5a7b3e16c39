"""The math of every algorithm, batched over clients (see ``base``), one family per module."""

from dpfl.algorithms import (
    adaptive,  # noqa: F401  (registers)
    clip21,  # noqa: F401  (registers)
    fedlrs,  # noqa: F401  (registers)
    ftrl,  # noqa: F401  (registers)
    moon,  # noqa: F401  (registers)
    pfa,  # noqa: F401  (registers)
    prisma,  # noqa: F401  (registers)
    projected,  # noqa: F401  (registers)
    quantile,  # noqa: F401  (registers)
    scaffold,  # noqa: F401  (registers)
    user_level,  # noqa: F401  (registers)
)
from dpfl.algorithms.base import (
    Algorithm,
    ClientContext,
    Cohort,
    Exchange,
    ServerContext,
    State,
    Upload,
    check_schema,
    distinct_streams,
)
from dpfl.algorithms.registry import ALGORITHMS

__all__ = ["ALGORITHMS", "Algorithm", "ClientContext", "Cohort", "Exchange", "ServerContext",
           "State", "Upload", "check_schema", "distinct_streams"]
