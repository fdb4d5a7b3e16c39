"""Projection before clipping: PCDP-SGD and FedPCDP, and the baselines that project otherwise.

Sha, Liu, Liu, Chen, "PCDP-SGD: Improving the Convergence of Differentially Private SGD via
Projection in Advance", arXiv:2312.03792 (version 1, 6 Dec 2023; the entry was later
withdrawn). Algorithm and equation numbers are the paper's; it numbers only eqs. (1)–(2).

**PCDP-SGD** (Algorithm 1, eq. (2)). At step t the top-k eigenspace V_{t,k} ∈ R^{d×k} of the
public records' uncentred gradient second moment Σ_j ∇ℓ(w_t, x_j^pub)∇ℓ(w_t, x_j^pub)ᵀ is
computed at the current model (line 7), each private per-sample gradient is projected onto it
*before* clipping, and the noise is projected too. With orthonormal V the update is computed in
the k coordinates (the equivalent form: ‖VVᵀg‖ = ‖Vᵀg‖ and VVᵀN(0, c²σ²I_d) has the law of
V·N(0, c²σ²I_k))::

    a_i = Vᵀ∇ℓ(w_t, x_i),   ā_i = a_i / max(1, ‖a_i‖/c),
    w_{t+1} = w_t − (γ/B)·V(Σ_{i∈B_t} ā_i + z_t),   z_t ~ N(0, c²σ² I_k)

over a Poisson batch B_t (each record with probability q = B/|D|, the release's sample rate,
|D| = ``min-client-records`` where set: public, never the client's actual record count; the sum
is divided by the expected B). V is never formed, nor is any per-sample gradient: V = G_pubᵀR
with R = QΛ^{-1/2} from the eigendecomposition QΛQᵀ of the B_pub×B_pub Gram matrix of the
public gradients, keeping the directions whose singular value is above 1e-6 of the largest (a
k above that numerical rank, k > B_pub, leaves the remaining columns zero, which project nothing
and carry no noise); a private record's coordinates are Vᵀg_i = Rᵀ(G_pub g_i), and
⟨g_pub,j, g_i⟩ factorises per Linear layer into (δ_j·δ_i)(a_j·a_i) of the two records' layer
inputs a and output gradients δ (conv layers, small here, are materialised per sample); the
lift V(Σ ā_i + z) is one weighted sum of the public gradients, a GEMM per layer
(:mod:`dpfl.models.span`, all in float64: R holds Λ^{-1/2}). A step costs the public and
private forward and backward passes plus O(B_pub·B·(in + out)) per layer, not the O(B·d·k) of
projecting materialised gradients. A client computes V from the public records (public data:
no privacy cost) at its current iterate at the first local step of every round and every
``projection-interval`` (β) steps after it, so a round of one epoch is Algorithm 1 with V reset
at each epoch (line 3). At the round's first step every client is at the broadcast model: on
the same public records (all m, or one IBS block) their V is one computation, shared
(:meth:`PublicEigenspace.subspaces`: the same numbers each client computes alone).
Centralized training is a federation of one client; with several clients this is distributed
PCDP-SGD (clients' models averaged).

The baselines (§3.1), one code path with the projection a pluggable :class:`Projection` (a
source of subspaces, and whether the step projects before clipping or after the noise):

* ``dp-sgd``: no projection (Abadi et al. 2016).
* ``pdp-sgd``: clip, add noise, *then* project (Zhou et al. 2021): w − (γ/B)·VVᵀ(Σ clip_c(g_i)
  + N(0, c²σ²I_d)), drawn as V(VᵀΣ clip_c(g_i) + z), z ~ N(0, c²σ²I_k) (the same law), where
  VᵀΣ clip_c(g_i) = Σ min(1, c/‖g_i‖)·Vᵀg_i: each record's coordinates, as PCDP-SGD's, clipped
  by its whole gradient's norm (a ghost norm from the same tapes).
* ``rpdp-sgd``: PCDP-SGD with a random subspace instead of the public one, redrawn every β
  steps (every step by default, as the paper's algorithm) from a public stream: by default k'
  rows of a rotation per layer (R_out ⊗ R_in for a Linear layer: :class:`KroneckerRotation`,
  coordinates read from the tapes), with ``random-basis="rotation"`` k' rows of a structured
  random rotation of the whole vector (:mod:`dpfl.algorithms.rotation`: exactly orthonormal,
  O(d log d) a vector), or with ``random-basis="qr"`` a Gaussian d×k' matrix orthonormalised by
  QR (a Haar subspace, O(dk'²) a draw; our reading: the paper states neither construction nor
  placement).
* ``rsdp-sgd``: random sparsification before clipping (Zhu & Blaschko 2021): a coordinate mask
  that drops a fraction ``sparsity`` of the d coordinates, shared by the batch and redrawn every β
  steps; noise on the kept coordinates only.

**FedPCDP** (Algorithms 2–3, §2.4). Each round the server's virtual client computes V_k^r from
the public records at the global model w_g^{r−1} (Algorithm 3; recomputed every β rounds) and
broadcasts it with the model — as what it is made of: R, the model it was computed at and which
public records, from which the client rebuilds V on its own copy of the public records (B_pub·k
+ d numbers instead of d·k on the downlink; the same V, bit for bit); each sampled client
(``fraction-train``; 0.8 in the paper) runs K local PCDP-SGD steps with that V and uploads the
k coordinates u_i = V_k^{rT}(w_g − w_{l,K}^i) (Algorithm 2 line 13): every local step lies in
span V, so the upload is lossless, and the uplink carries k numbers instead of d. Without
momentum u_i is the sum of the steps' own noisy coordinates times the step size (no d-vector
is projected); with momentum, whose buffer holds earlier rounds' subspaces, the update is
projected. The server
restores the update, w_g ← w_g − γ_g·V·mean_i u_i (line 16). ``fedpdp`` is the same with the
local step of PDP-SGD. The paper's DP-FedAvg and DP FedProx baselines are
:class:`~dpfl.algorithms.adaptive.DPFedAvg` with ``sampling="poisson"`` (and ``proximal-mu``).

Privacy (Theorem 1: Abadi et al.'s analysis plus post-processing). Record-level DP of each
client's data under add/remove neighbours (Poisson sampling, Opacus' analysis): per local step
one release of the noisy sum of per-sample vectors of norm at most c (radius c/B on the mean),
noise multiplier σ. V depends only on public records and on models that are already DP
outputs, so projecting through it is post-processing. The ledger reports Opacus' RDP (or PRV)
ε of the steps each client actually ran and, beside it, the paper's conversion
(``rdp-classical``: integer orders 2–256, the values its tables print) and PRV.

Clipping functions (Fig. 3: "+PC" is PCDP's projection before a clipping function). Every
algorithm here clips with ``clipping-function`` φ_c (:mod:`dpfl.privacy.clipping`; flat
``min(1, c/‖·‖)`` by default): PCDP-SGD and FedPCDP sum φ_c(Vᵀg_i), the projection family's
others φ_c of their own per-sample vector (PDP-SGD: Vᵀφ_c(g_i), the factor from the whole
gradient's norm). Every φ_c has norm below c, so the release and its accounting are the same.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from dpfl.algorithms.base import (
    Batches,
    ClientContext,
    Cohort,
    Exchange,
    ServerContext,
    State,
    Upload,
)
from dpfl.algorithms.local_dpsgd import (
    LR_MILESTONES,
    MOMENTUM,
    SERVER_LEARNING_RATE,
    FederatedDPSGD,
    LocalDPSGDHyperparameters,
    NoisyStep,
)
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.algorithms.rotation import ROUNDS, KroneckerRows, LayerRotation, RotatedRows, Rotation
from dpfl.algorithms.subspace import Basis, Coordinates, GradientBasis, Subspace
from dpfl.config import FRACTION_TRAIN, Param, at_least, hyperparameter
from dpfl.errors import ConfigError
from dpfl.models.rows import aligned, aligned_rows, same_bits
from dpfl.models.span import GradientSpan, Shifts
from dpfl.privacy import SERVER, Randomness

if TYPE_CHECKING:
    from dpfl.models import FlatModel

log = logging.getLogger("dpfl")

PROJECTION_DIM = Param("projection-dim", 100, "Dimension of the subspace projected onto: the "
                       "top-k public eigenspace (PCDP-SGD, PDP-SGD, FedPCDP, FedPDP; 100 in the "
                       "paper) or the random subspace (RPDP-SGD; 800 MNIST, 1000 FMNIST).",
                       check=at_least(1), symbol="k")
PROJECTION_INTERVAL = Param("projection-interval", 1, "Steps (rounds, for FedPCDP/FedPDP) "
                            "that reuse one subspace before it is recomputed (App. G.3); a "
                            "client also recomputes at the first step of every round.",
                            check=at_least(1), symbol="β")
RANDOM_BASIS = Param("random-basis", "kronecker", "RPDP-SGD: how its random k'-subspace is "
                     "drawn: 'kronecker', k' rows of a rotation per layer, R_out ⊗ R_in for a "
                     "Linear layer, whose coordinates come from the tapes without per-sample "
                     "gradients (the fastest; the same mean share of a gradient as a Haar "
                     "subspace, a wider spread); 'rotation', k' rows of a structured random "
                     "rotation of the whole vector (exactly orthonormal, O(d log d) a vector: "
                     "docs/algorithms.md); or 'qr', a Gaussian d×k' matrix orthonormalised by "
                     "QR (Haar-distributed, O(dk'²) a draw).",
                     choices=("rotation", "qr", "kronecker"))
PUBLIC_BATCH = Param("public-batch-size", 0, "Public records behind one subspace; 0 = all m "
                     "(the paper's setting).", check=at_least(0), symbol="B_pub")
PUBLIC_BATCHING = Param("public-batching", "rbs", "How the public batch is drawn (§4.3, App. "
                        "G.7): 'rbs', a random batch each time (reusing records), or 'ibs', "
                        "disjoint blocks of the public set, one per subspace (needs m ≥ "
                        "B_pub × the subspaces of the run).", choices=("rbs", "ibs"))
SPARSITY = Param("sparsity", 0.3, "RSDP-SGD: fraction of the d coordinates each mask drops "
                 "(Zhu & Blaschko's sparsification rate; the paper's 0.3).",
                 check=lambda v: None if 0 <= v < 1 else f"must be in [0, 1), got {v}",
                 symbol="p")

RELATIVE_TOLERANCE = 1e-6  # singular values below this fraction of the largest are dropped
#: the condition number σ_1/σ_k of the kept public gradients up to which the projection's inner
#: products and lift run in the model's dtype; above it, in float64 (:func:`products_dtype`)
WELL_CONDITIONED = 100.0


def round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


# ---- subspaces ---------------------------------------------------------------------------------

def top_eigenspace(gram: Tensor, k: int) -> tuple[Tensor, int]:
    """``(R [m, k], rank)`` (float64): the top-k eigenvectors of Σ_j g_j g_jᵀ are the columns
    of V = GᵀR, from the ``[m, m]`` Gram matrix GGᵀ = QΛQᵀ of the rows g_j of G: R = QΛ^{-1/2},
    by decreasing eigenvalue; directions with singular value at most 1e-6 of the largest are
    dropped and the columns beyond the rank are zero.

    An eigenvector is defined up to its sign, and LAPACK (CPU) and cuSOLVER (GPU) choose
    differently; the noise is drawn in these coordinates, so each column's sign is fixed by
    the convention that its largest entry in Q is positive: the same basis on every device."""
    eigenvalues, q = torch.linalg.eigh(gram.double())
    eigenvalues, q = eigenvalues.flip(0), q.flip(1)
    top = eigenvalues[0] if len(eigenvalues) else q.new_zeros(())
    keep = int((eigenvalues > top * RELATIVE_TOLERANCE ** 2).sum()) if top > 0 else 0
    rank = min(k, keep)
    r = q.new_zeros(len(q), k)
    if rank:
        top_q = q[:, :rank]
        top_q = top_q * top_q.gather(0, top_q.abs().argmax(dim=0, keepdim=True)).sign()
        r[:, :rank] = top_q / eigenvalues[:rank].sqrt()
    return r, rank


def products_dtype(r: Tensor, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the inner products and weighted sums behind V = GᵀR (R from
    :func:`top_eigenspace`): the model's where the kept public gradients are well conditioned
    (σ_1/σ_k ≤ :data:`WELL_CONDITIONED`), else float64. R's column c has norm 1/σ_c, so R
    amplifies the products' rounding in coordinate c by up to σ_1/σ_c: at κ ≤ 100 float32's
    relative 6e-8 becomes at most about 1e-5 (times the sums' √length), below what the
    materialised route's float32 V and GEMMs carried (about 6e-8·√d ≈ 3e-5 at d = 2·10⁵); at
    the rank cut-off, 10⁶, it would not be."""
    norms = torch.linalg.vector_norm(r, dim=0)
    kept = norms[norms > 0]
    if not len(kept) or kept.max() <= WELL_CONDITIONED * kept.min():
        return model_dtype
    return torch.float64


