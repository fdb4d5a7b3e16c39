"""Drawing a release's Gaussian noise: per client (exact) or once for a sum (pooled)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpfl.privacy.randomness import Randomness


def add_noise(values: torch.Tensor, clients: Sequence[int], std: torch.Tensor, *,
              rng: Randomness, server_round: int, stream: str,
              pooled: bool = False) -> torch.Tensor:
    """``values [C, ...]`` plus Gaussian noise of std ``std[i]`` on row i (a new tensor).

    Exact (the default): row i gets client ``clients[i]``'s own draw, from stream ``(seed,
    client, round, stream)``, so a client's value is private on its own and a client draws the
    same numbers alone (a Flower ClientApp) or batched (the engine). Pooled, for a value that
    reaches the model only through the sum over clients: one draw ``sqrt(Σ_i std[i]²)·z``,
    z ~ N(0, I) from the first client's stream ``<stream>-pooled``, goes into row 0: the sum of
    the rows then has exactly the law of the sum of independent per-client draws, at the cost of
    one draw instead of C; the rows no longer are private on their own.
    """
    if not bool((std > 0).any()):
        return values
    if pooled:
        total = std.double().square().sum().sqrt().reshape(1)
        draw = rng.normal(list(clients[:1]), server_round, f"{stream}-pooled", values.shape[1:],
                          total, dtype=values.dtype)
        out = values.clone()
        out[0].add_(draw[0].to(values.device))
        return out
    noise = rng.normal(list(clients), server_round, stream, values.shape[1:], std,
                       dtype=values.dtype, device=values.device)
    return noise.add_(values)  # values + noise, in the noise's fresh memory
