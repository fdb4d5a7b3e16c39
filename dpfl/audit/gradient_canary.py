"""The gradient canary: a record whose gradient is a Dirac in a coordinate no other record has.

Nasr et al., "Tight Auditing of Differentially Private Machine Learning" (arXiv:2302.07956,
§4.1) audit DP-SGD tightly with a canary inserted as a gradient, not as an input: a vector of
norm at least the clip radius on one coordinate, which every step clips to exactly C and no
other record's gradient touches. dpfl gets one without touching any algorithm: the audited
model gains one trainable scalar θ (:class:`CanaryModule`, the last coordinate of the flat
vector), every record one more input column z that feeds it, and the loss adds z·θ to the
sample's loss (:func:`canary_loss`), so a record's gradient on θ is its z. Data records have
z = 0: nothing of theirs moves θ, and θ moves nothing of theirs. The canary is the all-zero
record with z = +s, s far above every clip radius: its gradient is s·e_θ plus the module's
gradient at an all-zero input (bounded, so about C/s of its clipped norm, and the same in both
worlds below); every per-sample clip takes it to C·e_θ.

Neighbours, each world a copy of the audited client's data D with one record changed:

* add/remove: D without the canary ("out") against D with it ("in"): the uploads' sums differ
  by C·e_θ a step, the sensitivity;
* replace-one: D with its first record replaced by the anti-canary (z = −s, clipped to −C·e_θ)
  against D with it replaced by the canary: 2C·e_θ a step, the sensitivity, which no input
  canary reaches (a record's gradient cannot be made the negative of another's at will).

Displacement. Under add/remove neighbours a release's sensitivity C holds only for Poisson
batches (Abadi et al., "Deep Learning with Differential Privacy", arXiv:1607.00133, §3.1; the
sampling Mironov, Talwar & Zhang, "Rényi Differential Privacy of the Sampled Gaussian
Mechanism", arXiv:1908.10530, analyse): in a fixed-size batch drawn from D plus the canary, the
canary takes the place of one of D's records, and the sum moves by the canary's clipped
gradient minus that record's, up to 2C. With D's records at z = 0 the displaced record moves
nothing on θ and the score shifts by C, as under Poisson sampling: the θ-canary alone cannot
tell the two samplings apart. So, under add/remove, where every release takes every record
(sample rate 1: the audit's tight setting, a batch of the client's whole data), each of D's
records is an *anti-record*, z = −s, its gradient clipped to −C·e_θ (:func:`data_z`). Poisson
batches at rate 1 hold every record in both worlds: the anti-records add the same −n·C a step
to both, and the canary shifts the score by C, exactly as before; a fixed-size batch of n of
the n + 1 records of "in" holds the canary with probability n/(n + 1), and then in place of an
anti-record: the shift is 2C, the broken mechanism's worst case. Three limits:

* at a sample rate q < 1 the records keep z = 0: Poisson coins over n anti-records would add
  n·q(1 − q)·C² of variance a step, more than the noise, and hide the canary in every audit of
  a correct sampler; a fixed-size draw is a property of the code, not of b, and the full-batch
  audit finds it wherever it is;
* where a client maps its clipped sum by a random map of its own before the noise (RPDP-SGD's
  random subspace, RSDP-SGD's random mask: :data:`RANDOM_MAPS`), the anti-records' n·C comes
  through at a random share, far above the noise, so the records keep z = 0 there as well, and
  so they do where a client uploads the entries its update selects (FedLRS's sparsification:
  :data:`SELECTED_ENTRIES`), which the anti-records would change;
* both worlds calibrate from the out world's record count n (``min-client-records``, unless
  the run sets one; :func:`pinned_records`): a rate b/(n + 1) in the in world alone would move
  the anti-records' sum by itself, the coupling of neighbours that the sampler keeps
  (docs/privacy.md, "Sampling and the neighbouring relation").

The adversary scores a run by the upload's θ-coordinate (:func:`direction`): the sum over
rounds of N(0, (σC)²) noise, shifted by the canary's clipped gradients, which is exactly μ-GDP
for the Gaussian mechanisms: what :mod:`dpfl.audit.gdp` fits.

The public records (the projection family's) carry z = s as well, so e_θ is a direction of
every public gradient and the top of their span: a projection onto the public eigenspace keeps
the canary, which is then a record inside the span the algorithm keeps, the worst case its
projection allows (with z = 0 there the canary would be invisible, and an estimate of 0 would
say only that a record unlike the public ones spends nothing). The algorithms that use no
public records ignore them.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import Tensor, nn

from dpfl.datasets.base import Dataset
from dpfl.models import FlatModel
from dpfl.models.flat import LinearBlock, linear_of
from dpfl.models.losses import Loss
from dpfl.privacy import Relation
from dpfl.problem import Problem, assemble

#: the canary's gradient on θ over the largest clip radius times the largest batch (a client's
#: mean gradient, which Clip21 clips as a whole, holds it divided by the batch)
SCALE_OVER_CLIP = 1000.0


class CanaryModule(nn.Module):
    """``module`` with ``slots`` more trainable scalars θ (zero at first; one a canary, the
    last of the flat vector): inputs are ``[n, F + slots]``, a record's features flattened and
    its z; the output is ``module``'s (flattened) and z·θ as one more column, which
    :func:`canary_loss` adds to the sample's loss."""

    def __init__(self, module: nn.Module, input_shape: tuple[int, ...], slots: int = 1) -> None:
        super().__init__()
        self.module = module
        self.input_shape = tuple(input_shape)
        self.slots = slots
        self.canary = nn.Linear(slots, 1, bias=False)
        nn.init.zeros_(self.canary.weight)

    def linear_blocks(self) -> list[LinearBlock] | None:
        """Two blocks where ``module`` is linear (the closed form of a linear model's
        gradients, :class:`~dpfl.models.linear.ClosedFormLinear`): ``module`` on the features,
        θ on z; else None."""
        layer = linear_of(self.module)
        features = math.prod(self.input_shape)
        return None if layer is None else [
            LinearBlock(layer, slice(0, features)),
            LinearBlock(self.canary, slice(features, features + self.slots))]

    def representation_source(self) -> nn.Module:
        """The module whose representation MOON's contrastive loss reads (the model's, not
        θ's: :func:`~dpfl.algorithms.moon.representation_layer`)."""
        return self.module

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        out = self.module(x[:, :-self.slots].reshape(n, *self.input_shape)).reshape(n, -1)
        return torch.cat([out, self.canary(x[:, -self.slots:])], dim=1)