# ---- hyperparameters ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ProjectedHyperparameters(LocalDPSGDHyperparameters):
    """K local DP-SGD steps on Poisson batches (``dp-sgd``: no projection)."""

    fraction_train: float = hyperparameter(FRACTION_TRAIN)  # S/N
    server_learning_rate: float = hyperparameter(SERVER_LEARNING_RATE)  # γ_g
    momentum: float = hyperparameter(MOMENTUM)  # β_m
    lr_milestones: str = hyperparameter(LR_MILESTONES)
    sampling: ClassVar[str] = "poisson"


@dataclass(frozen=True)
class SparseHyperparameters(ProjectedHyperparameters):
    sparsity: float = hyperparameter(SPARSITY)  # p
    projection_interval: int = hyperparameter(PROJECTION_INTERVAL)  # β


@dataclass(frozen=True)
class RandomProjectionHyperparameters(ProjectedHyperparameters):
    projection_dim: int = hyperparameter(PROJECTION_DIM)  # k'
    projection_interval: int = hyperparameter(PROJECTION_INTERVAL)  # β


@dataclass(frozen=True)
class RPDPHyperparameters(RandomProjectionHyperparameters):
    random_basis: str = hyperparameter(RANDOM_BASIS)


@dataclass(frozen=True)
class PublicProjectionHyperparameters(RandomProjectionHyperparameters):
    public_batch_size: int = hyperparameter(PUBLIC_BATCH)  # B_pub
    public_batching: str = hyperparameter(PUBLIC_BATCHING)


