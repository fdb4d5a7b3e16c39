"""The messages a dpfl server and its nodes exchange: each one a dataclass that encodes itself
as Flower records (``encode``) and is decoded from them (``decode``), used by both ends — the
strategy (:mod:`dpfl.strategies`) and the ClientApp (:mod:`dpfl.client.app`). Records are keyed
natively; nothing is sent that is not read.

* server → node, ``query.clients``: :class:`ClientsQuery` — ``config`` (the run's lineage:
  ``segments``, ``starts``);
* node → server: :class:`Hosted` — ``hosted`` (``clients``) and one ``charged.<id>`` per
  client (its counts of the run's releases, by release name);
* server → node, ``train``: :class:`TrainRequest` — ``broadcast`` (ArrayRecord: the exchange's
  declared arrays, in their declared order) and ``config`` (``exchange``, ``round``,
  ``clients``: the participants the node hosts; ``segments``, ``starts``: the run's lineage,
  which names its clients' state files);
* node → server: :class:`TrainReply` — one ArrayRecord ``client.<id>`` per participant holding
  its declared uploads, noised by its releases, one ConfigRecord ``charged.<id>`` with its
  counts of the run's releases, ``diagnostics.<id>`` MetricRecords under
  non-private-diagnostics only, and ``node`` (``noise``: where its clients' noise came from,
  :data:`dpfl.privacy.randomness.MODES`);
* node → server under secure aggregation (a ``train`` request that Flower's SecAgg+ carries,
  with its ``secaggplus_configs``): :class:`SecureTrainReply` — the legacy fit result Flower's
  ``secaggplus_mod`` reads (``fitres.parameters``: per upload, the sum of the node's
  participants' quantised uploads; ``fitres.num_examples`` 1, a protocol constant: every
  node's sum enters the masked total with weight one; empty ``fitres.metrics``, status OK),
  which the mod masks and then clears, so the server receives only the masked vector, with
  ``charged.<id>`` and ``node`` in clear;
* node → server, to either request: a refusal — a ConfigRecord ``refused`` (``clients``,
  ``reason``: the node-policy key that refuses, one line computed from nothing private),
  decoded as :class:`~dpfl.rounds.ClientRefused`.

No reply carries an example count (Flower's ``num_examples``): dpfl's aggregations weigh
clients equally, and a client's record count is private — a reply holds nothing derived from
its data but its noised uploads (tests/test_privacy_boundary.py checks every reply's records
against this list).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from dpfl.checkpoint import Lineage
from dpfl.rounds import ClientRefused

#: the message type of the discovery query (Flower's ``query`` type, dpfl's ``clients`` action)
CLIENTS_QUERY = "query.clients"
CLIENT = "client."
CHARGED = "charged."
DIAGNOSTICS = "diagnostics."
NODE = "node"
REFUSED = "refused"

Arrays = dict[str, np.ndarray]
Counts = dict[int, dict[str, int]]


def _lineage_record(lineage: Lineage | None) -> dict[str, list]:
    if lineage is None:
        return {}
    return {"segments": [s for s, _ in lineage.segments],
            "starts": [r for _, r in lineage.segments]}


def _lineage(config: ConfigRecord) -> Lineage | None:
    """The lineage in ``config`` (None from a server that sends none)."""
    if "segments" not in config:
        return None
    return Lineage(tuple(zip((str(s) for s in config["segments"]),
                             (int(r) for r in config["starts"]), strict=True)))


def array_record(arrays: Arrays) -> ArrayRecord:
    """``arrays`` as an ArrayRecord, keys and order kept."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def _numbered(content: RecordDict, prefix: str) -> dict[int, object]:
    """The records named ``<prefix><id>``, by id."""
    return {int(name[len(prefix):]): record for name, record in content.items()
            if name.startswith(prefix)}


def _with_charged(content: RecordDict, charged: Counts) -> RecordDict:
    """``content`` with one ``charged.<id>`` record a client."""
    for c, counts in charged.items():
        content[f"{CHARGED}{c}"] = ConfigRecord(counts)
    return content


def _charged(content: RecordDict) -> Counts:
    return {c: {k: int(v) for k, v in record.items()}  # type: ignore[attr-defined]
            for c, record in _numbered(content, CHARGED).items()}


def encode_refusal(refused: ClientRefused) -> RecordDict:
    return RecordDict({REFUSED: ConfigRecord({"clients": list(refused.clients),
                                              "reason": refused.reason})})


def decode_refusal(content: RecordDict) -> ClientRefused | None:
    """The refusal ``content`` holds, or None."""
    if REFUSED not in content:
        return None
    record = content[REFUSED]
    return ClientRefused([int(c) for c in record["clients"]], str(record["reason"]))


