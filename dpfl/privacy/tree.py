"""Tree aggregation: the binary-counter mechanism whose noisy prefix sums DP-FTRL releases.

Dwork, Naor, Pitassi, Rothblum, "Differential Privacy under Continual Observation", STOC 2010,
and Chan, Shi, Song, "Private and Continual Release of Statistics", TISSEC 2011; as DP-FTRL
uses it: Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep) Learning
without Sampling or Shuffling", ICML 2021 (arXiv:2103.00039), §3 and Appendix D.

A tree over rounds 1..R holds one Gaussian draw ξ per dyadic interval [a, b] of its rounds
(a node of size 2^k ends at a multiple b of 2^k). The noisy prefix sum after round p is
Σ_{s ≤ p} v_s plus the draws of the nodes that tile [1, p], one per set bit of p. Round p's
released value is the difference of two prefix sums, v_p plus the noise increment

    e_p = ξ_p − Σ_{j < k} ξ_{p − 2^j},    2^k the lowest set bit of p:

the node ending at p enters (ξ_p, of size 2^k) and the k nodes it merges leave. Summed over
rounds 1..p, the increments give exactly the prefix noise (popcount(p) draws): the sums are
released with an error that grows as log p, not p.

The live nodes are kept as ``[depth, d]`` rows (:class:`TreeState`): row j holds the node of
size 2^j where bit j of p is set, zeros elsewhere. A record (a client, for user-level DP) that
contributes to one round's value moves every node above its leaf, at most
``depth = ⌈log2(R + 1)⌉`` of them (dp-accounting's ``SingleEpochTreeAggregationDpEvent``), so
one tree whose records each contribute once is a Gaussian mechanism of sensitivity Δ·√depth for
a per-round sensitivity Δ. A tree restarts each epoch: the previous tree's prefix noise stays
in what was released, and the next starts from no node (the paper's restart, Appendix D).
"""

from __future__ import annotations

import math
import torch


def tree_depth(rounds: int) -> int:
    """The most nodes of a tree over ``rounds`` rounds that hold one round's value:
    ⌈log2(rounds + 1)⌉ (1 for one round, 3 for four)."""
    if rounds < 1:
        raise ValueError(f"a tree needs at least one round, got {rounds}")
    return math.ceil(math.log2(rounds + 1))


def merged(position: int) -> int:
    """k: how many live nodes round ``position`` (1-based in its tree) merges into its own
    node, the lowest set bit of ``position`` being 2^k."""
    if position < 1:
        raise ValueError(f"tree positions start at 1, got {position}")
    return (position & -position).bit_length() - 1


def increment(rows: torch.Tensor, position: int,
              fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``position``'s noise e_p and the live rows after it, from the rows before it
    (``rows [depth, d]``; ignored, as an empty tree, at position 1) and ``fresh``, the new
    node's draw ξ_p ``[d]``. ``rows`` is not modified."""
    k = merged(position)
    if k >= len(rows):
        raise ValueError(f"position {position} needs a tree deeper than {len(rows)} rows")
    rows = torch.zeros_like(rows) if position == 1 else rows.clone()
    noise = fresh - rows[:k].sum(dim=0)
    rows[:k] = 0
    rows[k] = fresh
    return noise, rows
