"""A client's privacy spending as its own node keeps it, and the node's replay guard.

A node charges its clients for every release before the reply that carries it leaves, in a
ledger that nothing the server sends can roll back:

* **events**: each mechanism (relation, noise multiplier, sample rate) once, with its steps;
  the ε of the whole history at the node's δ, by the node's accountant, is what the node's cap
  (:class:`~dpfl.client.policy.NodePolicy` ``max-epsilon``) is checked against. Releases under
  both relations compose as replace-one ones (an add/remove release of multiplier z, Poisson
  sampled or not sampled, is a replace-one release of multiplier z/2);
* **runs**: per run (named by its lineage, which a resumed run keeps), how many times each
  release was charged, as of a round (the rounds a resume may repeat are kept one by one). This
  is what a reply tells the server (:mod:`dpfl.client.app`): counts of the exchanges the server
  itself sent, up to the exchange's round, nothing derived from the data or its size. The server
  charges what a node reports beyond its own ledger (a round an interrupted attempt released
  with secure noise, and its resumed run again);
* **answered**: the replay guard. With seeded or keyed noise a repeated request draws the same
  noise, so answering it with other inputs would release the difference of two values exactly.
  Per noise context (:func:`stream_context`) the guard keeps the digest of the inputs each
  (round, exchange) was answered with (:func:`input_digest`): the same inputs give the same
  reply bit for bit (a resumed run repeats the rounds after its checkpoint), other inputs are
  refused, and so is a round older than the guard's window (the rounds a resume may repeat,
  from the run's ``checkpoint-every``). Secure noise needs no guard: every answer is a fresh
  release, and charged.

A real node keeps every client's ledger in a file of its state folder, across every run it
serves (``<state-dir>/ledger/client-<id>.json``, locked while a message is answered, written
atomically); a node that trusts its server keeps the run's ledger in the run's
``Context.state``, and in ``<state-dir>/<run>/ledger/`` when the run checkpoints (so that a
resumed run sees the interrupted attempt's releases).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, RecordDict

from dpfl.atomic import write_atomically
from dpfl.privacy import PrivacyLedger, Relation, Release
from dpfl.version import __version__

log = logging.getLogger("dpfl")

#: run-config keys that do not change what a client computes in a round (where results go,
#: how the server waits, how long the run is): a resumed run may change them
UNCOMPUTED = ("resume", "results-dir", "run-name", "checkpoint-every", "round-timeout",
              "num-server-rounds", "eval-every")


def _sha(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def stream_context(config: Mapping[str, object]) -> str:
    """The digest of the run configuration a client's noise streams belong to: every key but
    :data:`UNCOMPUTED`, so that runs of one seed with other settings draw other noise and a
    resumed run draws its own again."""
    return _sha({k: v for k, v in config.items() if k not in UNCOMPUTED})[:32]


def broadcast_digest(arrays: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest of an exchange's broadcast (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name, array in arrays:
        values = array.detach().cpu().contiguous()
        h.update(f"{name}/{values.dtype}/{tuple(values.shape)}".encode())
        h.update(values.numpy().tobytes())
    return h.hexdigest()


def initial_chain(context: str, client: int, source: str) -> str:
    """The provenance of a fresh client state: its noise context, its id and its data."""
    return _sha("dpfl-chain", context, client, source)


def input_digest(*, context: str, client: int, chain: str, server_round: int, exchange: str,
                 broadcast: str, releases: list[Release], device: str) -> str:
    """Everything that decides a client's reply to one exchange besides its keyed streams: the
    provenance of its state (``chain``: the digests of every exchange the state went through,
    from its data on), the exchange, the broadcast, the releases' calibration, dpfl's version,
    the device and torch's thread count. Equal digests give equal replies bit for bit."""
    return _sha(context, client, chain, server_round, exchange, broadcast,
                [r.event for r in releases], __version__, device, torch.get_num_threads())


