"""The one round driver and the Flower-free client runtime it shares with every transport."""

from dpfl.rounds.client import ClientRuntime
from dpfl.rounds.driver import RoundDriver
from dpfl.rounds.transport import (
    ClientRefused,
    ClientsLost,
    Replies,
    RowSum,
    Transport,
    blocks,
    per_client,
    sum_rows,
)

__all__ = ["ClientRefused", "ClientRuntime", "ClientsLost", "Replies", "RoundDriver", "RowSum",
           "Transport", "blocks", "per_client", "sum_rows"]