def canary_loss(base: Loss) -> Loss:
    """``base`` on every output column but the last, plus the last (z·θ)."""
    correct, output_grad = base.correct, base.output_grad
    return Loss(per_sample=lambda out, y: base.per_sample(out[:, :-1], y) + out[:, -1],
                correct=None if correct is None else lambda out, y: correct(out[:, :-1], y),
                output_grad=None if output_grad is None else lambda out, y: torch.cat(
                    [output_grad(out[:, :-1], y).reshape(len(out), -1),
                     out.new_ones(len(out), 1)], dim=1))


def with_z(x: Tensor, z: float = 0.0, slots: int = 1, slot: int | None = 0) -> Tensor:
    """Records ``x [n, ...]`` flattened, with ``slots`` more columns, ``z`` in column
    ``slot`` (every one, for ``slot=None``) and 0 in the others."""
    flat = x.reshape(len(x), -1)
    extra = flat.new_zeros(len(x), slots)
    if slot is None:
        extra.fill_(z)
    else:
        extra[:, slot] = z
    return torch.cat([flat, extra], dim=1)


def scale(source: Problem, radius: float) -> float:
    """s: :data:`SCALE_OVER_CLIP` times ``radius`` times the largest client's record count."""
    return SCALE_OVER_CLIP * radius * max(len(p) for p in source.partitions)


def canary_problem(source: Problem, x: Tensor, y: Tensor, parts: list[np.ndarray],
                   public_z: float, slots: int = 1, records: int = 0) -> Problem:
    """``source``'s run with the canary model (``slots`` θ added) over records ``x``
    (features and z, :func:`with_z`) and ``y``, split as ``parts``; the public records' z is
    ``public_z`` in every slot; ``records``, where not 0, the ``min-client-records`` every
    client calibrates from."""
    ds, flat = source.dataset, source.model.flat
    public_x = (None if ds.public_x is None
                else with_z(ds.public_x, public_z, slots, slot=None))
    dataset = Dataset(f"{ds.name}-audit", x, y, with_z(ds.test_x, slots=slots), ds.test_y,
                      task=ds.task, num_classes=ds.num_classes, public_x=public_x,
                      public_y=ds.public_y)
    module = CanaryModule(copy.deepcopy(flat.template), ds.input_shape, slots).to(source.device)
    model = FlatModel(module, canary_loss(source.model.loss), nonconvex_reg=flat.nonconvex_reg,
                      chunk_bytes=source.model.chunk_bytes)
    keys = {"num-partitions": len(parts), **({"min-client-records": records} if records else {})}
    return assemble(source.config.replace(**keys), dataset, parts, model=model)


#: algorithms whose clients map each step's clipped sum by a random map of their own (a random
#: subspace or mask, redrawn each step), under which anti-records would hide the canary
RANDOM_MAPS = frozenset({"rpdp-sgd", "rsdp-sgd"})
#: algorithms whose clients upload the entries of their update that the update itself selects
#: (FedLRS's top-p sparsification): anti-records change which entries survive, so they would
#: not move the scores by a constant
SELECTED_ENTRIES = frozenset({"fedlrs"})
#: where the audit's data records keep z = 0 under add/remove
NEUTRAL_RECORDS = RANDOM_MAPS | SELECTED_ENTRIES