@dataclass
class NodeLedger:
    """One client's ledger on its node (see the module docstring)."""

    events: list[list[Any]] = field(default_factory=list)  # [relation, z, q, steps]
    # run -> {"total": {name: count}, "recent": [[round, name], ...], "floor": round}
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    answered: dict[str, dict[str, Any]] = field(default_factory=dict)
    # "run/segment" -> [round, [the exchanges of that round answered, in order]]
    progress: dict[str, list[Any]] = field(default_factory=dict)

    # ---- spending ----------------------------------------------------------------------
    def charge(self, run: str, server_round: int, releases: Iterable[Release], every: int) -> None:
        """Record one round of each of ``releases`` in round ``server_round`` of run ``run``
        (``every``: its checkpoint-every, which says how far back a resume may go)."""
        record = self.runs.setdefault(run, {"total": {}, "recent": [], "floor": 0})
        for release in releases:
            record["total"][release.name] = record["total"].get(release.name, 0) + 1
            record["recent"].append([server_round, release.name])
            z, q, steps = release.event
            mechanism = [release.relation, z, q]
            same = next((e for e in self.events if e[:3] == mechanism), None)
            if same is not None:  # each mechanism once (its history never grows with rounds)
                same[3] += steps
            elif steps > 0:
                self.events.append([*mechanism, steps])
        floor = _floor(max(r for r, _ in record["recent"]), every) if record["recent"] else 0
        if floor > record["floor"]:
            record["floor"] = floor
            record["recent"] = [[r, name] for r, name in record["recent"] if r > floor]

    def counts(self, run: str, server_round: int) -> dict[str, int]:
        """How many times each release was charged in run ``run`` in its rounds up to
        ``server_round`` (no earlier than the rounds a resume may repeat)."""
        record = self.runs.get(run)
        if record is None:
            return {}
        counts = dict(record["total"])
        for r, name in record["recent"]:
            if r > server_round:
                counts[name] -= 1
        return {name: n for name, n in counts.items() if n}

    def epsilon(self, accountant: str, delta: float, extra: Iterable[Release] = (), *,
                relation: Relation | str | None = None) -> float:
        """ε under ``relation`` (the node's ``cap-relation``; None: the one relation of every
        release, else replace-one) of every release recorded (and of ``extra``, were they made
        next) at ``delta``. An add/remove release of multiplier z is a replace-one release of
        multiplier z/2 (a replacement is a removal and an addition); a replace-one release has
        no add/remove ε (:func:`convertible`), and a node whose cap is stated under add/remove
        refuses it before it is made."""
        events = [*self.events, *([r.relation, *r.event] for r in extra)]
        if relation is None:
            relations = {of for of, *_ in events}
            relation = relations.pop() if len(relations) == 1 else Relation.REPLACE_ONE
        relation = Relation(relation)
        if not all(convertible(of, relation) for of, *_ in events):
            raise ValueError(f"replace-one releases have no {relation} ε")
        ledger = PrivacyLedger(accountant, relation)
        ledger.history = [(relation.multiplier(z, of=of), q, int(steps))
                          for of, z, q, steps in events]
        return ledger.epsilon(delta)

    # ---- the round structure ---------------------------------------------------------------
    def out_of_order(self, run: str, segment: str, server_round: int, exchange: str,
                     order: list[str]) -> str | None:
        """Why answering exchange ``exchange`` of round ``server_round`` (whose exchanges are
        ``order``) in segment ``segment`` of run ``run`` would break the round structure, or
        None. A segment answers rounds in increasing order, each round's exchanges in their
        order from its first, and nothing twice; a new segment (a resume) starts at the first
        exchange of a round its run's resume window still holds (:func:`_floor`): a round the
        run answered before the checkpoint the resume must start from is not answered again."""
        if exchange not in order:
            return (f"round {server_round} has no exchange {exchange!r} (its exchanges: "
                    f"{', '.join(order)})")
        last, answered = self.progress.get(f"{run}/{segment}", (None, []))
        if last is None:
            floor = self.runs.get(run, {}).get("floor", 0)
            if server_round <= floor:
                return (f"round {server_round} is older than a resume of this run may repeat "
                        f"(rounds after {floor})")
        if last is not None and (server_round < last or exchange in answered
                                 and server_round == last):
            return (f"round {server_round}, exchange {exchange!r} repeats or precedes an "
                    f"exchange this run already answered (last: round {last}, "
                    f"{answered[-1]!r}); a node answers each exchange once")
        expected = order[len(answered)] if server_round == last else order[0]
        if exchange != expected:
            return (f"round {server_round}, exchange {exchange!r} skips exchange {expected!r} "
                    f"of its round (exchanges run in order: {', '.join(order)})")
        return None

    def answer(self, run: str, segment: str, server_round: int, exchange: str) -> None:
        """Record that segment ``segment`` of run ``run`` answered ``(round, exchange)``
        (after :meth:`out_of_order` admitted it)."""
        done = self.progress.setdefault(f"{run}/{segment}", [server_round, []])
        if done[0] != server_round:
            done[:] = [server_round, []]
        done[1].append(exchange)

    # ---- the replay guard ----------------------------------------------------------------
    def answered_with(self, context: str, server_round: int, exchange: str) -> str | None:
        """The input digest ``(round, exchange)`` was answered with under ``context``; ``""``
        when it is older than the guard's window (to be refused); None when never answered."""
        guard = self.answered.get(context)
        if guard is None:
            return None
        digest = guard["inputs"].get(f"{server_round}/{exchange}")
        if digest is None and server_round <= guard["floor"]:
            return ""
        return digest

    def remember(self, context: str, server_round: int, exchange: str, digest: str,
                 every: int) -> None:
        """Keep ``digest`` for ``(round, exchange)``, and only the rounds a resume may repeat:
        those after the checkpoint before the last one (``every`` = checkpoint-every; with no
        checkpoints, the last round)."""
        guard = self.answered.setdefault(context, {"floor": 0, "inputs": {}})
        guard["inputs"][f"{server_round}/{exchange}"] = digest
        floor = _floor(max(int(key.split("/")[0]) for key in guard["inputs"]), every)
        if floor > guard["floor"]:
            guard["floor"] = floor
            guard["inputs"] = {k: v for k, v in guard["inputs"].items()
                               if int(k.split("/")[0]) > floor}

    # ---- storage -------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"events": self.events, "runs": self.runs, "answered": self.answered,
                           "progress": self.progress})

    @classmethod
    def from_json(cls, text: str) -> NodeLedger:
        data = json.loads(text)
        return cls(events=[list(e) for e in data["events"]], runs=dict(data["runs"]),
                   answered=dict(data["answered"]), progress=dict(data.get("progress", {})))


