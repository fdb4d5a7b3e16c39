"""One exchange for a cohort of clients: the algorithm's client step, then its uploads' noise.

Shared by the Flower client (one node's cohort) and the engine (every participant at once). The
algorithm returns its uploads un-noised; this runtime adds each one's release noise before
anything leaves the cohort: every client its own draw (exact), or, in the engine's fast mode,
one pooled draw for the sum (the uploads reach the model only through the participants' sum and
never feed client state, since the noise is added after the client step). It also checks that
the step drew the in-step noise its releases declare, no more and no less, and that the model
it received is finite: inf or NaN there, which the server controls, stops the run
(:class:`~dpfl.errors.NonFiniteError`). A non-finite value of a client's own is handled on the
node and never raises (an error would reach the server, a fact about the data outside any
release): its model drops records whose gradient is not finite, and an upload row that is still
not finite is sent as zeros (noised as usual); both are logged on the node only
(docs/privacy.md, "Non-finite values").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dpfl.algorithms import Algorithm, ClientContext, Cohort, State
from dpfl.errors import NonFiniteError
from dpfl.models.rows import non_finite_rows, zero_rows
from dpfl.privacy import Randomness, Release, Side, add_noise, stds
from dpfl.problem import Problem

LEVERS = " (lower learning-rate or clip, or check the data for inf and NaN)"
log = logging.getLogger("dpfl")


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
           rng: Randomness | None = None) -> ClientRuntime:
        """The runtime of ``problem``'s clients, drawing from ``rng`` (a node's, by its policy:
        :mod:`dpfl.client.policy`), by default from the run config's seed, or from the OS
        CSPRNG under its ``secure-noise``."""
        cfg = problem.config
        return cls(problem.algorithm, problem.releases,
                   rng or Randomness(cfg.run.seed, secure=cfg.privacy.secure_noise),
                   device=problem.device, pooled_noise=pooled_noise,
                   diagnostics=cfg.evaluation.non_private_diagnostics)

    def step(self, exchange: str, server_round: int, broadcast: State, states: State,
             cohort: Cohort) -> tuple[State, State, dict[str, torch.Tensor]]:
        """Noised uploads ``[C, ...]``, new states ``[C, ...]`` and (non-private mode only)
        diagnostics ``{name: [C]}`` of one exchange for ``cohort``."""
        algorithm = self.algorithm
        for key, value in broadcast.items():
            if not finite(value):
                raise NonFiniteError(f"round {server_round}, exchange {exchange!r}: the server's "
                                     f"broadcast {key!r} is not finite (inf or NaN): the server "
                                     f"step before it overflowed{LEVERS}")
        algorithm.model.take_dropped()  # drops counted outside a step are not this step's
        releases = [{r.name: r for r in self.releases(c)} for c in cohort.ids]
        ctx = ClientContext(server_round=server_round, rng=self.rng, clients=list(cohort.ids),
                            releases=releases, device=self.device,
                            diagnostics={} if self.diagnostics else None)
        messages, states = algorithm.client_step(exchange, states, broadcast, cohort, ctx)
        spec = algorithm.exchange(exchange)
        if set(messages) != set(spec.uploads):
            raise TypeError(f"{algorithm.name}: exchange {exchange!r} returned {sorted(messages)}"
                            f", declared {sorted(spec.uploads)}")
        messages = zero_non_finite(messages, cohort.ids, server_round, exchange,
                                   dropped=algorithm.model.take_dropped())
        noised = {u.release for u in spec.uploads.values() if not u.sent_as_returned}
        for name, release in releases[0].items():
            wanted = 0 if name in noised else release.steps
            if release.side is Side.CLIENT and release.exchange == exchange \
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
                                     server_round=server_round, stream=own[0].stream,
                                     pooled=self.pooled_noise)
        return uploads, states, ctx.diagnostics or {}


def finite(values: torch.Tensor) -> bool:
    """Whether every entry of ``values`` is finite, by one sum (:func:`non_finite_rows`)."""
    return non_finite_rows(values.reshape(1, -1)) is None


def zero_non_finite(messages: State, clients: list[int], server_round: int, exchange: str, *,
                    dropped: int) -> State:
    """``messages`` (``[C, ...]``, rows in ``clients`` order) with each upload row that holds
    inf or NaN replaced by zeros, out of place (an upload may be the client's state; one sum
    per upload when all are finite), and one line on the node's log when a row was zeroed or
    the model dropped records (``dropped``, :meth:`~dpfl.models.FlatModel.take_dropped`).

    Privacy: the event stays on the node (logger ``dpfl``; never in a reply or the results).
    A dropped record contributes zero, no more than a clipped one. A row still not finite is
    covered by its release all the same: a message clipped as a whole may be anything in the
    ball of its radius, zero included, and a mean of clipped per-sample gradients is finite
    once the model drops its records, so it can only overflow through values built from
    noise already drawn or from the broadcast, and zeroing it is post-processing
    (docs/privacy.md, "Non-finite values")."""
    out, zeroed = dict(messages), []
    for key, rows in messages.items():
        if (bad := non_finite_rows(rows)) is not None:
            out[key] = zero_rows(rows, bad)
            zeroed.append(f"upload {key!r} of clients "
                          f"{[clients[i] for i in bad.nonzero().flatten().tolist()]} was not "
                          f"finite and is sent as zeros")
    if dropped or zeroed:
        done = [f"clients {clients} dropped {dropped} record(s) whose gradient or loss was not "
                f"finite (they contribute zero)"] if dropped else []
        log.warning("round %d, exchange %r: %s; logged on this node only%s", server_round, exchange,
                    "; ".join(done + zeroed), LEVERS)
    return out
