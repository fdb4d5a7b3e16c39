"""MOON: model-contrastive federated learning around record-level local DP-SGD.

Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021 (arXiv:2103.16257), run as the
PCDP-SGD paper's extreme non-IID comparison does (its Fig. 4; Sha et al., arXiv:2312.03792 v1):
every client takes K local DP-SGD steps (:mod:`~dpfl.algorithms.local_dpsgd`) on MOON's local
loss (the paper's eq. 3 with the contrastive loss of its eq. 2) of each record j::

    ℓ_j(w) = ℓ(f(x_j; w), y_j) + μ·ℓ_con,j(w)
    ℓ_con,j(w) = −log(e^{s_g/τ} / (e^{s_g/τ} + e^{s_p/τ})),
    s_g = sim(z_j, z_j^glob),  s_p = sim(z_j, z_j^prev)

with sim the cosine similarity, z_j the representation of x_j under the local model w (the
input of the model's last ``Linear`` layer: :func:`representation_layer`), z_j^glob under the
round's global model w_g and z_j^prev under the client's previous local model w_i^prev (the
model it ended its last round with; w_g the first time it takes part). The per-sample gradients
of ℓ_j are clipped by the ``clipping-function`` at C and noised as DP-SGD's::

    g̃_k = (1/b) (Σ_j clip_C(∇ℓ_j(w_k)) + N(0, σ²C² I)),   w_{k+1} = w_k − η g̃_k

and the server steps as FedAvg, w_g ← w_g + γ_g·(mean_i w_i − w_g)
(:class:`~dpfl.algorithms.local_dpsgd.FederatedDPSGD`). At μ = 0 a step is DP-FedAvg's, bit for
bit (the per-sample engine's own step).

Per-sample gradients. dpfl's per-sample engine (:mod:`dpfl.models.tape`) differentiates losses
of the logits only; the contrastive term also reads the representation, so its gradients come
from ``torch.func`` (``vmap(grad(ℓ_j))`` over the module called at the flat point,
``functional_call``), client by client, in chunks of at most the model's ``chunk_size`` samples
(fewer where ``chunk-bytes`` says so). A record whose gradient is not finite contributes zero
and is counted, as the engine drops it (:mod:`dpfl.models.functional`, "Non-finite values").

Privacy: DP-FedAvg's. Record j enters a step only through ∇ℓ_j, its own loss: the contrastive
term compares j's representation under w_k with j's representations under w_g (the broadcast,
public) and under w_i^prev (the client's own earlier local model, a function of its earlier
noisy steps: post-processing), both fixed within the step and neither depending on the step's
batch. So replacing (adding, removing) record j changes one term of the sum, each term clipped
to norm ≤ C: the sum's sensitivity, the noise σC and the ledger are DP-SGD's at C; the
uploaded local model and the kept w_i^prev are post-processing of the noisy steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from dpfl.algorithms.base import ClientContext, Cohort, State
from dpfl.algorithms.local_dpsgd import FederatedDPSGD, FederatedHyperparameters, NoisyStep
from dpfl.algorithms.registry import ALGORITHMS
from dpfl.config import Param, at_least, hyperparameter, positive
from dpfl.errors import ConfigError
from dpfl.models.rows import client_records, non_finite_rows, record_means
from dpfl.privacy.clipping import ClippingFunction, l2_norms

if TYPE_CHECKING:
    from dpfl.models import FlatModel

MOON_MU = Param("moon-mu", 1.0, "MOON: the weight μ of the model-contrastive loss in each "
                "record's local loss ℓ + μ·ℓ_con (the PCDP paper's comparison: 1); 0 = "
                "DP-FedAvg.", check=at_least(0.0), symbol="μ")
MOON_TEMPERATURE = Param("moon-temperature", 0.5, "MOON: the temperature τ of the "
                         "model-contrastive loss, the cosine similarities divided by it (the "
                         "PCDP paper's comparison: 0.5).", check=positive, symbol="τ")

#: what a model whose representation is not its last ``Linear`` layer's input is told
QUALIFYING = ("a model whose output is its last Linear layer's output (the representation is "
              "that layer's input): every model of dpfl.models.zoo (logistic, least-squares, "
              "mlp, clip21-cnn, dpftrl-cnn, pcdp-cnn, pcdp-lenet, random-feature-mlp, "
              "resnet20), or one that names its representation's module "
              "(representation_source())")


@dataclass(frozen=True)
class MOONHyperparameters(FederatedHyperparameters):
    moon_mu: float = hyperparameter(MOON_MU)  # μ
    moon_temperature: float = hyperparameter(MOON_TEMPERATURE)  # τ


def representation_layer(module: nn.Module) -> tuple[nn.Linear | None, bool]:
    """The ``Linear`` layer whose input is ``module``'s representation, its last in
    ``modules()`` order, and whether the module named it: a module with a
    ``representation_source()`` (a wrapper, such as the audit's canary model) has its
    representation in the module that returns; else None."""
    declared = getattr(module, "representation_source", None)
    if callable(declared):
        return representation_layer(declared())[0], True
    layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return (layers[-1] if layers else None), False


def contrastive_loss(z: Tensor, z_global: Tensor, z_previous: Tensor, temperature: float
                     ) -> Tensor:
    """MOON's eq. 2 for one record: −log(e^{s_g/τ}/(e^{s_g/τ} + e^{s_p/τ})) = logsumexp(s_g/τ,
    s_p/τ) − s_g/τ, with s the cosine similarity of ``z`` to ``z_global``, ``z_previous``."""
    sims = torch.stack([F.cosine_similarity(z, z_global, dim=-1),
                        F.cosine_similarity(z, z_previous, dim=-1)]) / temperature
    return torch.logsumexp(sims, dim=0) - sims[0]


class ModelContrastive:
    """Per-sample gradients of MOON's local loss (module docstring) at flat points of
    ``model``, by ``torch.func`` on a private copy of its module, and their clipped means."""

    def __init__(self, model: FlatModel, mu: float, temperature: float) -> None:
        self.model = model
        self.mu = float(mu)
        self.temperature = float(temperature)
        self.module = copy.deepcopy(model.flat.module)
        layer, self.checked = representation_layer(self.module)
        if layer is None:
            raise ConfigError("model", f"moon needs {QUALIFYING}; this model has no Linear "
                              f"layer")
        self.names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        self.seen: dict[str, Tensor] = {}
        layer.register_forward_hook(self.capture)

    def capture(self, layer: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        self.seen["z"], self.seen["out"] = inputs[0], output

    def forward(self, params: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
        """The module's output on ``x [n, ...]`` at ``params`` and the representations
        ``[n, features]``."""
        out = functional_call(self.module, params, (x,))
        z, layer_out = self.seen.pop("z"), self.seen.pop("out")
        if not self.checked:  # once: the layer's output must be the model's
            if layer_out is not out:
                raise ConfigError("model", f"moon needs {QUALIFYING}; this model's output is "
                                  f"not its last Linear layer's")
            self.checked = True
        return out, z.reshape(len(z), -1)

    def named(self, point: Tensor) -> dict[str, Tensor]:
        return dict(zip(self.names, self.model.flat.params(point), strict=True))

    def representations(self, point: Tensor, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self.forward(self.named(point), x)[1]

    def sample_loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor,
                    z_global: Tensor | None = None, z_previous: Tensor | None = None) -> Tensor:
        """ℓ_j of one record ``x`` (no batch axis), the contrastive term where μ > 0."""
        out, z = self.forward(params, x.unsqueeze(0))
        loss = self.model.loss.per_sample(out, y.unsqueeze(0))[0]
        if self.mu:
            loss = loss + self.mu * contrastive_loss(z[0], z_global, z_previous,
                                                     self.temperature)
        return loss

    def per_sample_gradients(self, point: Tensor, x: Tensor, y: Tensor, global_point: Tensor,
                             previous: Tensor) -> Tensor:
        """``[n, d]``: ∇ℓ_j at ``point`` ``[d]`` for the records ``x [n, ...]``, ``y [n]``
        (one chunk), with the representations under ``global_point`` and ``previous``
        (the nonconvex regulariser's gradient added, as the engine's per-sample loss has it);
        rows as computed (a row may be inf or NaN)."""
        params = {k: v.detach() for k, v in self.named(point).items()}
        if self.mu:
            inputs = (x, y, self.representations(global_point, x),
                      self.representations(previous, x))
        else:
            inputs = (x, y)
        grads = vmap(grad(self.sample_loss), in_dims=(None,) + (0,) * len(inputs))(params,
                                                                                  *inputs)
        rows = torch.cat([grads[n].reshape(len(x), -1) for n in self.names], dim=1)
        if self.model.nonconvex_reg:
            rows = rows + self.model.flat.reg_grad(point)
        return rows

    def clipped_sum(self, point: Tensor, x: Tensor, y: Tensor, global_point: Tensor,
                    previous: Tensor, radius: float, clipping: ClippingFunction
                    ) -> tuple[Tensor, Tensor]:
        """One client's ``[d]`` Σ_j φ_C(∇ℓ_j) over its records and their ``[n]`` norms (0 for
        a record dropped for a non-finite gradient), in fixed chunks."""
        size = self.chunk_length(point, x, y)
        total = point.new_zeros(self.model.d)
        norms = []
        for start in range(0, len(x), size):
            rows = self.per_sample_gradients(point, x[start:start + size], y[start:start + size],
                                             global_point, previous)
            if (bad := non_finite_rows(rows)) is not None:
                self.model.dropped.drop(bad, rows)
            chunk = l2_norms(rows)
            total += clipping.factors(chunk, radius).to(rows.dtype) @ rows
            norms.append(chunk)
        return total, torch.cat(norms) if norms else point.new_zeros(0)

    def chunk_length(self, point: Tensor, x: Tensor, y: Tensor) -> int:
        """At most the model's ``chunk_size`` samples, fewer where ``chunk-bytes`` holds fewer
        whole rows (:meth:`~dpfl.models.FlatModel.chunk_length`); the model and input shape
        decide it, never the data or the cohort."""
        return min(self.model.chunk_size,
                   self.model.chunk_length(point, x[None], y[None], rows=True))

    def clipped_means(self, params: Tensor, global_point: Tensor, previous: Tensor, x: Tensor,
                      y: Tensor, radius: float, clipping: ClippingFunction, *,
                      lengths: list[int] | None, divisor: int) -> tuple[Tensor, Tensor]:
        """``[C, d]`` (1/b) Σ_j φ_C(∇ℓ_j) over each client's records (``x [C, b, ...]``, or
        packed with ``lengths``: :class:`~dpfl.algorithms.base.Batches`) at its point
        (``params [C, d]``) and previous model (``previous [C, d]``), and the fraction of each
        batch clipped, client by client."""
        means, fractions = [], []
        for c, (xb, yb) in enumerate(client_records(x, y, lengths)):
            total, norms = self.clipped_sum(params[c], xb, yb, global_point, previous[c], radius,
                                            clipping)
            means.append(total / divisor)
            fractions.append((norms > radius).float())
        width = max(len(f) for f in fractions)
        clipped = torch.stack([F.pad(f, (0, width - len(f))) for f in fractions])
        return torch.stack(means), record_means(clipped, lengths)


@ALGORITHMS.register_class
class MOON(FederatedDPSGD[MOONHyperparameters]):
    """MOON (model-contrastive local loss) with K local DP-SGD steps; see the module
    docstring.

    Parameters (beyond DP-FedAvg's)
    -------------------------------
    moon-mu : float, default 1.0
        μ, the weight of the contrastive loss; 0 = DP-FedAvg.
    moon-temperature : float, default 0.5
        τ, the contrastive loss's temperature.
    """

    name = "moon"
    Hyperparameters = MOONHyperparameters
    protection = ("record-level local DP per client: K local DP-SGD steps per round, noised on "
                  "the client; each record's contrastive term reads only the broadcast model "
                  "and the client's previous local model (post-processing)")

    def __init__(self, hp: MOONHyperparameters, model: FlatModel, num_clients: int, *,
                 public: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__(hp, model, num_clients, public=public)
        self.contrastive = ModelContrastive(model, hp.moon_mu, hp.moon_temperature)

    def init_client_state(self, num_clients: int) -> State:
        """Each client's previous local model w_i^prev, and whether it has one yet."""
        return {"previous": torch.zeros(num_clients, self.model.d),
                "joined": torch.zeros(num_clients)}

    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        """K local steps on MOON's noisy gradient; the local model is uploaded and kept as the
        client's w_i^prev (w_g where it had none)."""
        x = broadcast["x"].to(ctx.device)
        joined = states["joined"].to(ctx.device).bool().unsqueeze(1)
        previous = torch.where(joined, states["previous"].to(ctx.device).to(x.dtype), x)
        gradient = self.contrastive_gradient(x, previous, cohort,
                                             float(broadcast["radius"][0]), ctx)
        params, _ = self.local_steps(x, cohort, {}, broadcast, ctx, gradient=gradient)
        kept = params.cpu()
        return {"x": kept}, {"previous": kept, "joined": torch.ones(len(cohort))}

    def contrastive_gradient(self, x: Tensor, previous: Tensor, cohort: Cohort, radius: float,
                             ctx: ClientContext) -> NoisyStep:
        """The round's local step: ``(params, k)`` to (1/b)(Σ_j φ_C(∇ℓ_j) + N(0, σ²C²I))
        and the fraction clipped; at μ = 0 DP-FedAvg's step (the per-sample engine)."""
        hp = self.hp
        if not hp.moon_mu:  # DP-FedAvg's step
            return self.step_gradient(x, cohort, radius, {}, ctx)
        means: Callable[..., tuple[Tensor, Tensor]] = self.contrastive.clipped_means

        def gradient(params: Tensor, k: int) -> tuple[Tensor, Tensor]:
            batches = self.local.batches(cohort, k, ctx)
            if radius > 0:
                g, clipped = batches.means(
                    lambda xb, yb, p, prev, **kw: means(p, x, prev, xb, yb, radius,
                                                        hp.per_sample_clipping, **kw),
                    params, previous, empty=(params.new_zeros(self.model.d),
                                             params.new_zeros(())), device=ctx.device)
            else:  # nothing to add, and the noise std is 0 too
                g, clipped = torch.zeros_like(params), params.new_zeros(len(params))
            return ctx.privatize("train", g, radius=radius / hp.batch_size, step=k), clipped
        return gradient


__all__ = ["MOON", "MOONHyperparameters", "ModelContrastive", "contrastive_loss",
           "representation_layer"]
