"""The round loop, how it is driven over a transport, and the Flower-free client runtime it
shares with every transport."""

from dpfl.rounds.client import ClientRuntime
from dpfl.rounds.driver import drive
from dpfl.rounds.loop import RoundLoop, Rounds
from dpfl.rounds.statements import Stopped
from dpfl.rounds.transport import (
    Begin,
    ClientRefused,
    ClientsLost,
    ClientStates,
    ExchangeRequest,
    Replies,
    Request,
    RowSum,
    Transport,
    blocks,
    per_client,
    sum_rows,
)

__all__ = ["Begin", "ClientRefused", "ClientRuntime", "ClientStates", "ClientsLost",
           "ExchangeRequest", "Replies", "Request", "RoundLoop", "Rounds", "RowSum", "Stopped",
           "Transport", "blocks", "drive", "per_client", "sum_rows"]
