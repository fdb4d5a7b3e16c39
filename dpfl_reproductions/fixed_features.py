"""A batched simulator of AdaptDP-FedAvg and DP-FedAvg on models linear in fixed features.

The adaptive-clipping paper's tasks train a linear model on fixed features: T1 a linear
regression (squared loss) on its inputs, T2–T4 a softmax head on the outputs of a frozen random
layer. Per-sample gradients of such a model are outer products G_j ⊗ φ_j (G_j the loss's
gradient in the outputs, φ_j the features, with a constant 1 for a bias), so their norms are
‖G_j‖·‖φ_j‖ and a clipped mean is one product of the batch with per-sample coefficients: no
per-sample gradient is formed. :class:`FeatureSweep` runs many configurations of one federation
(same data, split, model, batch sizes, rounds and seed; they may differ in method, noise, η and
clip) in lock step, in float64:

* the randomness is the engine's: each client's batches from ``(seed, client, round,
  "batch-k")`` and ``"statistic"``, its noise from ``"noise-k"`` and ``"statistic-noise"``,
  drawn once (float32 standard normals, as the engine draws them) and scaled per configuration;
  so a configuration follows the ``dpfl run`` of its run config to float32 rounding;
* the features are computed once per federation by the model's own frozen layers (float32, as
  the engine's forward pass), the initial point is the engine's, the releases, ν̃ and C_r come
  from the library's own calibration and server step (C_r rounded to float32, as the engine
  broadcasts it).

Evaluation (every ``eval-every`` rounds and the last) is the full training loss and the test
accuracy of the global model, as ``eval-train`` reports them; a summary carries what
:func:`dpfl_reproductions.adaptive.derive` reads of a run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import Tensor, nn

from dpfl.algorithms import ServerContext
from dpfl.algorithms.adaptive import AdaptDPFedAvg
from dpfl.privacy import PrivacyLedger, Randomness, stds
from dpfl.problem import Problem, build_problem
from dpfl.runconfig import RunConfig

#: keys a batch's configurations may vary; every other key is the federation's
VARYING = ("algorithm", "learning-rate", "clip", "noise-size", "statistic-noise-size",
           "calibration", "epsilon", "noise-multiplier", "tau", "debias",
           "failure-probability", "run-name", "results-dir")
SIMULATED = ("adaptdp-fedavg", "dp-fedavg")


def federation(config: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """What configurations must share to run in one batch: every key but :data:`VARYING`."""
    return tuple(sorted((k, v) for k, v in config.items() if k not in VARYING))


def features_of(module: nn.Module, x: Tensor) -> tuple[Tensor, bool]:
    """``(φ [n, F], bias)``: the inputs of the model's trainable linear head (float32, by the
    model's own frozen layers) and whether the head has a bias (φ then ends with a 1)."""
    layers = list(module.children()) if isinstance(module, nn.Sequential) else [module]
    head = layers[-1]
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not isinstance(head, nn.Linear) or sum(p.numel() for p in trainable) != sum(
            p.numel() for p in head.parameters()):
        raise ValueError("the simulator needs a model whose only trainable layer is its last, "
                         "a Linear head")
    with torch.no_grad():
        phi = nn.Sequential(*layers[:-1])(x) if len(layers) > 1 else x.flatten(1)
    bias = head.bias is not None
    phi = phi.double()
    if bias:
        phi = torch.cat([phi, phi.new_ones(len(phi), 1)], dim=1)
    return phi, bias