@dataclass(frozen=True)
class ClientsQuery:
    """Which clients does a node host, and how often was each charged each release of the
    run's ``lineage`` (up to the round its current segment started after)?"""

    lineage: Lineage | None = None

    def encode(self) -> RecordDict:
        return RecordDict({"config": ConfigRecord(_lineage_record(self.lineage))})

    @classmethod
    def decode(cls, content: RecordDict) -> ClientsQuery:
        return cls(_lineage(content["config"]) if "config" in content else None)


@dataclass(frozen=True)
class Hosted:
    """A node's answer to :class:`ClientsQuery`."""

    clients: list[int]
    charged: Counts = field(default_factory=dict)

    def encode(self) -> RecordDict:
        return _with_charged(RecordDict({"hosted": ConfigRecord({"clients": list(self.clients)})}),
                             self.charged)

    @classmethod
    def decode(cls, content: RecordDict) -> Hosted | ClientRefused:
        if (refused := decode_refusal(content)) is not None:
            return refused
        return cls([int(c) for c in content["hosted"]["clients"]], _charged(content))


@dataclass(frozen=True)
class TrainRequest:
    """One exchange of a round, for the participants ``clients`` a node hosts."""

    exchange: str
    server_round: int
    clients: list[int]
    broadcast: Arrays
    lineage: Lineage | None = None

    def encode(self) -> RecordDict:
        return RecordDict({"broadcast": array_record(self.broadcast), "config": ConfigRecord({
            "exchange": self.exchange, "round": self.server_round,
            "clients": list(self.clients), **_lineage_record(self.lineage)})})

    @classmethod
    def decode(cls, content: RecordDict) -> TrainRequest:
        config = content["config"]
        return cls(str(config["exchange"]), int(config["round"]),
                   [int(c) for c in config["clients"]],
                   {k: a.numpy() for k, a in content["broadcast"].items()}, _lineage(config))


@dataclass(frozen=True)
class TrainReply:
    """A node's answer to :class:`TrainRequest`: each participant's noised ``uploads``, its
    counts of the run's releases, where the node's noise came from and, under
    non-private-diagnostics only, each participant's diagnostics."""

    uploads: dict[int, Arrays]
    charged: Counts
    noise: str
    diagnostics: dict[int, dict[str, float]] = field(default_factory=dict)

    def encode(self) -> RecordDict:
        content = RecordDict({NODE: ConfigRecord({"noise": self.noise})})
        for c, uploads in self.uploads.items():
            content[f"{CLIENT}{c}"] = array_record(uploads)
            content[f"{CHARGED}{c}"] = ConfigRecord(self.charged[c])
            if c in self.diagnostics:
                content[f"{DIAGNOSTICS}{c}"] = MetricRecord(self.diagnostics[c])
        return content

    @classmethod
    def decode(cls, content: RecordDict) -> TrainReply | ClientRefused:
        if (refused := decode_refusal(content)) is not None:
            return refused
        return cls({c: {k: a.numpy() for k, a in record.items()}  # type: ignore[attr-defined]
                    for c, record in _numbered(content, CLIENT).items()},
                   _charged(content), str(content[NODE]["noise"]),
                   {c: {k: float(v) for k, v in record.items()}  # type: ignore[attr-defined]
                    for c, record in _numbered(content, DIAGNOSTICS).items()})


@dataclass(frozen=True)
class SecureTrainReply:
    """A node's answer to a :class:`TrainRequest` under secure aggregation: ``sums``, per
    upload in the exchange's declared order, the float64 array Flower's SecAgg+ mod masks
    (:func:`dpfl.rounds.secure_sum.node_vector`); its participants' counts of the run's releases
    and where the node's noise came from, in clear (their uploads never leave it unmasked)."""

    sums: list[np.ndarray]
    charged: Counts
    noise: str

    def encode(self) -> RecordDict:
        from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

        from dpfl.flower_internals import fitres_to_recorddict

        content = fitres_to_recorddict(FitRes(Status(Code.OK, ""), ndarrays_to_parameters(
            self.sums), num_examples=1, metrics={}), keep_input=True)
        content[NODE] = ConfigRecord({"noise": self.noise})
        return _with_charged(content, self.charged)

    @classmethod
    def decode(cls, content: RecordDict) -> SecureTrainReply | ClientRefused:
        """What the server reads of a reply that Flower's mod masked (its arrays cleared)."""
        if (refused := decode_refusal(content)) is not None:
            return refused
        return cls([], _charged(content), str(content[NODE]["noise"]))

    @staticmethod
    def refusal(refused: ClientRefused, uploads: int) -> RecordDict:
        """A refusal in the fit shape the mod needs (one zero for each of the ``uploads``:
        the masked sum broadcasts it, and the server stops before unmasking), so that its
        reason reaches the server."""
        content = SecureTrainReply([np.zeros(1)] * uploads, {}, "").encode()
        del content[NODE]
        content[REFUSED] = encode_refusal(refused)[REFUSED]
        return content