# ---- where a step's subspace comes from ---------------------------------------------------------

class SubspaceSource(ABC):
    """Where a projected step's subspaces come from: ``owner``'s ``index``-th of round
    ``server_round`` at the point ``point`` (``[d]``; a client's current iterate)."""

    def check_run(self, num_rounds: int) -> None:
        """Refuse a run this source cannot serve; nothing by default."""

    @abstractmethod
    def subspace(self, point: Tensor, rng: Randomness, owner: int, server_round: int,
                 index: int) -> Subspace:
        """The subspace, on ``point``'s device."""

    def subspaces(self, points: Tensor, rng: Randomness, owners: Sequence[int],
                  server_round: int, index: int) -> list[Subspace]:
        """Each owner's subspace at its point (``points [C, d]``, in the order of ``owners``)."""
        return [self.subspace(points[i], rng, owner, server_round, index)
                for i, owner in enumerate(owners)]


class RandomBasis(SubspaceSource):
    """RPDP-SGD's: a Gaussian d×k' matrix orthonormalised by QR, from the owner's stream
    ``subspace-<index>`` of the round (public randomness)."""

    def __init__(self, algorithm: DPSGD) -> None:
        self.d, self.k = algorithm.model.d, algorithm.hp.projection_dim

    def subspace(self, point: Tensor, rng: Randomness, owner: int, server_round: int,
                 index: int) -> Subspace:
        gaussian = rng.normal([owner], server_round, f"subspace-{index}", (self.d, self.k),
                              torch.ones(1))[0]
        return Basis(torch.linalg.qr(gaussian).Q.to(point.device))


def draw_rotation(rng: Randomness, owner: int, server_round: int, purpose: str, n: int,
                  device: torch.device) -> Rotation:
    """A structured random rotation of R^n (:mod:`dpfl.algorithms.rotation`): its permutations
    and signs from the owner's streams ``<purpose>-p<r>``, ``<purpose>-s<r>`` of the round."""
    permutations = [rng.permutation(owner, server_round, f"{purpose}-p{r}", n).to(device)
                    for r in range(ROUNDS)]
    signs = [torch.where(rng.normal([owner], server_round, f"{purpose}-s{r}", (n,),
                                    torch.ones(1))[0] < 0, -1.0, 1.0).to(device)
             for r in range(ROUNDS)]
    return Rotation(permutations, signs)