def convertible(relation: Relation | str, to: Relation | str) -> bool:
    """Whether a release private under ``relation`` has an ε under ``to``: every release under
    replace-one (an add/remove release as one of half its multiplier), only add/remove ones
    under add/remove."""
    return Relation(to) is Relation.REPLACE_ONE or Relation(relation) is Relation.ADD_REMOVE


def _floor(last: int, every: int) -> int:
    """The last round a resume of a run at round ``last`` cannot repeat: its checkpoint before
    the last one (``every`` = checkpoint-every), or, with no checkpoints, the round before."""
    return max(0, (last // every - 1) * every) if every else last - 1


class LedgerStore:
    """Where a node keeps its clients' ledgers: files in ``folder`` (one per client, see the
    module docstring), else the run's ``state`` (``Context.state``)."""

    KEY = "dpfl.node."

    def __init__(self, state: RecordDict, folder: Path | None) -> None:
        self.state = state
        self.folder = folder

    @contextlib.contextmanager
    def open(self, clients: list[int], *, write: bool = True
             ) -> Iterator[dict[int, NodeLedger]]:
        """The clients' ledgers, read, locked against other processes of the node while the
        caller answers, and written back when it returns (not when it raises: nothing was
        released then; nor without ``write``)."""
        if self.folder is None:
            ledgers = {c: NodeLedger.from_json(str(self.state[f"{self.KEY}{c}"]["json"]))
                       if f"{self.KEY}{c}" in self.state else NodeLedger() for c in clients}
            yield ledgers
            for c, ledger in ledgers.items() if write else ():
                self.state[f"{self.KEY}{c}"] = ConfigRecord({"json": ledger.to_json()})
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as locks:
            ledgers = {}
            for c in sorted(clients):
                lock = locks.enter_context(open(self.folder / f"client-{c}.lock", "a"))
                fcntl.flock(lock, fcntl.LOCK_EX)
                path = self.folder / f"client-{c}.json"
                ledgers[c] = NodeLedger.from_json(path.read_text()) if path.exists() \
                    else NodeLedger()
            yield ledgers
            for c, ledger in ledgers.items() if write else ():
                write_atomically(self.folder / f"client-{c}.json",
                                 lambda p, t=ledger.to_json(): _durable(p, t))


def _durable(path: Path, text: str) -> None:
    """Write ``text`` and wait until it is on the disk: a release is charged before its reply
    leaves, and a node that crashes afterwards must still hold the charge."""
    with open(path, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