def data_z(source: Problem, client: int, s: float) -> float:
    """z of client ``client``'s data records in the audit's worlds: −s (anti-records, which a
    fixed-size batch would let the canary displace: module docstring) under add/remove where
    every release of the client takes every record and no random map scales them, else 0."""
    algorithm = source.algorithm
    every = all(r.sample_rate >= 1 for r in source.releases(client))
    displaceable = (algorithm.relation is Relation.ADD_REMOVE
                    and algorithm.name not in NEUTRAL_RECORDS)
    return -s if displaceable and every else 0.0


def pinned_records(source: Problem, client: int) -> int:
    """The record count both worlds calibrate from: the run's ``min-client-records``, else,
    under add/remove, client ``client``'s count in the out world (0: each client's own)."""
    bound = source.config.privacy.min_client_records
    add_remove = source.algorithm.relation is Relation.ADD_REMOVE
    return bound or (len(source.partitions[client]) if add_remove else 0)


def record_trials(source: Problem, client: int, trials: int, radius: float) -> Problem:
    """The record-level federation for ``client``'s data D (module docstring; its records
    anti-records where :func:`data_z` says): ``trials`` clients holding the "out" world,
    ``trials`` the "in" world, then the reference client (out), which drives the server."""
    rows = torch.from_numpy(source.partitions[client])
    ds, n, s = source.dataset, len(rows), scale(source, radius)
    zero = torch.zeros(1, *ds.input_shape, dtype=ds.train_x.dtype)
    x = torch.cat([with_z(ds.train_x[rows], data_z(source, client, s)), with_z(zero, s),
                   with_z(zero, -s)])
    y = torch.cat([ds.train_y[rows], ds.train_y[rows[:1]], ds.train_y[rows[:1]]])
    rest = np.arange(1, n, dtype=np.int64)
    if source.algorithm.relation is Relation.REPLACE_ONE:
        out, inn = np.concatenate([[n + 1], rest]), np.concatenate([[n], rest])
    else:
        out, inn = np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64)
    return canary_problem(source, x, y, [out] * trials + [inn] * trials + [out], s,
                          records=pinned_records(source, client))


def sum_worlds(source: Problem, client: int, radius: float) -> tuple[Problem, Problem]:
    """The record-level worlds of a server that sees only each exchange's sum (secure
    aggregation): ``source``'s whole federation with the canary model, client ``client``'s data
    D "out" and "in" as :func:`record_trials` has them (its first record replaced by the
    anti-canary and by the canary under replace-one; without and with the canary under
    add/remove; anti-records where :func:`data_z` says), every other client's data as it is."""
    ds, s = source.dataset, scale(source, radius)
    zero = torch.zeros(1, *ds.input_shape, dtype=ds.train_x.dtype)
    own = torch.from_numpy(source.partitions[client])
    x = torch.cat([with_z(ds.train_x), with_z(zero, s), with_z(zero, -s),
                   with_z(ds.train_x[own], data_z(source, client, s))])
    y = torch.cat([ds.train_y, ds.train_y[:1], ds.train_y[:1], ds.train_y[own]])
    canary = ds.num_train
    rows = np.arange(canary + 2, canary + 2 + len(own), dtype=np.int64)  # D, as data_z has it
    if source.algorithm.relation is Relation.REPLACE_ONE:
        out, inn = np.concatenate([[canary + 1], rows[1:]]), np.concatenate([[canary], rows[1:]])
    else:
        out, inn = rows, np.concatenate([rows, [canary]])
    worlds = []
    for own in (out, inn):
        parts = list(source.partitions)
        parts[client] = own.astype(np.int64)
        worlds.append(canary_problem(source, x, y, parts, s))
    return worlds[0], worlds[1]


def client_trials(source: Problem, radius: float) -> tuple[Problem, Problem]:
    """The client-level worlds: ``source``'s federation with the canary model, without and with
    one more client, the last, holding only canary records (as many as the smallest client's
    records, so that it samples the batches every client does)."""
    ds, s = source.dataset, scale(source, radius)
    copies = min(len(p) for p in source.partitions)
    zero = torch.zeros(1, *ds.input_shape, dtype=ds.train_x.dtype)
    x = torch.cat([with_z(ds.train_x), with_z(zero, s).expand(copies, -1)])
    y = torch.cat([ds.train_y, ds.train_y[:1].expand(copies)])
    own = np.arange(ds.num_train, ds.num_train + copies, dtype=np.int64)
    parts = list(source.partitions)
    return (canary_problem(source, x, y, parts, s),
            canary_problem(source, x, y, [*parts, own], s))


def direction(problem: Problem) -> Tensor:
    """e_θ: the canary's coordinate, the last of the flat vector."""
    unit = torch.zeros(problem.model.d, device=problem.device)
    unit[-1] = 1.0
    return unit
