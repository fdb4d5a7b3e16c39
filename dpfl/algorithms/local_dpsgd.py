"""Local DP-SGD: the K local steps a client takes each round, the building block that
DP-FedAvg, AdaptDP-FedAvg, DP-SCAFFOLD and the projection family compose.

Each sampled client starts from the global model x and takes K steps, every client of the cohort
at once (``params [C, d]``). Step k draws a fresh batch and takes DP-SGD's noisy gradient
(Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep Learning with Differential
Privacy", CCS 2016, Algorithm 1) at the client's current iterate x_k::

    g̃_k = (1/b) (Σ_j clip_C(∇ℓ_j(x_k) + μ(x_k − x)) + N(0, σ²C² I))
    x_{k+1} = x_k − η g̃_k

with FedProx's proximal term μ (Li et al., MLSys 2020; 0 = FedAvg) and, with ``momentum`` β_m,
PyTorch's heavy-ball form m ← β_m m + g̃_k, x_{k+1} = x_k − η m, the buffer m kept in client
state across rounds. :func:`local_sgd` is the loop (also the plain local SGD of quantile
DP-FedAvg, whose noise is the server's); :class:`LocalDPSGD` the noisy gradient of one step;
:class:`FederatedDPSGD` the algorithm around them (the ``train`` exchange: broadcast x and the
radius, K local steps, the server averages), which the algorithms above extend.

Batches are b records without replacement (replace-one neighbours), or with
``sampling="poisson"`` each record with probability b/n, the sum divided by b (add/remove
neighbours; :meth:`~dpfl.algorithms.base.Cohort.draw`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
from torch import Tensor

from dpfl.algorithms.base import (
    Algorithm,
    Batches,
    ClientContext,
    Cohort,
    Exchange,
    ServerContext,
    State,
    Upload,
    sample_clients,
    sample_size,
)
from dpfl.config import (
    BATCH_SIZE,
    CLIP,
    CLIPPING_FUNCTION,
    CLIPPING_STABILITY,
    FRACTION_TRAIN,
    LEARNING_RATE,
    Param,
    all_of,
    at_least,
    at_most,
    hyperparameter,
    positive,
)
from dpfl.models.rows import aligned, aligned_rows, record_means
from dpfl.privacy import Query, Randomness, Relation
from dpfl.privacy.clipping import PerSampleClipping

if TYPE_CHECKING:
    from dpfl.models import FlatModel

# beyond it a round never ends, and the ledgers' accountants stall on the compositions
MAX_LOCAL_STEPS = 1_000_000
LOCAL_STEPS = Param("local-steps", 1, "Local DP-SGD steps per round, each on a fresh batch.",
                    check=all_of(at_least(1), at_most(MAX_LOCAL_STEPS)), symbol="K")
SAMPLING = Param("sampling", "fixed", "How each local step draws its batch: 'fixed' (b records "
                 "uniformly without replacement; replace-one neighbours) or 'poisson' (each record "
                 "with probability b/n, n = min-client-records where set, else the client's "
                 "partition size, the sum divided by the expected b; add/remove neighbours, "
                 "Opacus' analysis).", choices=("fixed", "poisson"))
SERVER_LEARNING_RATE = Param("server-learning-rate", 1.0, "Global step size: the server moves "
                             "by this times the mean update, x ← x − γ_g·mean_i(x − x_i); 1 = "
                             "the average of the local models.", check=positive, symbol="γ_g")
PROXIMAL_MU = Param("proximal-mu", 0.0, "FedProx's proximal weight: each per-sample gradient "
                    "gets μ(x_k − x) added before clipping (the local loss plus (μ/2)‖x_k − x‖², "
                    "Li et al. 2020); 0 = FedAvg.", check=at_least(0.0), symbol="μ")
MOMENTUM = Param("momentum", 0.0, "Heavy-ball momentum of the local SGD on the noisy gradient, "
                 "PyTorch's form m ← βm + g̃, w ← w − γm, the buffer kept in client state "
                 "across rounds; 0 = the paper's plain SGD (Alg. 1; the first author's public "
                 "code defaults to 0.9).", check=lambda v: None if 0 <= v < 1
                 else f"must be in [0, 1), got {v}", symbol="β_m")


def milestones_problem(text: str) -> str | None:
    try:
        parse_milestones(text)
    except ValueError:
        return f"expected increasing positive round numbers separated by commas, got {text!r}"
    return None


def parse_milestones(text: str) -> tuple[int, ...]:
    rounds = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    if any(r < 1 for r in rounds) or list(rounds) != sorted(set(rounds)):
        raise ValueError(text)
    return rounds


LR_MILESTONES = Param("lr-milestones", "", "Rounds after which the learning rate is divided by "
                      "10 again, e.g. '40,60' (the first author's public code: half and three "
                      "quarters of the epochs); empty = a constant learning rate.",
                      check=milestones_problem)


@dataclass(frozen=True)
class LocalDPSGDHyperparameters(PerSampleClipping):
    """What K local DP-SGD steps read. The constants are those of AdaptDP-FedAvg (and of
    DP-FedAvg's defaults): fixed-size batches, every client, the server averages."""

    batch_size: int = hyperparameter(BATCH_SIZE)  # b
    learning_rate: float = hyperparameter(LEARNING_RATE)  # η (γ_l)
    clip: float = hyperparameter(CLIP)  # C (DP-FedAvg), Ĝ (AdaptDP-FedAvg)
    clipping_function: str = hyperparameter(CLIPPING_FUNCTION)  # φ
    clipping_stability: float = hyperparameter(CLIPPING_STABILITY)  # r
    local_steps: int = hyperparameter(LOCAL_STEPS)  # K
    sampling: ClassVar[str] = "fixed"
    fraction_train: ClassVar[float] = 1.0
    server_learning_rate: ClassVar[float] = 1.0
    proximal_mu: ClassVar[float] = 0.0
    momentum: ClassVar[float] = 0.0
    lr_milestones: ClassVar[str] = ""

    def learning_rate_at(self, server_round: int) -> float:
        """η divided by 10 for each of ``lr-milestones`` before ``server_round``."""
        passed = sum(m < server_round for m in parse_milestones(self.lr_milestones))
        return self.learning_rate / 10 ** passed


@dataclass(frozen=True)
class FederatedHyperparameters(LocalDPSGDHyperparameters):
    """Local DP-SGD inside a federation that samples batches and clients and has a server
    step size."""

    sampling: str = hyperparameter(SAMPLING)
    fraction_train: float = hyperparameter(FRACTION_TRAIN)  # S/N
    server_learning_rate: float = hyperparameter(SERVER_LEARNING_RATE)  # γ_g


#: a local step's gradient: ``step(params [C, d], k)`` for every client of the cohort
Step = Callable[[Tensor, int], Tensor]
#: a round's noisy step gradient: ``(params [C, d], k)`` to the gradient and the fraction clipped
NoisyStep = Callable[[Tensor, int], tuple[Tensor, Tensor]]


def local_sgd(x: Tensor, clients: int, steps: int, step: Step, learning_rate: float, *,
              correction: Tensor | None = None, momentum: float = 0.0,
              velocity: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``steps`` steps of SGD from ``x`` for ``clients`` clients at once: step k moves each
    client's iterate by −η times the gradient ``step(params, k)`` plus ``correction``
    (SCAFFOLD's c − c_i), through the heavy-ball buffers ``velocity`` [C, d] where given
    (m ← β_m m + g, x ← x − ηm). Returns the final iterates ``[C, d]`` and buffers.

    The iterates live on 64-byte aligned rows (:func:`~dpfl.models.rows.aligned_rows`), so the
    per-sample engine takes each client's point where it is instead of copying it to aligned
    memory every step (the same values: ``x − η·g`` written elsewhere). At the first step every
    client's row is one aligned copy of x (a read-only view repeated ``clients`` times), which
    the per-sample engine sees as one point (:meth:`~dpfl.models.tape.TapeEngine.groups`)."""
    params = aligned(x).expand(clients, -1)
    for k in range(steps):
        g = step(params, k)
        if correction is not None:
            g = g + correction
        if velocity is not None:
            velocity = momentum * velocity + g
            g = velocity
        params = torch.sub(params, g, alpha=learning_rate,  # x − η·g in one pass
                           out=aligned_rows(x, clients, x.numel()))
    return params, velocity


def plain_local_sgd(model: FlatModel, x: Tensor, cohort: Cohort, ctx: ClientContext, *,
                    steps: int, batch_size: int, learning_rate: float) -> Tensor:
    """``[C, d]``: every client's iterate after ``steps`` steps of plain SGD from ``x`` (no
    per-sample clipping, no local noise: the client-level algorithms clip the whole update),
    step k on a fresh batch of ``batch_size`` records from stream ``batch-<k>``."""
    def gradient(params: Tensor, k: int) -> Tensor:
        xb, yb = cohort.sample(ctx.rng, ctx.server_round, f"batch-{k}", batch_size)
        return model.batch_gradients(params, xb.to(ctx.device), yb.to(ctx.device))

    return local_sgd(x, len(cohort), steps, gradient, learning_rate)[0]


class LocalDPSGD:
    """DP-SGD's noisy gradient of one local step, for every client of a cohort (the module
    docstring's g̃_k), and the batches it is taken on."""

    def __init__(self, model: FlatModel, hp: LocalDPSGDHyperparameters) -> None:
        self.model = model
        self.hp = hp

    def batches(self, cohort: Cohort, k: int, ctx: ClientContext) -> Batches:
        """Each client's batch of local step ``k``, from stream ``batch-<k>``: b records
        without replacement, or (``sampling="poisson"``, add/remove) each record with the
        release's probability b/n (:meth:`Cohort.draw`)."""
        return cohort.draw(ctx, f"batch-{k}", "train", self.hp.batch_size)

    def noisy_gradient(self, params: Tensor, x: Tensor, batches: Batches, radius: float,
                       k: int, ctx: ClientContext, *, offset: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
        """``[C, d]``: (1/b) Σ_j clip_C(∇ℓ_j(x_k) + μ(x_k − x)) plus the release's noise
        (std σ·C/b), and the fraction of the batch clipped ``[C]``; clip_C is the
        ``clipping-function``'s φ_C (flat: min(1, C/‖·‖)·). C = 0 takes no step. ``offset``
        (``[C, d]``), where given, is the gradient of another regulariser of the local loss
        in place of FedProx's μ(x_k − x), added to each per-sample gradient before clipping
        (FedLRS's BLUR)."""
        hp = self.hp
        clipped = torch.zeros(len(params), device=ctx.device)
        if radius > 0:
            if offset is None and hp.proximal_mu:
                offset = hp.proximal_mu * (params - x)
            g, clipped = self.clipped_means(params, batches, radius, ctx, offset=offset)
        else:  # nothing to add, and the noise std is 0 too
            g = torch.zeros_like(params)
        return ctx.privatize("train", g, radius=radius / hp.batch_size, step=k), clipped

    def clipped_means(self, params: Tensor, batches: Batches, radius: float,
                      ctx: ClientContext, *, offset: Tensor | None = None
                      ) -> tuple[Tensor, Tensor]:
        """``[C, d]`` (1/b) Σ_j clip_C(∇ℓ_j + offset) over each client's batch (b = batch-size,
        the expected size under Poisson sampling: :meth:`Batches.means`), and the fraction of
        each batch whose norm is above C (0 for an empty one)."""
        clipping = self.hp.per_sample_clipping

        def clipped(xb: Tensor, yb: Tensor, params: Tensor, offset: Tensor | None, *,
                    lengths: list[int] | None, divisor: int) -> tuple[Tensor, Tensor]:
            mean, norms = self.model.clipped_mean(params, xb, yb, radius, offset=offset,
                                                  lengths=lengths, divisor=divisor,
                                                  clipping=clipping)
            return mean, record_means((norms > radius).float(), lengths)

        mean, clipped_fraction = batches.means(
            clipped, params, offset, empty=(params.new_zeros(self.model.d), params.new_zeros(())),
            device=ctx.device)
        return mean, clipped_fraction


H = TypeVar("H", bound=LocalDPSGDHyperparameters)


class FederatedDPSGD(Algorithm[H]):
    """The ``train`` exchange of K local DP-SGD steps: the server broadcasts x and the radius,
    each sampled client runs :func:`local_sgd` on :class:`LocalDPSGD`'s noisy gradient and
    sends its local model, the server moves to their (unweighted) mean at step size γ_g.
    Neighbours are replace-one for fixed-size batches, add/remove for Poisson sampling. The
    algorithms built on it add exchanges (AdaptDP-FedAvg), state (DP-SCAFFOLD) or a projection
    of each step (the projection family)."""

    exchanges = (Exchange("train", ("x", "radius"), {"x": Upload("train", post_processing=True)}),)

    def __init__(self, hp: H, model: FlatModel, num_clients: int, *,
                 public: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__(hp, model, num_clients, public=public)
        self.local = LocalDPSGD(model, hp)

    @property
    def relation(self) -> Relation:
        return Relation.ADD_REMOVE if self.hp.sampling == "poisson" else Relation.REPLACE_ONE

    @property
    def reported_accountants(self) -> tuple[str, ...]:
        """The adaptive-clipping paper's ``rdp-wor`` for fixed-size sampling; under Poisson
        sampling the classical RDP conversion (the PCDP paper's) and PRV."""
        return ("rdp-classical", "prv") if self.hp.sampling == "poisson" else ("rdp-wor",)

    def batch_of(self, release: str) -> int:
        """The records per client behind one step of ``release``."""
        return self.hp.batch_size

    def queries(self, num_samples: int) -> list[Query]:
        """K training steps a round (radius C/b, sent by the server each round; rate b/n)."""
        hp = self.hp
        return [Query("train", "train", radius=None, relation=self.relation,
                      sample_rate=hp.batch_size / num_samples, steps=hp.local_steps)]

    # ---- server --------------------------------------------------------------------------
    def init_server_state(self, x0: Tensor) -> State:
        return {"x": x0.clone(), "radius": torch.tensor([self.hp.clip], dtype=torch.float32)}

    @classmethod
    def participants_per_round(cls, hp: H, num_clients: int) -> int:
        return sample_size(hp.fraction_train, num_clients)

    def participants(self, server_round: int, clients: list[int], rng: Randomness) -> list[int]:
        return sample_clients(self.hp.fraction_train, server_round, clients, rng)

    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        return {"x": state["x"], "radius": state["radius"]}

    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        return {"x": self.average(state, sums, ctx), "radius": state["radius"]}

    def average(self, state: State, sums: State, ctx: ServerContext) -> Tensor:
        """x moved by γ_g towards the mean of the local models (the mean itself at γ_g = 1)."""
        return torch.lerp(state["x"], sums["x"] / len(ctx.participants),
                          self.hp.server_learning_rate)

    def clip_radius(self, state: State) -> float:
        return float(state["radius"][0])

    # ---- client --------------------------------------------------------------------------
    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        x = broadcast["x"].to(ctx.device)
        params, states = self.local_steps(x, cohort, states, broadcast, ctx)
        return {"x": params.cpu()}, states

    def init_client_state(self, num_clients: int) -> State:
        """The momentum buffers, when there is momentum."""
        return {"momentum": torch.zeros(num_clients, self.model.d)} if self.hp.momentum else {}

    def local_steps(self, x: Tensor, cohort: Cohort, states: State, broadcast: State,
                    ctx: ClientContext, *, correction: Tensor | None = None,
                    gradient: NoisyStep | None = None) -> tuple[Tensor, State]:
        """K local steps from ``x`` for every client at the broadcast radius on
        ``gradient`` (default :meth:`step_gradient`; :func:`local_sgd` at the round's learning
        rate), the momentum buffers read from and kept in client state; diagnoses the fraction
        clipped."""
        hp = self.hp
        clipped = torch.zeros(len(cohort), device=ctx.device)
        if gradient is None:
            gradient = self.step_gradient(x, cohort, float(broadcast["radius"][0]), broadcast,
                                          ctx)

        def step(params: Tensor, k: int) -> Tensor:
            g, fraction = gradient(params, k)
            clipped.add_(fraction)
            return g

        velocity = states["momentum"].to(ctx.device) if hp.momentum else None
        params, velocity = local_sgd(x, len(cohort), hp.local_steps, step,
                                     hp.learning_rate_at(ctx.server_round),
                                     correction=correction, momentum=hp.momentum,
                                     velocity=velocity)
        ctx.diagnose("clipped-fraction", clipped / hp.local_steps)
        return params, ({"momentum": velocity.cpu()} if velocity is not None else states)

    def step_gradient(self, x: Tensor, cohort: Cohort, radius: float, broadcast: State,
                      ctx: ClientContext) -> NoisyStep:
        """The round's local step: ``(params, k)`` to the noisy gradient and the fraction
        clipped (DP-SGD's; the projection family's projects it)."""
        return lambda params, k: self.local.noisy_gradient(
            params, x, self.local.batches(cohort, k, ctx), radius, k, ctx)


__all__ = ["FederatedDPSGD", "FederatedHyperparameters", "LocalDPSGD",
           "LocalDPSGDHyperparameters", "local_sgd", "plain_local_sgd"]
