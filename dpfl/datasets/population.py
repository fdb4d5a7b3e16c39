"""A population whose clients' data are made when a round needs them.

A cross-device task has far more clients than memory holds rows: a million LEAF clients of a
few hundred samples each are tens of gigabytes. A :class:`Population` holds no row. It makes a
client's training rows from the client's own random stream when asked
(:meth:`Population.rows`), keeps the last few clients' rows, and remembers each client's size
once made. Its clients' natural split is :class:`LazyPartitions`, which stands where an
in-memory dataset's partitions (row indices) stand: client k's "rows" are 0 … n_k − 1 of its
own data. A run over a population holds the rows of one round's cohort, not the population's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

#: clients whose rows a population keeps made (about one cohort's worth of a round)
KEPT = 2048

Rows = tuple[torch.Tensor, torch.Tensor]


@dataclass(eq=False)
class Population:
    """``num_clients`` clients; ``make(k)`` gives client k's training rows ``(x, y)`` (the same
    every call: from the client's own stream); ``smallest`` is a public lower bound on every
    client's training rows (what calibration and batch-size checks read, without making every
    client)."""

    num_clients: int
    make: Callable[[int], Rows]
    smallest: int
    _sizes: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._made = functools.lru_cache(maxsize=KEPT)(self.make)

    def rows(self, client: int) -> Rows:
        """Client ``client``'s training rows."""
        if not 0 <= client < self.num_clients:
            raise IndexError(f"client {client} is not one of the {self.num_clients}")
        x, y = self._made(client)
        self._sizes[client] = len(y)
        return x, y

    def size(self, client: int) -> int:
        """Client ``client``'s number of training rows (made once to count them)."""
        if client not in self._sizes:
            self.rows(client)
        return self._sizes[client]


class LazyPartitions(Sequence[np.ndarray]):
    """The natural split of a :class:`Population`: entry k is ``arange(n_k)``, client k's rows
    of its own data, made when asked for."""

    def __init__(self, population: Population) -> None:
        self.population = population

    def __len__(self) -> int:
        return self.population.num_clients

    def __getitem__(self, client: int) -> np.ndarray:  # type: ignore[override]
        if isinstance(client, slice):
            raise TypeError("a lazy population's partitions are read one client at a time")
        return np.arange(self.population.size(int(client)), dtype=np.int64)

    def __iter__(self) -> Iterator[np.ndarray]:
        raise TypeError("iterating a lazy population would make every client's data: read "
                        "the clients a round needs")
