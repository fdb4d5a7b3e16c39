"""One exchange for a cohort of clients: the algorithm's client step, then its uploads' noise.

Shared by the Flower client (one node's cohort) and the engine (every participant at once). The
algorithm returns its uploads un-noised; this runtime adds each one's release noise before
anything leaves the cohort: every client its own draw (exact), or, in the engine's fast mode,
one pooled draw for the sum (the uploads reach the model only through the participants' sum and
never feed client state, since the noise is added after the client step). It also checks that
the step drew the in-step noise its releases declare, no more and no less, and that the model
it received and the uploads it returns are finite: inf or NaN stops the run
(:class:`~dpfl.errors.NonFiniteError`) before anything is noised or sent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dpfl.algorithms import Algorithm, ClientContext, Cohort, State
from dpfl.errors import NonFiniteError
from dpfl.privacy import Randomness, Release, add_noise, stds
from dpfl.problem import Problem

LEVERS = " (lower learning-rate or clip, or check the data for inf and NaN)"


class ClientRuntime:
    """Runs exchanges of ``algorithm`` for cohorts of its clients.

    ``releases(client)`` are a client's calibrated releases; ``pooled_noise`` is the engine's
    ``engine-mode="fast"`` (never under Flower); ``diagnostics`` the non-private mode."""

    def __init__(self, algorithm: Algorithm, releases: Callable[[int], list[Release]],
                 rng: Randomness, *, device: torch.device = torch.device("cpu"),
                 pooled_noise: bool = False, diagnostics: bool = False) -> None:
        self.algorithm = algorithm
        self.releases = releases
        self.rng = rng
        self.device = device
        self.pooled_noise = pooled_noise
        self.diagnostics = diagnostics

    @classmethod
    def of(cls, problem: Problem, *, pooled_noise: bool = False,
           secure: bool = False) -> ClientRuntime:
        """The runtime of ``problem``'s clients; ``secure`` draws from the OS CSPRNG even when
        the run config's ``secure-noise`` is off (a node that insists on it)."""
        cfg = problem.config
        return cls(problem.algorithm, problem.releases,
                   Randomness(int(cfg["seed"]), secure=secure or bool(cfg["secure-noise"])),
                   device=problem.device, pooled_noise=pooled_noise,
                   diagnostics=bool(cfg["non-private-diagnostics"]))

    def step(self, exchange: str, round: int, broadcast: State, states: State,
             cohort: Cohort) -> tuple[State, State, dict[str, torch.Tensor]]:
        """Noised uploads ``[C, ...]``, new states ``[C, ...]`` and (non-private mode only)
        diagnostics ``{name: [C]}`` of one exchange for ``cohort``."""
        algorithm = self.algorithm
        for key, value in broadcast.items():
            if not finite(value):
                raise NonFiniteError(f"round {round}, exchange {exchange!r}: the server's "
                                     f"broadcast {key!r} is not finite (inf or NaN): the server "
                                     f"step before it overflowed{LEVERS}")
        releases = [{r.name: r for r in self.releases(c)} for c in cohort.ids]
        ctx = ClientContext(round=round, rng=self.rng, clients=list(cohort.ids),
                            releases=releases, device=self.device,
                            diagnostics={} if self.diagnostics else None)
        messages, states = algorithm.client_step(exchange, states, broadcast, cohort, ctx)
        spec = algorithm.exchange(exchange)
        if set(messages) != set(spec.uploads):
            raise TypeError(f"{algorithm.name}: exchange {exchange!r} returned {sorted(messages)}"
                            f", declared {sorted(spec.uploads)}")
        check_finite(messages, cohort.ids, round, exchange)
        noised = {u.release for u in spec.uploads.values() if not u.sent_as_returned}
        for name, release in releases[0].items():
            wanted = 0 if name in noised else release.steps
            if release.side == "client" and release.exchange == exchange \
                    and ctx.drawn[name] != wanted:
                raise RuntimeError(f"{algorithm.name}: release {name!r} declares {wanted} "
                                   f"in-step draws, the step made {ctx.drawn[name]}")
        uploads = {}
        for key, upload in spec.uploads.items():
            if upload.sent_as_returned:
                uploads[key] = messages[key]
                continue
            own = [rel[upload.release] for rel in releases]
            uploads[key] = add_noise(messages[key], cohort.ids, stds(own), rng=self.rng,
                                     round=round, stream=own[0].stream, pooled=self.pooled_noise)
        return uploads, states, ctx.diagnostics or {}


def finite(values: torch.Tensor) -> bool:
    """Whether every entry of ``values`` is finite, by one sum (inf or NaN in the entries makes
    it inf or NaN; an overflow of finite entries is told apart by the elementwise check, about
    50× slower on large tensors, made only then)."""
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())


def check_finite(messages: State, clients: list[int], round: int, exchange: str) -> None:
    """Raise :class:`NonFiniteError` naming the clients and the upload when an upload of
    ``messages`` (``[C, ...]``, rows in ``clients`` order) holds inf or NaN (:func:`finite`),
    the rows located only on failure."""
    for key, rows in messages.items():
        if not finite(rows):
            bad = (~torch.isfinite(rows.reshape(len(clients), -1))).any(dim=1).nonzero()
            raise NonFiniteError(f"round {round}, exchange {exchange!r}: clients "
                                 f"{[clients[i] for i in bad.flatten().tolist()]} computed an "
                                 f"upload {key!r} that is not finite (inf or NaN); the run "
                                 f"stopped before it was noised or sent{LEVERS}")