class FeatureSweep:
    """Configurations of one federation, run in lock step (see the module docstring)."""

    def __init__(self, config: RunConfig) -> None:
        self.base = config
        self.problem = build_problem(config)
        p = self.problem
        model = p.model.load_into(p.x0).cpu()
        self.task = p.dataset.task
        self.classes = p.dataset.num_classes if self.task == "classification" else 1
        self.train_phi, self.bias = features_of(model, p.dataset.train_x)
        self.test_phi, _ = features_of(model, p.dataset.test_x)
        self.train_y, self.test_y = p.dataset.train_y, p.dataset.test_y
        self.norms = torch.linalg.vector_norm(self.train_phi, dim=1)
        self.theta0 = self.unflatten(p.x0.double())

    # ---- layout --------------------------------------------------------------------------
    def unflatten(self, flat: Tensor) -> Tensor:
        """The flat parameter vector (``[..., d]``: the head's weight row-major, then its bias)
        as ``[..., classes, F]``."""
        c = self.classes
        weight = flat[..., : flat.shape[-1] - (c if self.bias else 0)]
        theta = weight.reshape(*flat.shape[:-1], c, -1)
        if self.bias:
            theta = torch.cat([theta, flat[..., -c:].unsqueeze(-1)], dim=-1)
        return theta

    def flatten(self, theta: Tensor) -> Tensor:
        if not self.bias:
            return theta.reshape(*theta.shape[:-2], -1)
        return torch.cat([theta[..., :-1].reshape(*theta.shape[:-2], -1), theta[..., -1]], dim=-1)

    # ---- the loss ------------------------------------------------------------------------
    def output_grad(self, outputs: Tensor, y: Tensor) -> Tensor:
        """∂ℓ/∂outputs ``[..., n, classes]`` (softmax − one-hot; residual for squared)."""
        if self.task != "classification":
            return outputs - y.double().unsqueeze(-1)
        grad = torch.softmax(outputs, dim=-1)
        return grad - nn.functional.one_hot(y.long(), self.classes).double()

    def loss(self, theta: Tensor, phi: Tensor, y: Tensor) -> tuple[Tensor, Tensor | None]:
        """Mean loss ``[S]`` and accuracy (classification) of parameters ``[S, classes, F]``."""
        out = torch.einsum("nf,scf->snc", phi, theta)
        if self.task != "classification":
            return 0.5 * (out[..., 0] - y.double()).square().mean(dim=1), None
        logp = torch.log_softmax(out, dim=-1)
        loss = -logp.gather(-1, y.long().view(1, -1, 1).expand(len(theta), -1, 1)).mean(dim=(1, 2))
        return loss, (out.argmax(dim=-1) == y.view(1, -1)).double().mean(dim=1)

    def clipped_mean(self, theta: Tensor, rows: Tensor, radius: Tensor) -> tuple[Tensor, Tensor]:
        """Each configuration's and client's mean of per-sample gradients clipped at ``radius``
        ``[S]`` over the batch ``rows [P, b]`` from ``theta [S, P, classes, F]``; and the
        per-sample norms ``[S, P, b]``."""
        phi = self.train_phi[rows]  # [P, b, F]
        grad = self.output_grad(torch.einsum("pbf,spcf->spbc", phi, theta), self.train_y[rows])
        norms = torch.linalg.vector_norm(grad, dim=-1) * self.norms[rows]
        r = radius.view(-1, 1, 1)
        factor = torch.where(norms > r, r / norms.clamp_min(1e-300), torch.ones_like(norms))
        mean = torch.einsum("spbc,pbf->spcf", grad * factor.unsqueeze(-1), phi) / rows.shape[1]
        return mean, norms

    # ---- the run -------------------------------------------------------------------------
    def problem_of(self, config: RunConfig) -> Problem:
        for key in config:
            if key not in VARYING and config[key] != self.base[key]:
                raise ValueError(f"{key!r} differs from the sweep's federation: "
                                 f"{config[key]!r} vs {self.base[key]!r}")
        if str(config["algorithm"]) not in SIMULATED:
            raise ValueError(f"the simulator runs {SIMULATED}, not {config['algorithm']!r}")
        from dpfl.algorithms import ALGORITHMS

        algorithm = ALGORITHMS.get(str(config["algorithm"]))(
            config.hyperparameters, self.problem.model, num_clients=self.problem.num_clients)
        return dataclasses.replace(self.problem, config=config, algorithm=algorithm,
                                   _releases={}, _server_releases=None, _cohorts={})

    def run(self, configs: list[RunConfig]) -> list[dict[str, Any]]:
        base = self.base
        problems = [self.problem_of(c) for c in configs]
        algorithms = [p.algorithm for p in problems]
        n_clients = self.problem.num_clients
        clients = list(range(n_clients))
        rounds, every = int(base["num-server-rounds"]), int(base["eval-every"])
        hp0 = algorithms[0].hp
        b, k_steps = hp0.batch_size, hp0.local_steps
        rng = Randomness(int(base["seed"]))
        cohort = self.problem.full_cohort()
        sizes, indices = cohort.sizes, cohort.indices
        s = len(configs)
        lr = torch.tensor([a.hp.learning_rate for a in algorithms], dtype=torch.float64)
        adaptive = [isinstance(a, AdaptDPFedAvg) for a in algorithms]
        def own(problem: Problem, name: str) -> list[Any] | None:  # every client's release
            found = [next((r for r in problem.releases(c) if r.name == name), None)
                     for c in clients]
            return None if found[0] is None else found

        train = [own(p, "train") for p in problems]
        statistic = [own(p, "statistic") for p in problems]
        radius = torch.tensor([a.hp.clip for a in algorithms], dtype=torch.float32).double()
        x = self.theta0.expand(s, *self.theta0.shape).clone()  # [S, classes, F]
        records: list[list[dict[str, Any]]] = [[] for _ in configs]
        started = time.perf_counter()
        for server_round in range(1, rounds + 1):
            if any(adaptive):
                radius = self.radii(server_round, x, problems, statistic, adaptive, radius, rng,
                                    clients, sizes, indices)
            local = x.unsqueeze(1).expand(s, n_clients, *x.shape[1:]).clone()
            std = torch.stack([stds(t, float(r) / b).double()
                               for t, r in zip(train, radius.tolist(), strict=True)])  # [S, P]
            for k in range(k_steps):
                picks = rng.sample_without_replacement(clients, sizes, server_round,
                                                       f"batch-{k}", b)
                rows = torch.stack([idx[p] for idx, p in zip(indices, picks, strict=True)])
                grad, _ = self.clipped_mean(local, rows, radius.clamp_min(1e-300))
                grad = torch.where(radius.view(-1, 1, 1, 1) > 0, grad, torch.zeros_like(grad))
                if bool((std > 0).any()):
                    z = rng.normal(clients, server_round, f"noise-{k}", (self.problem.model.d,),
                                   torch.ones(n_clients)).double()
                    grad = grad + std.view(s, n_clients, 1, 1) * self.unflatten(z).unsqueeze(0)
                local = local - lr.view(-1, 1, 1, 1) * grad
            x = local.mean(dim=1)
            if server_round % every == 0 or server_round == rounds:
                train_loss, _ = self.loss(x, self.train_phi, self.train_y)
                test_loss, accuracy = self.loss(x, self.test_phi, self.test_y)
                for i in range(s):
                    records[i].append({
                        "round": server_round, "train_loss_full": float(train_loss[i]),
                        "test_loss": float(test_loss[i]),
                        "test_accuracy": None if accuracy is None else float(accuracy[i]),
                        "clip": float(radius[i])})
        wall = time.perf_counter() - started
        return [self.summary(p, rec, wall / s) for p, rec in zip(problems, records, strict=True)]

    def radii(self, server_round: int, x: Tensor, problems: list[Problem], statistic: list[Any],
              adaptive: list[bool], radius: Tensor, rng: Randomness, clients: list[int],
              sizes: list[int], indices: list[Tensor]) -> Tensor:
        """C_r of the adaptive configurations (Algorithm 1 line 9, by the algorithm's own
        server step on the noisy statistics), float32 as broadcast; the others' unchanged."""
        index = [i for i, a in enumerate(adaptive) if a]
        hp = problems[index[0]].algorithm.hp
        bc = hp.statistic_batch
        if bc >= min(sizes):
            rows = torch.stack(indices)
        else:
            picks = rng.sample_without_replacement(clients, sizes, server_round, "statistic", bc)
            rows = torch.stack([idx[p] for idx, p in zip(indices, picks, strict=True)])
        theta = x[index].unsqueeze(1).expand(len(index), len(clients), *x.shape[1:])
        clip = torch.tensor([problems[i].algorithm.hp.clip for i in index],
                            dtype=torch.float32).double()
        _, norms = self.clipped_mean(theta, rows, clip)
        means = norms.square().minimum(clip.view(-1, 1, 1).square()).mean(dim=2)  # [A, P]
        z = rng.normal(clients, server_round, "statistic-noise", (1,), torch.ones(len(clients)))
        out = radius.clone()
        for j, i in enumerate(index):
            std = stds(statistic[i]).double()
            sums = (means[j].float() + (std * z[:, 0].double()).float()).sum()
            problem = problems[i]
            ctx = ServerContext(server_round, rng, clients, len(clients),
                                num_rounds=int(problem.config["num-server-rounds"]),
                                client_releases=problem.releases)
            state = problem.algorithm.server_step(
                "statistic", {"x": problem.x0, "radius": torch.zeros(1)},
                {"s": sums.reshape(1)}, ctx)
            out[i] = float(state["radius"][0])
        return out

    @staticmethod
    def summary(problem: Problem, rounds: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
        """A run's summary as the engine archives it, with the ε of its releases by the run's
        accountant and the paper's."""
        cfg = problem.config
        ledgers = []
        for client in range(problem.num_clients):  # the clients' sizes may differ by one
            ledger = PrivacyLedger(str(cfg["accountant"]), problem.algorithm.relation)
            for _ in range(int(cfg["num-server-rounds"])):
                for release in problem.releases(client):
                    ledger.record(release)
            ledgers.append(ledger)
        delta = float(cfg["delta"])
        by = {a: max(ledger.epsilon(delta, a) for ledger in ledgers)
              for a in (str(cfg["accountant"]), "rdp-wor")}
        for record in rounds:
            record["epsilon_by_accountant"] = by
        last = rounds[-1]
        return {"rounds_completed": last["round"], "stopped_early": None,
                "test_loss": last["test_loss"], "test_accuracy": last["test_accuracy"],
                "epsilon_max": by[str(cfg["accountant"])], "wall_seconds": seconds,
                "seconds_per_round": None, "simulated": True, "rounds": rounds}


_SWEEPS: dict[tuple[tuple[str, Any], ...], FeatureSweep] = {}


def simulate(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``configs`` (one :func:`federation`) as one batch; per configuration, the summary a
    ``dpfl run`` would archive, with ``rounds`` (its evaluated rounds)."""
    key = federation(configs[0])
    if key not in _SWEEPS:
        _SWEEPS.clear()
        _SWEEPS[key] = FeatureSweep(RunConfig(configs[0]))
    return _SWEEPS[key].run([RunConfig(c) for c in configs])
