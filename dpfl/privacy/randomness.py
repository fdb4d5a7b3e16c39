"""Per-(seed, client, round, purpose) random streams.

Every random draw of a run (mini-batch sampling, DP noise, client sampling)
comes from a generator keyed by the run seed, the client id, the round and a
purpose string. Streams are therefore independent across clients, rounds and
purposes, and a client draws the same numbers whether it runs alone in a Flower
ClientApp or batched with others in the engine.

With ``secure=True`` each generator is seeded from the operating system's
CSPRNG instead (as Opacus' ``secure_mode`` does), so draws cannot be predicted
from the run seed; runs are then not reproducible.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

SERVER = -1  # the client id used for the server's own draws (client sampling)


class Randomness:
    """Factory of keyed generators for one run."""

    def __init__(self, seed: int, *, secure: bool = False) -> None:
        self.seed = seed
        self.secure = secure

    def key(self, client: int, round: int, purpose: str) -> int:
        """The 63-bit seed of stream (client, round, purpose)."""
        if self.secure:
            return secrets.randbits(63)
        text = f"dpfl/{self.seed}/{client}/{round}/{purpose}".encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1

    def generator(self, client: int, round: int, purpose: str,
                  device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(self.key(client, round, purpose))
        return gen

    def normal(self, clients: Sequence[int], round: int, purpose: str, shape: Sequence[int],
               std: torch.Tensor, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """Gaussian noise ``[C, *shape]``, row ``i`` from client ``clients[i]``'s stream
        and scaled by ``std[i]``. Draws are made on the CPU so that they do not depend
        on the device."""
        noise = torch.empty((len(clients), *shape), dtype=dtype)
        for row, client in zip(noise, clients):
            torch.randn(tuple(shape), generator=self.generator(client, round, purpose),
                        dtype=dtype, out=row)
        noise *= std.to(dtype=dtype, device="cpu").reshape(-1, *([1] * len(shape)))
        return noise.to(device)

    def sample_without_replacement(self, clients: Sequence[int], sizes: Sequence[int],
                                   round: int, purpose: str, k: int) -> list[torch.Tensor]:
        """For each client, ``k`` distinct positions drawn uniformly from ``range(size)``."""
        out = []
        for client, size in zip(clients, sizes, strict=True):
            gen = self.generator(client, round, purpose)
            out.append(torch.randperm(size, generator=gen)[:k])
        return out

    def bernoulli_rows(self, clients: Sequence[int], sizes: Sequence[int], round: int,
                       purpose: str, expected: int) -> list[torch.Tensor]:
        """For each client, the positions in ``range(size)`` kept by independent coin flips of
        probability ``expected / size`` (Poisson sampling), increasing."""
        out = []
        for client, size in zip(clients, sizes, strict=True):
            coins = torch.rand(size, generator=self.generator(client, round, purpose),
                               dtype=torch.float64)
            out.append(torch.nonzero(coins < expected / size).flatten())
        return out
