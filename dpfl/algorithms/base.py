"""The algorithm contract: the math of one round, batched over clients.

An algorithm is written once, over flat parameter vectors with a leading client axis, from a
frozen dataclass of its hyperparameters (``Hyperparameters``), and driven unchanged by every
runtime: the round loop over the Flower transport (one client, or a cohort, per ClientApp
call) and over the in-process engine (all clients at once).

* ``exchanges`` declares every exchange: what the server broadcasts and what every client
  uploads (:class:`Exchange`, :class:`Upload`); ``round_exchanges(round)`` those a round runs,
  in order (all of them, every round, by default). This schema is the privacy boundary: a
  client sends exactly its uploads, and each upload names the release that covers it.
* ``queries(num_samples)`` declares the Gaussian mechanisms (:class:`~dpfl.privacy.Query`)
  a client holding ``num_samples`` records runs per round; calibration turns them into releases.
* ``client_step(exchange, states[C], broadcast, cohort, ctx) -> (messages[C], states[C])``
  returns the uploads **un-noised**; the runtime adds each upload's noise afterwards, per client
  (exact) or pooled (the engine's fast mode), so noise added by the runtime never reaches
  client state. Noise that must enter the computation (a noisy momentum, local DP-SGD steps)
  is drawn with ``ctx.privatize``, per client, and the upload built from it is declared
  ``post_processing``.
* ``server_step(exchange, state, sums, ctx) -> state`` sees each upload only as its **sum over
  the participants** (client-id order): a noised upload reaches the model through that sum
  alone, which is what lets the engine pool its noise. ``ctx`` has the round, the participants
  and keyed randomness; ``ctx.privatize`` draws server-side noise of a declared release.

A round is a sequence of exchanges (one ``"train"`` by default; a noisy statistic then
training is two). Client state (momentum, error feedback, previous model) is a dict of tensors
with a leading client axis that persists across rounds (in ``Context.state`` under Flower);
``participants`` supports client sampling; ``Query.steps`` several noisy local steps.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from dpfl.config import Value
from dpfl.models.rows import client_records
from dpfl.privacy import SERVER, Query, Randomness, Relation, Release, Side, add_noise, stds

if TYPE_CHECKING:
    from dpfl.algorithms.subspace import Subspace
    from dpfl.models import FlatModel

State = dict[str, torch.Tensor]
H = TypeVar("H")  # an algorithm's hyperparameters: its frozen dataclass
Batch = tuple[torch.Tensor, torch.Tensor]  # one client's records of a step: x [n, ...], y [n]


@dataclass(frozen=True)
class Upload:
    """One array every client sends in an exchange.

    ``release`` names the query whose release covers it. By default the runtime adds that
    release's noise to the array ``client_step`` returns; ``post_processing=True`` declares the
    array a function of noise already drawn in ``client_step`` (``ctx.privatize``) and of state
    built from such noise only, so it is sent as returned. ``central=True`` (central DP, a
    trusted server) names a server-side query instead: the array leaves the client un-noised
    (clipped) and the server adds that query's noise to the participants' sum in
    ``server_step``; the run then has no guarantee against the server, and the summary says so.
    ``population=True`` (with ``central``) declares that release amplified by the sampling of
    the clients (its sample rate is the clients'): it protects every client, sampled or not, so
    the ledger charges it to the whole population each round the exchange runs, not to the
    participants alone (:meth:`~dpfl.privacy.ledger.Accounting.charge_population`).
    """

    release: str
    post_processing: bool = False
    central: bool = False
    population: bool = False

    @property
    def sent_as_returned(self) -> bool:
        """Whether the client sends it without adding noise (post-processing of in-step noise,
        or a central upload the server noises)."""
        return self.post_processing or self.central


@dataclass(frozen=True)
class Exchange:
    """One message round-trip: the arrays the server ``broadcast``s (in this order) and those
    each client uploads."""

    name: str
    broadcast: tuple[str, ...]
    uploads: Mapping[str, Upload] = field(default_factory=dict)


@dataclass
class Cohort:
    """The local datasets of the clients in one ``client_step`` call.

    ``x``/``y`` hold the union of their data; ``indices[i]`` are client
    ``ids[i]``'s rows. A Flower client holds only its own rows, the engine the
    whole training set; both sample the same rows for the same client.
    """

    ids: list[int]
    x: torch.Tensor
    y: torch.Tensor
    indices: list[torch.Tensor]
    _whole: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False)  # read-only, see sample()

    @property
    def sizes(self) -> list[int]:
        return [len(i) for i in self.indices]

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, positions: Sequence[int]) -> Cohort:
        return Cohort([self.ids[p] for p in positions], self.x, self.y,
                      [self.indices[p] for p in positions])

    def sample(self, rng: Randomness, server_round: int, purpose: str,
               batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A mini-batch of ``batch_size`` rows per client, uniformly without replacement
        from its own data (fresh every call): ``x [C, b, ...]``, ``y [C, b]``.
        A batch of a client's whole data is that data in stored order (no draw: the set is
        certain and a mean does not depend on the order), gathered once per cohort."""
        if all(size == batch_size for size in self.sizes):
            if self._whole is None:
                rows = torch.stack(self.indices)
                self._whole = (self.x[rows], self.y[rows])
            return self._whole
        picks = rng.sample_without_replacement(self.ids, self.sizes, server_round, purpose,
                                               batch_size)
        rows = torch.cat([idx[p] for idx, p in zip(self.indices, picks, strict=True)])
        shape = (len(self), batch_size)
        return (self.x.index_select(0, rows).view(*shape, *self.x.shape[1:]),
                self.y.index_select(0, rows).view(*shape, *self.y.shape[1:]))


    def poisson(self, rng: Randomness, server_round: int, purpose: str,
                rates: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Poisson sampling: each of client ``ids[i]``'s records independently with probability
        ``rates[i]``, in stored order: a ragged batch ``(x [Σ n_i, ...], y [Σ n_i], lengths)``,
        the clients' records one after another (:func:`~dpfl.models.rows.client_records`)."""
        picks = rng.bernoulli_rows(self.ids, self.sizes, server_round, purpose, rates)
        kept = [idx[p] for idx, p in zip(self.indices, picks, strict=True)]
        rows = torch.cat(kept) if kept else torch.empty(0, dtype=torch.long)
        return (self.x.index_select(0, rows), self.y.index_select(0, rows),
                [len(k) for k in kept])

    def draw(self, ctx: ClientContext, purpose: str, release: str, batch_size: int) -> Batches:
        """Every client's mini-batch for one step of ``release`` (stream ``purpose``), sampled
        as the release's neighbouring relation needs. Replace-one: ``batch_size`` records
        without replacement (:meth:`sample`). Add/remove: Poisson sampling, each record with
        the release's own sample rate q (b/n_min with ``min-client-records``, else b/n of the
        client's partition), the sampling Opacus' accountant analyses (Abadi et al., "Deep
        Learning with Differential Privacy", CCS 2016, §3.1; Mironov, Talwar, Zhang,
        arXiv:1908.10530): a fixed-size batch would let an added record push another out,
        moving a clipped mean by 2C/b instead of C/b. q is public, never a function of the
        client's actual record count, which add/remove neighbours differ in."""
        releases = [rel[release] for rel in ctx.releases]
        if releases[0].relation is Relation.ADD_REMOVE:
            rates = [r.sample_rate for r in releases]
            return Batches(batch_size, *self.poisson(ctx.rng, ctx.server_round, purpose, rates))
        return Batches(batch_size, *self.sample(ctx.rng, ctx.server_round, purpose, batch_size))


@dataclass(frozen=True)
class Batches:
    """Every client's mini-batch of one step (:meth:`Cohort.draw`): fixed-size, ``x [C, b,
    ...]``, ``y [C, b]``, or Poisson, ragged: ``lengths[i]`` records of client i, packed one
    client after another (:func:`~dpfl.models.rows.client_records`). ``batch_size`` b divides
    every batch mean: under Poisson sampling the expected size, a public number, not the
    batch's own (Abadi et al. 2016, §3.1)."""

    batch_size: int
    x: torch.Tensor
    y: torch.Tensor
    lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self.y) if self.lengths is None else len(self.lengths)

    def __iter__(self) -> Iterator[Batch]:
        """Each client's batch, in cohort order."""
        return client_records(self.x, self.y, self.lengths)

    def means(self, fn: Callable[..., tuple[torch.Tensor, ...]], *points: torch.Tensor | None,
              empty: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
        """Each client's ``(1/b) Σ_{j∈B_i}`` over its batch B_i, and per-client values, from one
        call ``fn(x, y, *points, lengths=, divisor=b)`` that returns ``(sum/b [C, ...],
        *values [C, ...])`` over each client's records (the batches as they are: ``lengths``
        None for fixed-size ones; :meth:`~dpfl.models.FlatModel.clipped_mean`'s ragged
        batches); ``points`` are given as they are (``[d]``, None, or every client's rows).
        Where no client has a record, every client gets ``empty`` (one client's values:
        zeros)."""
        if not self.y.numel():
            return tuple(e.to(device).expand(len(self), *e.shape).clone() for e in empty)
        return fn(self.x.to(device), self.y.to(device), *points, lengths=self.lengths,
                  divisor=self.batch_size)


@dataclass
class ClientContext:
    """What a client step needs besides state and data: the round, keyed randomness, the
    cohort's releases (``releases[i]``: client ``clients[i]``'s, by query name), the device,
    and whether non-private diagnostics are collected."""

    server_round: int
    rng: Randomness
    clients: list[int]
    releases: list[dict[str, Release]]
    device: torch.device
    diagnostics: dict[str, torch.Tensor] | None = None  # None: not collected
    drawn: Counter = field(default_factory=Counter)

    def privatize(self, name: str, values: torch.Tensor, *, radius: float | None = None,
                  step: int | None = None) -> torch.Tensor:
        """``values [C, ...]`` plus the noise of release ``name``, each client's own draw
        (stream ``<stream>`` or ``<stream>-<step>`` for a query of several steps). For noise
        that enters the computation; ``radius`` for a query whose radius changes per round."""
        releases = [rel[name] for rel in self.releases]
        stream = releases[0].stream if step is None else f"{releases[0].stream}-{step}"
        self.drawn[name] += 1
        return add_noise(values, self.clients, stds(releases, radius).to(values.device),
                         rng=self.rng, server_round=self.server_round, stream=stream)

    @property
    def diagnosing(self) -> bool:
        return self.diagnostics is not None

    def diagnose(self, name: str, values: torch.Tensor) -> None:
        """Record a per-client diagnostic ``[C]`` (sent only under non-private-diagnostics)."""
        if self.diagnostics is not None:
            self.diagnostics[name] = values.detach().double().cpu()


@dataclass
class ServerContext:
    """What a server step needs besides state and the uploads' sums: the round, the
    participants (increasing id), the number of clients, the server's keyed randomness and its
    own releases (server-side noise, charged to the server's ledger by ``charge``); the run's
    rounds and every client's releases (public: calibrated from the clients' data sizes), for
    a server step that debiases a noisy statistic."""

    server_round: int
    rng: Randomness
    participants: list[int]
    num_clients: int
    releases: dict[str, Release] = field(default_factory=dict)
    charge: Callable[[Release], None] = lambda release: None
    num_rounds: int = 0
    client_releases: Callable[[int], list[Release]] = lambda client: []

    def client_release(self, client: int, name: str) -> Release:
        """Client ``client``'s release ``name``."""
        return next(r for r in self.client_releases(client) if r.name == name)

    def privatize(self, name: str, values: torch.Tensor, *,
                  radius: float | None = None) -> torch.Tensor:
        """``values`` plus the server-side noise of release ``name`` (:meth:`noise`),
        published (:meth:`publish`)."""
        return self.publish(name, values + self.noise(name, values, radius=radius),
                            radius=radius)

    def noise(self, name: str, like: torch.Tensor, *,
              radius: float | None = None) -> torch.Tensor:
        """A draw of release ``name``'s server-side noise shaped as ``like`` (stream
        ``(seed, server, round, <stream>)``), nothing charged: for noise an algorithm
        correlates across rounds before it publishes (:mod:`dpfl.privacy.tree`)."""
        release = self.releases[name]
        return add_noise(torch.zeros_like(like).unsqueeze(0), [SERVER], stds([release], radius),
                         rng=self.rng, server_round=self.server_round, stream=release.stream)[0]

    def publish(self, name: str, value: torch.Tensor, *, radius: float | None = None,
                charge: bool = True) -> torch.Tensor:
        """``value``, release ``name``'s noisy output of this round, charged to the server's
        ledger (``charge`` false: a round of a mechanism charged once for several rounds, as a
        tree is at its first round); ``radius`` as the round's, where it changes."""
        if charge:
            self.charge(self.releases[name])
        return value


class Algorithm(ABC, Generic[H]):
    """Base class of every algorithm, generic in its hyperparameters ``H`` (the dataclass
    ``Hyperparameters`` names); subclasses register in ``ALGORITHMS``."""

    name: ClassVar[str]
    Hyperparameters: ClassVar[type]
    exchanges: ClassVar[tuple[Exchange, ...]]
    protection: ClassVar[str]
    noise_free: ClassVar[bool] = False  # an ablation without noise (ε = ∞): no calibration keys
    # neighbours zero one client's contribution out rather than remove the client: its schedule
    # of participants is public and fixed (DP-FTRL's epochs); the audit's worlds follow it
    zero_out: ClassVar[bool] = False
    # its values of the per-algorithm keys left at "auto" (learning rate, clip, …): chosen by
    # the search in docs/defaults.md; a key it does not name takes the key's own default
    defaults: ClassVar[Mapping[str, Value]] = {}
    # runs batched as one client step (dpfl.engine.many): whether client_step also takes each
    # broadcast array with a leading client axis (a point per client, as FlatModel's methods
    # do), and the run-config keys only the server reads (batched runs may differ in them)
    per_client_broadcast: ClassVar[bool] = False
    server_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, hp: H, model: FlatModel, num_clients: int, *,
                 public: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.hp = hp
        self.model = model
        self.num_clients = num_clients
        self.public = public  # the dataset's public records (x, y), if it has any

    @property
    def relation(self) -> Relation:
        """The neighbouring relation its releases are private under (replace-one by default)."""
        return Relation.REPLACE_ONE

    @property
    def reported_accountants(self) -> tuple[str, ...]:
        """Accountants whose ε the ledger reports beside the run's own (the paper's among
        them); none by default."""
        return ()

    def calibrated_for(self, rounds: int) -> None:
        """Told, before the first round, the rounds the run's noise is calibrated for
        (``calibration-rounds``, else ``num-server-rounds``); nothing by default (DP-FTRL
        optimises its BLT noise for them)."""

    def check_run(self, num_rounds: int) -> None:
        """Raise :class:`~dpfl.errors.ConfigError` where a run of ``num_rounds`` rounds cannot
        be served (e.g. public records it needs are missing); nothing by default."""

    def exchange(self, name: str) -> Exchange:
        return next(e for e in self.exchanges if e.name == name)

    def round_exchanges(self, server_round: int) -> tuple[Exchange, ...]:
        """The exchanges round ``server_round`` runs, in order (every declared one by default; an
        algorithm whose first round differs, e.g. an initialisation, overrides this). A release
        is charged in the rounds whose exchanges carry it."""
        return self.exchanges

    # ---- privacy -------------------------------------------------------------------------
    @abstractmethod
    def queries(self, num_samples: int) -> list[Query]:
        """The Gaussian mechanisms of one round for a client holding ``num_samples`` records."""

    def noise_multipliers(self, queries: list[Query], multiplier: float) -> list[float]:
        """The noise multiplier (std / sensitivity) of each of ``queries`` when the run sets
        ``noise-multiplier`` (std / radius, Opacus' convention) directly: the same std over
        radius for every query by default."""
        return [q.multiplier_of(multiplier) for q in queries]

    @classmethod
    def central_releases(cls) -> dict[str, str]:
        """The server-side releases that cover central uploads, by exchange."""
        return {u.release: e.name for e in cls.exchanges for u in e.uploads.values()
                if u.central}

    def population_releases(self) -> dict[str, str]:
        """The central releases charged to every client each round (amplified by client
        sampling; :attr:`Upload.population`), by exchange."""
        return {u.release: e.name for e in self.exchanges for u in e.uploads.values()
                if u.central and u.population}

    def population_round(self, server_round: int) -> bool:
        """Whether ``server_round`` charges the population releases (:meth:`population_releases`):
        every round, unless one release is amplified over a period of rounds, each client having
        one chance a period (DP-FTRL's banded noise over Poisson-sampled groups)."""
        return True

    def zero_sums(self, exchange: str) -> State:
        """The sums of ``exchange`` over no client: what the server steps on in a round whose
        client sampling drew no one (Poisson sampling; a fixed-size draw is never empty)."""
        raise NotImplementedError(f"{self.name} draws at least one client a round")

    @classmethod
    def participants_per_round(cls, hp: H, num_clients: int) -> int:
        """How many clients :meth:`participants` takes a round (every client by default)."""
        return num_clients

    @classmethod
    def secure_aggregation_refusal(cls, hp: H) -> str | None:
        """Why the server cannot see only the sum of each exchange's uploads under secure
        aggregation (run-config ``secure-aggregation``, and ``distributed-noise``, which splits
        the clients' noise under it), or None where it can.

        Secure aggregation sums integers: each upload is quantised on a grid whose range comes
        from its release (the radius that bounds the un-noised upload, plus the tail of its
        noise), so every upload must be noised by the runtime with a fixed radius. That is
        also what splitting the noise needs: where the runtime noises every upload after the
        client step, a client's noise never enters its state or its later steps, and each
        round's sum is a function of the data and the broadcast (public) plus the clients'
        independent draws, a Gaussian mechanism of the release's sensitivity whose noise is the
        sum of the shares, composed adaptively over rounds. Noise drawn inside the step
        (``post_processing`` uploads) feeds what the client computes next (its later local
        steps, its momentum or control variate), which the server never sees, so a record
        moves the sum through that hidden state by more than the release's sensitivity and the
        summed noise alone does not cover it; central uploads are noised by the server."""
        if cls.noise_free:
            return "it adds no noise"
        uploads = [u for e in cls.exchanges for u in e.uploads.values()]
        if any(u.central for u in uploads):
            return ("its noise is the server's (central DP): its clients' uploads carry none to "
                    "split and no bound to quantise them by")
        if any(u.post_processing for u in uploads):
            return ("its uploads are built from noise drawn inside the client step, which "
                    "feeds the client's later steps or state: no radius bounds them for the "
                    "secure sum's grid, and a sum's noise would not cover what the server "
                    "does not see")
        return None

    def noise_matrix(self, rounds: int) -> torch.Tensor | None:
        """M ``[rounds, rounds]``, round t's server-side noise being Σ_s M[t, s]·ξ_s over the
        rounds' independent draws ξ_s, where the algorithm correlates its noise across rounds
        (what the audit whitens by); None where each round's noise is its own draw."""
        return None

    def server_queries(self) -> list[Query]:
        """The Gaussian mechanisms the server runs itself each round (``side="server"``:
        central noise, drawn in ``server_step`` with ``ctx.privatize``); none by default."""
        return []

    # ---- server --------------------------------------------------------------------------
    def init_server_state(self, x0: torch.Tensor) -> State:
        return {"x": x0.clone()}

    def participants(self, server_round: int, clients: list[int], rng: Randomness) -> list[int]:
        """The clients taking part in ``server_round`` (all of them by default)."""
        return list(clients)

    def begin_round(self, state: State, ctx: ServerContext) -> State:
        """Server state at the start of round ``ctx.round``, before its first broadcast (work
        the server does from public data alone, e.g. a public subspace); unchanged by
        default."""
        return state

    def broadcast(self, exchange: str, state: State, server_round: int) -> State:
        return {"x": state["x"]}

    @abstractmethod
    def server_step(self, exchange: str, state: State, sums: State,
                    ctx: ServerContext) -> State:
        """New server state from the sums of the participants' uploads."""

    def global_params(self, state: State) -> torch.Tensor:
        return state["x"]

    def upload_space(self, broadcast: State, device: torch.device) -> Subspace | None:
        """The subspace whose coordinates a client's uploads are written in, from the
        exchange's broadcast (FedPCDP's k-entry uploads); None: the model's own coordinates."""
        return None

    def clip_radius(self, state: State) -> float | None:
        """The round's clip radius, for the results (the fixed ``clip``, if the algorithm has
        one)."""
        return getattr(self.hp, "clip", None)

    # ---- client --------------------------------------------------------------------------
    def init_client_state(self, num_clients: int) -> State:
        return {}

    @abstractmethod
    def client_step(self, exchange: str, states: State, broadcast: State, cohort: Cohort,
                    ctx: ClientContext) -> tuple[State, State]:
        """Un-noised uploads ``[C, ...]`` and new client states ``[C, ...]``."""


def sample_size(fraction: float, num_clients: int) -> int:
    """s = round(fraction·n), at least 1: how many clients :func:`sample_clients` takes."""
    return max(1, math.floor(fraction * num_clients + 0.5))


def sample_clients(fraction: float, server_round: int, clients: list[int],
                   rng: Randomness) -> list[int]:
    """s = round(fraction·n) of ``clients`` (at least 1), uniformly without replacement from the
    server's stream of ``server_round``, sorted; all of them when s = n."""
    s = sample_size(fraction, len(clients))
    if s >= len(clients):
        return list(clients)
    order = rng.permutation(SERVER, server_round, "participants", len(clients))
    return sorted(clients[i] for i in order[:s].tolist())


def check_schema(algorithm: Algorithm, queries: list[Query]) -> None:
    """Raise ``TypeError`` where the declarations of ``algorithm`` do not fit together (client
    ``queries`` of one client, ``server_queries``): every upload is covered by a client-side
    query of its exchange; one the runtime noises has one step and a fixed radius; no two
    client queries share a name, and no two of one exchange a noise stream (queries of
    exchanges that run in the same round must not share one either: the round loop checks
    that for the rounds it runs)."""
    if any(q.side is not Side.CLIENT for q in queries) or any(
            q.side is not Side.SERVER for q in algorithm.server_queries()):
        raise TypeError(f"{algorithm.name}: queries() are client-side, server_queries() "
                        f"server-side")
    names = [q.name for q in queries]
    if len(set(names)) < len(names) or not distinct_streams(queries):
        raise TypeError(f"{algorithm.name}: queries must have distinct names, and the queries "
                        f"of one exchange distinct streams")
    by_name = {q.name: q for q in queries}
    central = {q.name: q for q in algorithm.server_queries()}
    for exchange in algorithm.exchanges:
        for key, upload in exchange.uploads.items():
            query = (central if upload.central else by_name).get(upload.release)
            if query is None or query.exchange != exchange.name:
                side = "server-side" if upload.central else "client-side"
                raise TypeError(f"{algorithm.name}: upload {key!r} of exchange "
                                f"{exchange.name!r} is covered by no {side} query of it")
            if upload.central:
                continue
            if not upload.post_processing and (query.steps != 1 or query.radius is None):
                raise TypeError(f"{algorithm.name}: upload {key!r} is noised by the runtime, "
                                f"so its query needs one step and a fixed radius")


def distinct_streams(queries: Sequence[Query], exchanges: Sequence[str] | None = None) -> bool:
    """Whether the queries of each exchange (of ``exchanges`` together, when given: those one
    round runs) draw from distinct noise streams."""
    groups: dict[Any, list[str]] = {}
    for q in queries:
        if exchanges is None or q.exchange in exchanges:
            groups.setdefault(None if exchanges is not None else q.exchange, []).append(q.stream)
    return all(len(set(streams)) == len(streams) for streams in groups.values())