class RandomRotation(SubspaceSource):
    """RPDP-SGD's with ``random-basis="rotation"``: k' distinct rows of a structured random
    rotation (:mod:`dpfl.algorithms.rotation`), its permutations and signs from the owner's
    streams ``subspace-<index>-…`` of the round (public randomness)."""

    def __init__(self, algorithm: DPSGD) -> None:
        self.d, self.k = algorithm.model.d, algorithm.hp.projection_dim

    def subspace(self, point: Tensor, rng: Randomness, owner: int, server_round: int,
                 index: int) -> Subspace:
        purpose = f"subspace-{index}"
        rotation = draw_rotation(rng, owner, server_round, purpose, self.d, point.device)
        kept = rng.permutation(owner, server_round, purpose, self.d)[:min(self.k, self.d)]
        return RotatedRows(rotation, kept.to(point.device))


class KroneckerRotation(SubspaceSource):
    """RPDP-SGD's with ``random-basis="kronecker"``: k' rows of Q = diag(R_out,ℓ ⊗ R_in,ℓ) over
    the layers (:class:`~dpfl.algorithms.rotation.KroneckerRows`; a layer other than ``Linear``
    rotated as one vector), each factor a structured random rotation. The k' rows are spread
    over the layers by systematic sampling — layer ℓ of d_ℓ parameters gets ⌊k'D_ℓ/d + u⌋ −
    ⌊k'D_{ℓ−1}/d + u⌋ of them (D_ℓ = d_1 + … + d_ℓ, one u uniform on [0, 1)), so k'd_ℓ/d on
    average and within one of it — and drawn uniformly within the layer: every row of Q is kept
    with probability k'/d, so E[VVᵀ] = (k'/d)·I as for a Haar V. All from the owner's streams
    ``subspace-<index>-…`` of the round (public randomness)."""

    def __init__(self, algorithm: DPSGD) -> None:
        self.d, self.k = algorithm.model.d, min(algorithm.hp.projection_dim, algorithm.model.d)
        self.layers = algorithm.model.flat.layers

    def subspace(self, point: Tensor, rng: Randomness, owner: int, server_round: int,
                 index: int) -> Subspace:
        purpose, dev = f"subspace-{index}", point.device
        z = rng.normal([owner], server_round, f"{purpose}-u", (1,), torch.ones(1),
                       dtype=torch.float64)
        u = float(torch.special.ndtr(z))
        blocks, before = [], 0
        for i, layer in enumerate(self.layers):
            numel = sum(shape.numel() for shape in layer.shapes)
            count = (math.floor(self.k * (before + numel) / self.d + u)
                     - math.floor(self.k * before / self.d + u))
            before += numel
            name = f"{purpose}-l{i}"
            rows = None
            width = numel
            if type(layer.module) is nn.Linear:
                out = layer.shapes[0][0]
                width = numel // out
                rows = draw_rotation(rng, owner, server_round, f"{name}-out", out, dev)
            cols = draw_rotation(rng, owner, server_round, f"{name}-in", width, dev)
            kept = rng.permutation(owner, server_round, name, numel)[:count].sort().values
            blocks.append(LayerRotation(layer, rows, cols, kept.to(dev)))
        return KroneckerRows(blocks, self.d)


#: RPDP-SGD's random bases, by ``random-basis``
RANDOM_BASES: dict[str, Callable[[DPSGD], SubspaceSource]] = {
    "qr": RandomBasis, "rotation": RandomRotation, "kronecker": KroneckerRotation}


class RandomMask(SubspaceSource):
    """RSDP-SGD's: the coordinates a uniformly random mask keeps, round((1 − p)·d) of them
    (at least one), from the owner's stream ``subspace-<index>`` of the round."""

    def __init__(self, algorithm: DPSGD) -> None:
        self.d, self.sparsity = algorithm.model.d, algorithm.hp.sparsity

    def subspace(self, point: Tensor, rng: Randomness, owner: int, server_round: int,
                 index: int) -> Subspace:
        keep = max(1, round_half_up((1 - self.sparsity) * self.d))
        kept = rng.permutation(owner, server_round, f"subspace-{index}", self.d)[:keep]
        return Coordinates(kept.sort().values.to(point.device), self.d)


