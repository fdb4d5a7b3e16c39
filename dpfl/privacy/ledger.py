"""The privacy ledger: what was released, and the ε it has cost.

Following ``dp_accounting``'s event view, a ledger never adds ε values by hand. It records each
:class:`~dpfl.privacy.release.Release` as an event (noise multiplier, sample rate, steps) in
Opacus' compact history format and asks an accountant, by its name in
:data:`~dpfl.privacy.accountants.ACCOUNTANTS`, for the ε of the whole history at the run's δ:
Opacus' RDP or PRV accountant (``rdp``, minimised over orders extended past Opacus' defaults
where they help, :mod:`dpfl.privacy.rdp`; ``prv``, :mod:`dpfl.privacy.prv`); ``rdp-wor``, the
RDP bound for fixed-size sampling without replacement under replace-one neighbours (Wang et al.
2019, Theorem 9; :mod:`dpfl.privacy.subsampled_rdp`) that the adaptive-clipping paper accounts
with; or ``rdp-classical``, Opacus' Poisson-subsampled RDP converted the classical way,
ε = min_α RDP(α) + ln(1/δ)/(α − 1) over the integer orders 2–256 (Mironov 2017; TF-Privacy's
``rdp_accountant``), which papers of the TF-Privacy era report (Opacus' own conversion, Balle
et al. 2020, is tighter). Google's ``dp_accounting`` gives a second, independent ε of the same
history (``dp-accounting-pld``, ``dp-accounting-rdp``, ``dp-accounting-rdp-wor``;
:mod:`dpfl.privacy.independent`), reported beside the ledger's own.

The multiplier recorded is std / sensitivity under the release's neighbouring relation. Opacus'
accountants analyse Poisson subsampling with add/remove neighbours; for fixed-size sampling
without replacement and replace-one neighbours the same multiplier describes the worst case of
those neighbours, which some datasets attain (:mod:`dpfl.privacy.independent`), and the ledger
says which relation it holds.

:class:`Accounting` keeps every client's ledger as the server sees it (the public releases of the
rounds each client took part in) and, for an algorithm with server-side noise, the ledger of the
server's own releases: the round loop stops a run on it before a round would exceed
``max-epsilon``. Where the clients' noise is split over an exchange's clients (distributed
noise under secure aggregation, :attr:`~dpfl.privacy.Release.shares`), a client's ledger holds
the guarantee against a server that follows the protocol (the sum's noise), and a second one,
``unmasked``, the guarantee left where the server reads that client's upload alone (its own
share of the noise).
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from dpfl.privacy import independent
from dpfl.privacy import prv, rdp, subsampled_rdp  # noqa: F401  (register their accountants)
from dpfl.privacy.accountants import ACCOUNTANTS, Event
from dpfl.privacy.release import Release, Side

@functools.lru_cache(maxsize=65536)
def _epsilon(accountant: str, history: tuple[Event, ...], delta: float) -> float:
    """ε at ``delta`` of ``history`` by the registered ``accountant`` (ConfigError naming the
    registered ones for another name): 0 without events, inf where a multiplier is ≤ 0."""
    epsilon = ACCOUNTANTS.get(accountant).epsilon
    if not history:
        return 0.0
    if any(z <= 0 for z, _, _ in history):
        return math.inf
    return epsilon(history, delta)


def composed(history: Iterable[Event]) -> tuple[Event, ...]:
    """``history`` with the steps of each (noise multiplier, sample rate) gathered into one
    event, in the order of first appearance (what :func:`_merge` keeps; a history read from
    elsewhere, a node's or an older checkpoint's, may repeat a mechanism). Composition does not
    depend on the order of the mechanisms, so its ε is the same up to rounding (an RDP curve
    times the steps once instead of a sum of them), and each accountant evaluates each
    distinct mechanism once."""
    steps: dict[tuple[float, float], int] = {}
    for z, q, n in history:
        steps[(z, q)] = steps.get((z, q), 0) + n
    return tuple((z, q, n) for (z, q), n in steps.items())


def _merge(history: list[Event], event: Event) -> None:
    """Record ``event`` in ``history`` as :func:`composed` keeps it: its steps added to the
    event of the same mechanism, or appended. Opacus' accountants merge a step into the last
    event only, so releases that alternate (the quantile family's update and count, every
    round) grew a history by two events a round, and the ε of every round with it (RDP: 38 ms
    at round 1,000 and 100 ms at 3,000 where gathered histories take 0.8 and 1.2 ms; PRV:
    502 s at round 200, against 2.5 s)."""
    if event[2] > 0:
        history[:] = composed([*history, event])


@dataclass
class PrivacyLedger:
    """Cumulative privacy spending of one party (a client, or the server's central noise)."""

    accountant: str
    relation: str
    history: list[Event] = field(default_factory=list)

    def record(self, release: Release, *, local: bool = False) -> None:
        """One round of ``release``: its steps at its noise multiplier and sample rate (one
        client's share of it when ``local``: :attr:`~dpfl.privacy.Release.local_event`)."""
        _merge(self.history, release.local_event if local else release.event)

    def epsilon(self, delta: float, accountant: str | None = None) -> float:
        """ε of the history at ``delta`` by the ledger's accountant (or ``accountant``)."""
        return _epsilon(accountant or self.accountant, composed(self.history), delta)

    def epsilon_after(self, releases: Iterable[Release], delta: float) -> float:
        """ε if ``releases`` were made next (nothing is recorded)."""
        history = list(self.history)
        for release in releases:
            _merge(history, release.event)
        return _epsilon(self.accountant, composed(history), delta)

    @property
    def steps(self) -> int:
        return sum(steps for _, _, steps in self.history)

    def to_json(self) -> str:
        return json.dumps({"accountant": self.accountant, "relation": self.relation,
                           "history": self.history})

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        data = json.loads(text)
        return cls(accountant=data["accountant"], relation=data["relation"],
                   history=[tuple(e) for e in data["history"]])

    def state_dict(self) -> list[list[float | int]]:
        """The history as plain lists (a checkpoint's part; :meth:`load_state_dict`)."""
        return [list(e) for e in self.history]

    def load_state_dict(self, history: list[list[float | int]]) -> None:
        self.history = [(float(z), float(q), int(steps)) for z, q, steps in history]


class Accounting:
    """Every client's ledger, and the server's, kept by the server from public information.

    ``releases(client)`` are the client's calibrated releases (one round's); a client is charged
    an exchange's releases when it takes part in it, the server its own releases when it draws
    their noise. ``central`` are the server's releases that cover clients' un-noised
    (central) uploads: a client is charged them too in the exchanges it takes part in, at the
    client level, since they protect its whole upload; ``population`` are central releases
    amplified by client sampling, which protect every client each round whether it takes part
    or not: they are charged once a round to one shared ledger (:meth:`charge_population`) that
    every client's ε composes with its own, and each client's participations are counted
    (``participations``). ``limit`` is ``max-epsilon`` (0: none).
    ``also`` names further accountants whose ε of the same histories is reported beside the
    main one's (a paper's own); :meth:`report_by_accountant` adds the independent ones
    (``independent``: dp_accounting's PLD and RDP, and its sampled-without-replacement RDP
    beside ``rdp-wor``), which are not among ``accountants``, so a run whose only accountant is
    its own reports them in its summary, not in every evaluation round.
    """

    def __init__(self, *, num_clients: int, releases: Callable[[int], list[Release]],
                 accountant: str, relation: str, delta: float, limit: float = 0.0,
                 also: tuple[str, ...] = (), central: tuple[Release, ...] = (),
                 population: tuple[Release, ...] = ()) -> None:
        self.releases = releases
        self.central = central
        self.population = population
        self.shared = PrivacyLedger(accountant, relation)  # the population's releases
        self.participations: Counter[int] = Counter()  # exchanges each client was sent
        self.delta = delta
        self.limit = limit
        self.accountants = (accountant, *(a for a in also if a != accountant))
        self.independent = independent.reported(self.accountants)
        self.num_clients = num_clients
        # the clients' own ledgers, made when first charged: memory follows the clients that
        # took part, not the population
        fresh = functools.partial(PrivacyLedger, accountant, relation)
        self.clients: defaultdict[int, PrivacyLedger] = defaultdict(fresh)
        self.server = PrivacyLedger(accountant, "client-level (server-side noise)")
        self.charged: set[int] = set()  # clients that released something of their own
        # each charged client's own history, and how many hold each: the distinct histories
        # :meth:`extremes` reads each round, kept as clients are charged
        self.keys: dict[int, tuple[Event, ...]] = {}
        self.holders: Counter[tuple[Event, ...]] = Counter()
        self.changed: set[int] = set()  # those charged since :meth:`take_changed`
        # each client's own share of split noise alone (recorded for split releases only)
        self.unmasked: defaultdict[int, PrivacyLedger] = defaultdict(fresh)
        # how many times each client was charged each release, by name (what its node reports)
        self.counts: defaultdict[int, Counter[str]] = defaultdict(Counter)

    def client_releases(self, client: int, exchange: str | None = None) -> list[Release]:
        """The releases a client is charged for when it takes part (its own, and the central
        ones but the population's)."""
        return [r for r in [*self.releases(client), *self.central]
                if (r.side is Side.CLIENT or (r in self.central and r not in self.population))
                and exchange in (None, r.exchange)]

    def ledger(self, client: int) -> PrivacyLedger:
        """``client``'s whole ledger: its own releases and the population's."""
        own = self.clients.get(client)
        if not self.shared.history:
            return own if own is not None else PrivacyLedger(self.shared.accountant,
                                                             self.shared.relation)
        return self.ledger_of(tuple(own.history) if own is not None else ())

    def reported_clients(self) -> list[int]:
        """The clients whose ε is reported by id: those that released something of their
        own (every other client's is :meth:`population_epsilon`)."""
        return sorted(self.charged)

    def population_epsilon(self) -> float | None:
        """ε of every client that released nothing of its own, once a population release was
        charged (all such clients share that history: one number, whatever the population);
        None without a population release, or where every client released something."""
        if not self.shared.history or len(self.charged) >= self.num_clients:
            return None
        return self.ledger_of(()).epsilon(self.delta)

    def extremes(self) -> tuple[float, float]:
        """The largest and smallest client ε (0 before any release): one ε per distinct
        history, whatever the number of clients."""
        values = [self.ledger_of(history).epsilon(self.delta) for history in self.holders]
        if (population := self.population_epsilon()) is not None:
            values.append(population)
        return (max(values), min(values)) if values else (0.0, 0.0)

    def _charged(self, client: int) -> None:
        """``client`` released something of its own: reported, and its history counted."""
        self.charged.add(client)
        self.changed.add(client)
        own = self.clients.get(client)
        history = tuple(own.history) if own is not None else ()
        before = self.keys.get(client)
        if before != history:
            if before is not None:
                self.holders[before] -= 1
                if not self.holders[before]:
                    del self.holders[before]
            self.holders[history] += 1
            self.keys[client] = history

    def _record(self, client: int, release: Release) -> None:
        self.clients[client].record(release)
        if release.shares > 1:
            self.unmasked[client].record(release, local=True)

    def charge(self, clients: Iterable[int], exchange: str) -> None:
        for c in clients:
            self.participations[c] += 1
            for release in self.client_releases(c, exchange):
                self._record(c, release)
                self.counts[c][release.name] += 1
                self._charged(c)

    def reconcile(self, client: int, reported: Mapping[str, int]) -> tuple[bool, dict[str, int]]:
        """Compare the counts of releases ``client``'s node reports charging it (its own
        ledger, by release name) with this ledger's. Releases the node counts beyond this
        ledger happened (an interrupted attempt's after its checkpoint, a round answered twice
        with fresh noise): they are charged here too, and returned. Also returns whether the
        node counts fewer (it lost its ledger)."""
        own = self.counts[client]
        extra = {name: int(n) - own[name] for name, n in reported.items() if int(n) > own[name]}
        releases = {r.name: r for r in self.client_releases(client)}
        for name, times in sorted(extra.items()):
            for _ in range(times):
                self._record(client, releases[name])
            own[name] += times
            self._charged(client)
        return any(int(reported.get(name, 0)) < n for name, n in own.items()), extra

    def charge_population(self, exchange: str) -> None:
        """One run of ``exchange``'s population releases, charged to every client."""
        releases = [r for r in self.population if r.exchange == exchange]
        for release in releases:
            self.shared.record(release)

    def charge_server(self, release: Release) -> None:
        self.server.record(release)

    def epsilon(self, client: int) -> float:
        return self.ledger(client).epsilon(self.delta)

    def refusal(self, server_round: int, participants: Iterable[int],
                exchanges: Iterable[str], *, population: bool = True) -> str | None:
        """Why round ``server_round``, which runs ``exchanges`` (and charges the population
        releases where ``population``), must not run (a participant's ε would pass ``limit``),
        or None."""
        if self.limit <= 0:
            return None
        names = set(exchanges)
        shared = [r for r in self.population if population and r.exchange in names]
        worst = max((self.ledger(c).epsilon_after(
            [r for r in self.client_releases(c) if r.exchange in names] + shared, self.delta)
            for c in participants), default=0.0)
        if shared:  # every client is charged them, the round's participants or not
            worst = max(worst, self.shared.epsilon_after(shared, self.delta))
        if worst > self.limit:
            return f"max-epsilon: round {server_round} would take ε to {worst:.4g} > {self.limit:g}"
        return None

    def take_changed(self) -> list[int]:
        """The clients charged something of their own since the last call (increasing id)."""
        changed, self.changed = sorted(self.changed), set()
        return changed

    def report(self, clients: Iterable[int] | None = None) -> dict[int, float]:
        """ε of every :meth:`reported_clients` client (or of ``clients``, which must be
        among them), by client id (computed once per distinct history)."""
        by_history: dict[tuple[Event, ...], float] = {}
        report = {}
        for c in self.reported_clients() if clients is None else clients:
            own = self.clients.get(c)
            key = tuple(own.history) if own is not None else ()
            if key not in by_history:
                by_history[key] = self.epsilon(c)
            report[c] = by_history[key]
        return report

    def report_unmasked(self) -> dict[int, float] | None:
        """ε of every client that has released something from its own share of split noise
        alone (the server reads its upload unmasked), by client id; None when no noise was
        split."""
        if not any(ledger.history for ledger in self.unmasked.values()):
            return None
        return {c: self.unmasked[c].epsilon(self.delta) for c in sorted(self.charged)}

    def report_by_accountant(self) -> dict[str, float]:
        """The largest client ε by each of ``accountants`` (the main one first), then by each
        ``independent`` one (NaN where one client's is: not computed)."""
        def largest(accountant: str) -> float:
            histories = {tuple(self.clients[c].history) for c in self.charged}
            if self.shared.history and len(self.charged) < self.num_clients:
                histories.add(())  # a client charged the population's releases alone
            values = [self.ledger_of(history).epsilon(self.delta, accountant)
                      for history in histories]
            return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)

        return {a: largest(a) for a in (*self.accountants, *self.independent)}

    def server_epsilon(self) -> float | None:
        return self.server.epsilon(self.delta) if self.server.history else None

    def ledger_of(self, history: tuple[Event, ...]) -> PrivacyLedger:
        """A client ledger holding ``history`` and the population's releases."""
        return PrivacyLedger(self.shared.accountant, self.shared.relation,
                             list(composed([*history, *self.shared.history])))

    def state_dict(self) -> dict[str, object]:
        """Every ledger that holds something and who has released something, as plain dicts
        and lists keyed by client id (a checkpoint's part)."""
        def held(ledgers: Mapping[int, PrivacyLedger]) -> dict[int, list[list[float | int]]]:
            return {c: ledger.state_dict() for c, ledger in sorted(ledgers.items())
                    if ledger.history}

        return {"clients": held(self.clients), "server": self.server.state_dict(),
                "charged": sorted(self.charged),
                "counts": {c: dict(n) for c, n in sorted(self.counts.items()) if n},
                "population": self.shared.state_dict(),
                "participations": dict(self.participations), "unmasked": held(self.unmasked)}

    def load_state_dict(self, saved: dict) -> None:
        """Restore what :meth:`state_dict` gave (or an older dpfl's lists, one entry per
        client)."""
        def by_client(entries: object) -> dict[int, object]:
            return (dict(enumerate(entries)) if isinstance(entries, list)
                    else {int(c): v for c, v in dict(entries).items()})

        self.clients.clear()
        for c, history in by_client(saved["clients"]).items():
            if history:
                self.clients[c].load_state_dict(history)
        self.server.load_state_dict(saved["server"])
        self.shared.load_state_dict(saved.get("population", []))
        self.participations = Counter({int(c): n for c, n in
                                       saved.get("participations", {}).items()})
        changed, self.charged, self.keys, self.holders = set(self.changed), set(), {}, Counter()
        for c in saved["charged"]:
            self._charged(c)
        self.changed = changed  # a checkpoint charges no one
        # a checkpoint of an older dpfl has no counts: a node's report then charges again what
        # this ledger already holds (never fewer releases than happened)
        self.counts.clear()
        for c, counted in by_client(saved.get("counts", {})).items():
            if counted:
                self.counts[c].update(counted)
        self.unmasked.clear()
        for c, history in by_client(saved.get("unmasked", {})).items():
            if history:
                self.unmasked[c].load_state_dict(history)
