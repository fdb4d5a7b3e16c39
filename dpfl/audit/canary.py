"""The canary record and the federation of audit trials around it.

The canary is a crafted input: zero everywhere but one feature ``j`` that every record of the
audited client's data leaves at (or nearest to) zero, set large enough that the canary's
gradient is clipped at any radius the run uses. For a linear model its gradient then lies in
the weights of feature ``j`` only, where no other record has any: a "Dirac" canary made of an
input (Nasr et al., "Tight Auditing of Differentially Private Machine Learning",
arXiv:2302.07956, use the same idea with a gradient). Its label is the class the initial model
ranks last on it, so the gradient stays large while the canary is unlearnt.

Record-level trials are clients. Client ``i < N`` holds the audited data D ("out"), client
``N + i`` its neighbour D' ("in"), and one more client, the reference, holds D and drives the
server. Each trial client draws its own batches and noise from its own stream, so the trials
are independent runs of the client's mechanism against the same sequence of broadcasts (an
adversarial server may send any sequence; this one is the reference client's run).
Client-level trials are whole federations, without and with one more client that holds only
the canary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dpfl.datasets.base import Dataset
from dpfl.privacy import Relation
from dpfl.problem import Problem, assemble

SCALE_OVER_CLIP = 1000.0  # the canary's gradient norm at x⁰ over the largest clip radius


@dataclass(frozen=True)
class Canary:
    """The canary record: input ``x``, label ``y``, and the one feature it is non-zero on."""

    x: torch.Tensor
    y: torch.Tensor
    feature: int


def quiet_feature(x: torch.Tensor) -> int:
    """The feature of records ``x [n, ...]`` with the smallest largest magnitude."""
    return int(x.reshape(len(x), -1).abs().amax(dim=0).argmin())


def craft(source: Problem, rows: np.ndarray, radius: float) -> Canary:
    """The canary for client data ``rows`` of ``source``'s training set, with a gradient at
    the initial model of norm :data:`SCALE_OVER_CLIP`·``radius``."""
    ds = source.dataset
    x, y = ds.train_x[torch.from_numpy(rows)], ds.train_y[torch.from_numpy(rows)]
    feature = quiet_feature(x)
    canary = torch.zeros(x[0].numel(), dtype=x.dtype)
    canary[feature] = 1.0
    canary = canary.reshape(x[0].shape)
    model, x0 = source.model, source.x0.to(source.device)
    if ds.task == "classification":
        with torch.no_grad():
            logits = model.load_into(x0)(canary.unsqueeze(0).to(x0))[0]
        label = torch.tensor(int(logits.argmin()), dtype=y.dtype)
    else:
        label = y[0].clone()
    grad = model.per_sample_gradients(x0.unsqueeze(0), canary.reshape(1, 1, *canary.shape)
                                      .to(x0), label.reshape(1, 1).to(source.device))[0, 0]
    norm = float(torch.linalg.vector_norm(grad.double()))
    return Canary(canary * (SCALE_OVER_CLIP * radius / (norm if norm > 0 else 1.0)), label,
                  feature)


def _with_records(source: Problem, x: torch.Tensor, y: torch.Tensor,
                  parts: list[np.ndarray]) -> Problem:
    """``source``'s run over training records ``x``/``y`` split as ``parts``."""
    ds = source.dataset
    dataset = Dataset(f"{ds.name}-audit", x, y, ds.test_x, ds.test_y, task=ds.task,
                      num_classes=ds.num_classes, public_x=ds.public_x, public_y=ds.public_y)
    return assemble(source.config.replace(**{"num-partitions": len(parts)}), dataset, parts)


def record_trials(source: Problem, client: int, trials: int, radius: float
                  ) -> tuple[Problem, Canary]:
    """The record-level audit federation for ``client``'s data D: ``trials`` clients holding
    D, ``trials`` holding its neighbour with the canary (D plus it under add/remove, D with
    its first record replaced by it under replace-one), then the reference client (D)."""
    rows = source.partitions[client]
    canary = craft(source, rows, radius)
    ds, n = source.dataset, len(rows)
    x = torch.cat([ds.train_x[torch.from_numpy(rows)], canary.x.unsqueeze(0)])
    y = torch.cat([ds.train_y[torch.from_numpy(rows)], canary.y.reshape(1)])
    data = np.arange(n, dtype=np.int64)
    if source.algorithm.relation is Relation.REPLACE_ONE:
        neighbour = np.concatenate([[n], np.arange(1, n)]).astype(np.int64)
    else:
        neighbour = np.arange(n + 1, dtype=np.int64)
    return _with_records(source, x, y, [data] * trials + [neighbour] * trials + [data]), canary


def client_trials(source: Problem, canary: Canary) -> Problem:
    """The client-level neighbour of ``source``'s federation: one more client, the last,
    holding only copies of the canary record (as many as the smallest client's records, so
    that it can sample the batches every client does)."""
    ds = source.dataset
    copies = min(len(p) for p in source.partitions)
    x = torch.cat([ds.train_x, canary.x.expand(copies, *canary.x.shape)])
    y = torch.cat([ds.train_y, canary.y.reshape(1).expand(copies)])
    own = np.arange(ds.num_train, ds.num_train + copies, dtype=np.int64)
    return _with_records(source, x, y, [*source.partitions, own])