class PublicEigenspace(SubspaceSource):
    """PCDP-SGD's (and PDP-SGD's, FedPCDP's): the top-k eigenspace of the public gradients at
    the point, from public batch ``index`` of the owner's round (RBS: B_pub records drawn from
    stream ``public-<index>``, or all m; IBS: block ``index`` of the public set shuffled
    once, the blocks counted across the run)."""

    def __init__(self, algorithm: DPSGD) -> None:
        self.algorithm = algorithm
        self.order: Tensor | None = None  # IBS: the public set's one shuffle of the run
        self.warned_rank = False  # a k above the public gradients' rank is logged once a run
        #: the last span made, with its point (and that tensor's version: written in place
        #: since, it no longer is the span's point) and rows: FedPCDP's round asks for the same
        #: span at the server's begin_round, at its clients and at its server step
        self.last: tuple[Tensor, int, Tensor, GradientSpan] | None = None

    @property
    def batch(self) -> int:
        """B_pub: the public records behind one subspace."""
        public = self.algorithm.public
        assert public is not None
        return self.algorithm.hp.public_batch_size or len(public[1])

    def check_run(self, num_rounds: int) -> None:
        """Refuse a run the public records cannot serve (no public set; IBS without enough
        disjoint blocks)."""
        hp, name, public = self.algorithm.hp, self.algorithm.name, self.algorithm.public
        if public is None:
            raise ConfigError("dataset-options", f"{name} projects onto public records, "
                              "and the dataset has none", allowed="num_public=<m>, e.g. 100")
        m = len(public[1])
        if hp.public_batch_size > m:
            raise ConfigError("public-batch-size", f"{hp.public_batch_size} exceeds the "
                              f"{m} public records", allowed=f"0..{m}")
        if hp.public_batching == "ibs":
            needed = self.algorithm.subspaces_per_run(num_rounds)
            blocks = m // self.batch
            if blocks < needed:
                raise ConfigError("public-batching", f"'ibs' needs {needed} disjoint public "
                                  f"blocks of {self.batch} and {m} records give "
                                  f"{blocks}", allowed="rbs, or more public records")

    def subspace(self, point: Tensor, rng: Randomness, owner: int, server_round: int,
                 index: int) -> Subspace:
        """A client's ``index``-th subspace of the round (under IBS the block after those of
        its earlier rounds)."""
        return self.subspaces(point[None], rng, [owner], server_round, index)[0]

    def subspaces(self, points: Tensor, rng: Randomness, owners: Sequence[int],
                  server_round: int, index: int) -> list[Subspace]:
        """Owners whose public records and point coincide share one subspace: the same inputs
        give the same eigenspace bit for bit, so each is computed once (every client's at the
        round's first step, all at the broadcast model, where they project onto all m public
        records or one IBS block), as each client alone would compute it."""
        hp = self.algorithm.hp
        if hp.public_batching == "ibs":
            index += (server_round - 1) * math.ceil(hp.local_steps / hp.projection_interval)
        computed: dict[tuple, list[tuple[Tensor, Tensor, Subspace]]] = {}
        out: list[Subspace] = []
        for point, owner in zip(points, owners, strict=True):
            rows = self.rows(rng, owner, server_round, index)
            same = computed.setdefault((len(rows), int(rows.sum())), [])
            space = next((s for r, p, s in same if torch.equal(r, rows) and same_bits(p, point)),
                         None)
            if space is None:
                space = self.at(point, rows)
                same.append((rows, point, space))
            out.append(space)
        return out

    def rows(self, rng: Randomness, owner: int, server_round: int, index: int) -> Tensor:
        """The public records behind subspace ``index`` (sorted positions in the public set):
        IBS block ``index``, an RBS batch of B_pub from the owner's stream ``public-<index>``
        of the round, or all m."""
        hp = self.algorithm.hp
        assert self.algorithm.public is not None
        b, m = self.batch, len(self.algorithm.public[1])
        if hp.public_batching == "ibs":
            if self.order is None:  # shuffled once per run (per process if secure)
                self.order = rng.permutation(SERVER, 0, "public-blocks", m)
            return self.order[index * b:(index + 1) * b].sort().values
        if b < m:
            return rng.permutation(owner, server_round, f"public-{index}", m)[:b].sort().values
        return torch.arange(m)

    def span(self, point: Tensor, rows: Tensor) -> GradientSpan:
        """The public records ``rows``' gradients at ``point`` (their tapes): the last span
        made where the point holds the same bits and the rows are the same (the same
        computation, so the same numbers), else a new one."""
        if self.last is not None:
            at, version, made_of, span = self.last
            if at._version == version and torch.equal(made_of, rows) and same_bits(at, point):
                return span
        assert self.algorithm.public is not None
        px, py = self.algorithm.public
        dev = point.device
        picked = rows.to(px.device)
        span = GradientSpan(self.algorithm.model, point, aligned(px[picked]).to(dev),
                            py[picked].to(dev))
        self.last = (point, point._version, rows.clone(), span)
        return span

    def at(self, point: Tensor, rows: Tensor, r: Tensor | None = None) -> GradientBasis:
        """The top-k eigenspace of the public records ``rows``' gradients at ``point``, kept as
        their span and its weights R (:func:`top_eigenspace`), or the weights ``r`` given
        (FedPCDP's client: the server's, broadcast)."""
        algorithm, hp = self.algorithm, self.algorithm.hp
        span = self.span(point, rows)
        if r is not None:
            r = r.to(point.device, torch.float64)
            return GradientBasis(span, r, products_dtype(r, point.dtype))
        r, rank = top_eigenspace(span.gram(), hp.projection_dim)
        if rank < hp.projection_dim and not self.warned_rank:
            # m gradients span at most m dimensions, fewer where some coincide or vanish:
            # expected when k is as large (the paper's m = B_pub = k = 100), worth a warning
            # only when more public records than k still span fewer than k
            self.warned_rank = True
            (log.warning if len(rows) > hp.projection_dim else log.info)(
                "%s: the %d public gradients span %d < k = %d dimensions; the remaining "
                "directions are left out (no signal, no noise)", algorithm.name, len(rows),
                rank, hp.projection_dim)
        return GradientBasis(span, r, products_dtype(r, point.dtype))


@dataclass(frozen=True)
class Projection:
    """How a step projects: onto the subspaces ``source`` gives, each private per-sample
    gradient before clipping (PCDP-SGD's eq. (2)), or with ``after_clipping`` the noisy
    clipped mean (PDP-SGD: clip, add noise, then project)."""

    source: Callable[[DPSGD], SubspaceSource]
    after_clipping: bool = False


# ---- the centralized family ----------------------------------------------------------------------

@ALGORITHMS.register_class
class DPSGD(FederatedDPSGD[ProjectedHyperparameters]):
    """DP-SGD (Abadi et al.) on Poisson batches, K steps per round; the base of the family,
    whose members differ only in their :class:`Projection` (see the module docstring)."""

    name = "dp-sgd"
    Hyperparameters = ProjectedHyperparameters
    protection = ("record-level local DP per client (add/remove neighbours): K local DP-SGD "
                  "steps per round on Poisson batches, noised on the client")
    #: how a step projects; None: DP-SGD's step, unprojected
    projection: ClassVar[Projection | None] = None

    def __init__(self, hp: ProjectedHyperparameters, model: FlatModel, num_clients: int, *,
                 public: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__(hp, model, num_clients, public=public)
        self.source = self.projection.source(self) if self.projection else None

    def check_run(self, num_rounds: int) -> None:
        if self.source is not None:
            self.source.check_run(num_rounds)

    def subspaces_per_run(self, num_rounds: int) -> int:
        """Subspaces a client computes in ``num_rounds`` rounds (one each β local steps,
        restarting each round)."""
        return num_rounds * math.ceil(self.hp.local_steps / self.hp.projection_interval)

    # ---- client ----------------------------------------------------------------------------
    def step_gradient(self, x: Tensor, cohort: Cohort, radius: float, broadcast: State,
                      ctx: ClientContext) -> NoisyStep:
        """DP-SGD's noisy gradient, or the projected one in each step's subspaces (kept from
        one step to the next of the round)."""
        if self.projection is None:
            return super().step_gradient(x, cohort, radius, broadcast, ctx)
        spaces: list[Subspace] = []

        def gradient(params: Tensor, k: int) -> tuple[Tensor, Tensor]:
            nonlocal spaces
            spaces = self.step_subspaces(params, cohort, k, ctx, spaces)
            return self.projected_gradient(params, self.local.batches(cohort, k, ctx), spaces,
                                           radius, k, ctx)
        return gradient

    def step_subspaces(self, params: Tensor, cohort: Cohort, k: int, ctx: ClientContext,
                       current: list[Subspace]) -> list[Subspace]:
        """Each client's subspace for local step ``k``: from the source at the first step of
        the round and every β steps (at the client's current iterate), else ``current``."""
        interval = self.hp.projection_interval
        if k % interval:
            return current
        assert self.source is not None
        return self.source.subspaces(params, ctx.rng, cohort.ids, ctx.server_round,
                                     k // interval)

    def projected_gradient(self, params: Tensor, batches: Batches, spaces: list[Subspace],
                           radius: float, k: int, ctx: ClientContext) -> tuple[Tensor, Tensor]:
        """``[C, d]``: (1/B)·V(Σ_i clip_c(Vᵀg_i) + z) (eq. (2); PDP-SGD: (1/B)·V(VᵀΣ_i
        clip_c(g_i) + z)), z ~ N(0, c²σ²I_k), and the fraction of each batch clipped."""
        noisy, clipped = self.projected_coordinates(params, batches, spaces, radius, k, ctx)
        lifted = params.new_empty(params.shape)
        for space, a, row in zip(spaces, noisy, lifted, strict=True):
            space.lift_into(a, row)
        return lifted, clipped

    def projected_coordinates(self, params: Tensor, batches: Batches, spaces: list[Subspace],
                              radius: float, k: int, ctx: ClientContext,
                              shifts: Sequence[Shifts | None] | None = None
                              ) -> tuple[Tensor, Tensor]:
        """``[C, k]``: the step's noisy coordinates (1/B)·(Σ_i clip_c(Vᵀg_i) + z) (PDP-SGD:
        (1/B)·(VᵀΣ_i clip_c(g_i) + z)) at each client's point ``params[i]``, moved within its
        span by ``shifts[i]`` where given (:meth:`~dpfl.models.span.GradientSpan.shifts`), and
        the fraction of each batch clipped ``[C]``."""
        b = self.hp.batch_size
        moved = shifts or [None] * len(spaces)
        sums, clipped = zip(*(self.projected_clipped_sum(params[i], xb, yb, s, radius, ctx,
                                                         moved[i])
                              for i, ((xb, yb), s) in enumerate(zip(batches, spaces,
                                                                     strict=True))))
        noisy = ctx.privatize("train", torch.stack(sums) / b, radius=radius / b, step=k)
        return noisy, torch.stack(clipped)

    def projected_clipped_sum(self, point: Tensor, xb: Tensor, yb: Tensor, space: Subspace,
                              radius: float, ctx: ClientContext, shifts: Shifts | None = None
                              ) -> tuple[Tensor, Tensor]:
        """Σ_i clip_c(Vᵀ∇ℓ(point, x_i)) over one client's batch (``[k]``, in chunks of the
        model's chunk size), and the fraction clipped; with ``shifts`` at ``point`` moved
        within ``space``'s span. Projected after clipping (PDP-SGD), VᵀΣ_i clip_c(∇ℓ(point,
        x_i)) = Σ_i min(1, c/‖∇ℓ_i‖)·Vᵀ∇ℓ_i: the same records' coordinates, each clipped by its
        whole gradient's norm, both from the tapes
        (:meth:`~dpfl.algorithms.subspace.GradientBasis.sample_coords_and_norms`): neither the
        clipped sum in R^d nor its projection is formed."""
        dev = ctx.device
        x, y = xb.to(dev), yb.to(dev)
        if self.projection is not None and self.projection.after_clipping:
            assert isinstance(space, GradientBasis)
            coords = space.sample_coords_and_norms(point, x, y, shifts)
        else:
            assert shifts is None or isinstance(space, GradientBasis)  # a span moves points
            coords = ((a, torch.linalg.vector_norm(a, dim=1)) for a in (
                space.sample_coords(self.model, point, x, y) if shifts is None else
                space.sample_coords(self.model, point, x, y, shifts)))
        total: Tensor | None = None
        clipped = 0
        clipping = self.hp.per_sample_clipping
        for a, norms in coords:
            part = clipping.factors(norms, radius) @ a
            total = part if total is None else total + part
            clipped += int((norms > radius).sum())
        if total is None:  # an empty Poisson batch
            total = space.coords(point.new_zeros(point.shape))
        return total, point.new_tensor(clipped / max(len(yb), 1))


# the algorithms that project onto public records hold out 100 of the training set's (the
# papers' m = 100) unless dataset-options says otherwise: docs/defaults.md
PUBLIC_RECORDS = {"dataset-options": "num_public=100"}


@ALGORITHMS.register_class
class PCDPSGD(DPSGD):
    """PCDP-SGD (Algorithm 1): project onto the public top-k eigenspace, then clip."""

    name = "pcdp-sgd"
    defaults = PUBLIC_RECORDS
    Hyperparameters = PublicProjectionHyperparameters
    projection = Projection(PublicEigenspace)


@ALGORITHMS.register_class
class PDPSGD(DPSGD):
    """PDP-SGD (Zhou et al. 2021): clip, add noise, then project onto the public eigenspace."""

    name = "pdp-sgd"
    defaults = PUBLIC_RECORDS
    Hyperparameters = PublicProjectionHyperparameters
    projection = Projection(PublicEigenspace, after_clipping=True)


@ALGORITHMS.register_class
class RPDPSGD(DPSGD):
    """RPDP-SGD: PCDP-SGD with a random orthonormal subspace of dimension k'."""

    name = "rpdp-sgd"
    # a random k'-subspace keeps about k'/d of a gradient's squared norm: the step must be
    # about √(d/k') times DP-SGD's (docs/defaults.md)
    defaults = {"learning-rate": 100.0, "clip": 0.3}
    Hyperparameters = RPDPHyperparameters
    projection = Projection(lambda algorithm: RANDOM_BASES[algorithm.hp.random_basis](algorithm))


@ALGORITHMS.register_class
class RSDPSGD(DPSGD):
    """RSDP-SGD (Zhu & Blaschko 2021): random coordinate sparsification before clipping."""

    name = "rsdp-sgd"
    Hyperparameters = SparseHyperparameters
    projection = Projection(RandomMask)


class RoundSubspace:
    """The server's public subspace of each round (FedPCDP's Algorithm 3, the virtual client;
    also the upload space of :mod:`~dpfl.algorithms.pfa`): V_k^r from the public records at the
    global model w_g^{r−1}, recomputed every β rounds (the lost condition of Algorithm 3's line
    5 read as this interval), from the server's public batch of index ⌊(r − 1)/β⌋. V = GᵀR is
    kept in server state, and broadcast, as what it is made of (keys :data:`ROUND_SUBSPACE`):
    its weights R (``basis``, ``[B_pub, k]``), the model it was computed at (``basis-point``)
    and the public records behind G (``public-rows``); a client rebuilds G from its copy of the
    public records, so the downlink carries B_pub·k + d numbers instead of d·k (the same V, bit
    for bit)."""

    def __init__(self, source: PublicEigenspace, interval: int) -> None:
        self.source = source
        self.interval = interval  # β

    def begin_round(self, state: State, ctx: ServerContext) -> State:
        """Server state with the round's V_k^r: a new one in rounds 1, 1 + β, …, else kept."""
        if (ctx.server_round - 1) % self.interval:
            return state
        index = (ctx.server_round - 1) // self.interval
        rows = self.source.rows(ctx.rng, SERVER, ctx.server_round, index)
        space = self.source.at(state["x"], rows)
        return {**state, "basis": space.r, "basis-point": state["x"], "public-rows": rows}

    def at(self, broadcast: State, device: torch.device) -> GradientBasis:
        """The round's V_k^r from the broadcast (or the server's state), on ``device``."""
        return self.source.at(broadcast["basis-point"].to(device), broadcast["public-rows"],
                              r=broadcast["basis"])


#: the server-state and broadcast keys :class:`RoundSubspace` keeps V_k^r under
ROUND_SUBSPACE = ("basis", "basis-point", "public-rows")


# ---- the federated family ----------------------------------------------------------------------

@ALGORITHMS.register_class
class FedPCDP(DPSGD):
    """FedPCDP (Algorithms 2–3): the server's public subspace per round, broadcast with the
    model; k-coordinate uploads."""

    name = "fedpcdp"
    defaults = PUBLIC_RECORDS
    Hyperparameters = PublicProjectionHyperparameters
    projection = Projection(PublicEigenspace)  # the server's, broadcast
    exchanges = (Exchange("train", ("x", "radius", *ROUND_SUBSPACE),
                          {"u": Upload("train", post_processing=True)}),)

    def __init__(self, hp: ProjectedHyperparameters, model: FlatModel, num_clients: int, *,
                 public: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__(hp, model, num_clients, public=public)
        assert isinstance(self.source, PublicEigenspace)
        self.round_space = RoundSubspace(self.source, self.hp.projection_interval)

    def subspaces_per_run(self, num_rounds: int) -> int:
        return math.ceil(num_rounds / self.hp.projection_interval)

    def begin_round(self, state: State, ctx: ServerContext) -> State:
        """Algorithm 3 (the virtual client): V_k^r at the global model every β rounds
        (:class:`RoundSubspace`)."""
        return self.round_space.begin_round(state, ctx)

    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        return {key: state[key] for key in self.exchanges[0].broadcast}

    def upload_space(self, broadcast: State, device: torch.device) -> Subspace:
        """The round's V_k^r from the broadcast (or the server's state), on ``device``."""
        return self.round_space.at(broadcast, device)

    def step_gradient(self, x: Tensor, cohort: Cohort, radius: float, broadcast: State,
                      ctx: ClientContext) -> NoisyStep:
        """The local steps in the round's broadcast subspace V_k^r, every client's."""
        return self.in_subspace(self.upload_space(broadcast, ctx.device), cohort, radius, ctx)

    def in_subspace(self, space: Subspace, cohort: Cohort, radius: float,
                    ctx: ClientContext) -> NoisyStep:
        """The local steps in ``space``, every client's, each lifted into R^d."""
        spaces = [space] * len(cohort)
        return lambda params, k: self.projected_gradient(
            params, self.local.batches(cohort, k, ctx), spaces, radius, k, ctx)

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        """K local steps in span V, then the k coordinates of the update (Alg. 2 line 13):
        u = Vᵀ(w_g − w_K) = η·Σ_k a_k, the steps' own noisy coordinates summed (in float64;
        zero where V's column is: beyond the public gradients' rank), with no d-vector
        projected (:meth:`steps_in_span`). With momentum the buffer carries earlier rounds'
        subspaces: the steps are lifted and the update projected, u = Vᵀ(w_g − w_K)."""
        x = broadcast["x"].to(ctx.device)
        space = self.upload_space(broadcast, ctx.device)
        radius = float(broadcast["radius"][0])
        assert isinstance(space, GradientBasis)
        if self.hp.momentum:
            params, states = self.local_steps(x, cohort, states, broadcast, ctx,
                                              gradient=self.in_subspace(space, cohort, radius,
                                                                        ctx))
            return {"u": space.coords(x - params).cpu()}, states
        steps = self.steps_in_span(x, space, cohort, radius, ctx)
        live = torch.linalg.vector_norm(space.r, dim=0) > 0
        u = torch.stack(steps).double().sum(dim=0) * self.hp.learning_rate_at(ctx.server_round)
        return {"u": (u * live).to(x.dtype).cpu()}, states

    def steps_in_span(self, x: Tensor, space: GradientBasis, cohort: Cohort, radius: float,
                      ctx: ClientContext) -> list[Tensor]:
        """Each local step's noisy coordinates ``[C, k]``, every client's K steps in span V.
        Every step lies in V, so after k steps a client is at x − Gᵀc, c = ηR·Σ a (the steps'
        coordinates a, the span's gradients G): kept as x and c, never formed in R^d. Where
        the span allows (:attr:`~dpfl.models.span.GradientSpan.shiftable`: a model of
        ``Linear`` layers) the forward pass at x − Gᵀc is x's with each layer's output moved,
        m·n·(in + out) multiply-adds in the products' dtype for n records instead of a lift's
        m·in·out; else the point is formed, one lift of c a client and step. Either way no
        client lifts its last step, whose iterate the upload does not need."""
        hp = self.hp
        rate = hp.learning_rate_at(ctx.server_round)
        spaces = [space] * len(cohort)
        start = aligned(x).expand(len(cohort), -1)
        moved: list[Tensor] = []  # each client's c [m] (float64) after the steps so far
        clipped = torch.zeros(len(cohort), device=ctx.device)
        steps = []
        for k in range(hp.local_steps):
            batches = self.local.batches(cohort, k, ctx)
            if not moved:
                noisy, fraction = self.projected_coordinates(start, batches, spaces, radius, k,
                                                             ctx)
            elif space.span.shiftable:
                noisy, fraction = self.projected_coordinates(
                    start, batches, spaces, radius, k, ctx,
                    [space.span.shifts(c, space.dtype) for c in moved])
            else:  # on aligned rows, as a node's one client (MKL rounds by alignment)
                points = aligned_rows(x, len(cohort), x.numel())
                for c, row in zip(moved, points, strict=True):
                    torch.sub(x, space.span.combine(c, space.dtype).to(x.dtype), out=row)
                noisy, fraction = self.projected_coordinates(points, batches, spaces, radius, k,
                                                             ctx)
            steps.append(noisy)
            clipped.add_(fraction)
            weights = [rate * space.weights(a) for a in noisy]
            moved = [c + w for c, w in zip(moved, weights, strict=True)] if moved else weights
        ctx.diagnose("clipped-fraction", clipped / hp.local_steps)
        return steps

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        """w_g ← w_g − γ_g·V·mean_i u_i (Algorithm 2 line 16)."""
        x = state["x"]
        update = self.upload_space(state, x.device).lift(
            sums["u"].to(x.device) / len(ctx.participants))
        return {**state, "x": x - self.hp.server_learning_rate * update}


@ALGORITHMS.register_class
class FedPDP(FedPCDP):
    """FedPDP: FedPCDP with PDP-SGD's local step (clip, noise, then project)."""

    name = "fedpdp"
    Hyperparameters = PublicProjectionHyperparameters
    projection = Projection(PublicEigenspace, after_clipping=True)


FAMILY = ("dp-sgd", "pcdp-sgd", "pdp-sgd", "rpdp-sgd", "rsdp-sgd", "fedpcdp", "fedpdp")

__all__ = ["FAMILY", "PUBLIC_RECORDS", "ROUND_SUBSPACE", "Basis", "Coordinates", "DPSGD",
           "FedPCDP", "PublicEigenspace", "PublicProjectionHyperparameters", "RoundSubspace",
           "top_eigenspace"]
