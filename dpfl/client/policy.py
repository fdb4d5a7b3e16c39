"""A node's own privacy policy: what its clients accept, whatever the server asks.

In a real federation the server sets the run config: the seed, the noise, the relation, the
rounds, the diagnostics. Nothing it controls may weaken a client's guarantee, so every dpfl
ClientApp reads a policy from its **node config** (``flower-supernode --node-config``, which only
the node's operator sets) and enforces it before anything leaves the node:

========================  ===============================  ==================================
node config key           a real node's default            meaning
========================  ===============================  ==================================
``trust-server``          ``false``                        take the keys below that are not
                                                           given from the run config (the
                                                           server is trusted: research
                                                           federations, and Flower's
                                                           simulation, where it is ``true``)
``noise``                 ``"secure"``                     where the clients' noise and
                                                           batches come from: ``secure`` (OS
                                                           CSPRNG), ``keyed`` (the run's
                                                           streams under the node's secret
                                                           ``noise-key``: the node's owner can
                                                           reproduce a run, the server cannot)
                                                           or ``seeded`` (the run's seed:
                                                           the server can regenerate and
                                                           remove the noise)
``noise-key``             ``<state-dir>/noise.key``        the secret of ``keyed`` noise (32
                                                           random bytes, made on first use)
``max-epsilon``           ``10``                           the largest ε the node's clients
                                                           spend, by the node's own ledger of
                                                           every run it served (``inf``: no cap)
``delta``                 ``1e-5``                         the δ of that ε
``accountant``            ``"rdp"``                        the accountant of that ε
``min-noise-multiplier``  ``0``                            the least noise multiplier (std over
                                                           sensitivity) of any release
``diagnostics``           ``false``                        whether ``non-private-diagnostics``
                                                           may send exact statistics
``cap-relation``          ``"replace-one"`` (the run's     the neighbouring relation
                          under ``trust-server``)
                                                           ``max-epsilon`` is stated in: under
                                                           replace-one an add/remove release
                                                           is charged as one of half its noise
                                                           multiplier; under add/remove a
                                                           replace-one run is refused
``relations``             ``"replace-one,add-remove"``     the neighbouring relations accepted
``min-client-records``    ``0`` (required with             the public lower bound on each
                          ``data-path``)                   client's record count that the node
                                                           trains and is charged under: a run
                                                           must declare the same, else it is
                                                           refused (by the two values alone)
``algorithms``            every algorithm whose clients    the algorithms accepted (names,
                          noise their own uploads          comma-separated)
========================  ===============================  ==================================

Under ``trust-server`` the defaults are the run's: its ``secure-noise`` (else seeded noise),
``max-epsilon`` (0: none), ``delta`` and ``accountant``, diagnostics allowed, every relation and
algorithm; the ledger is the run's own. A run config can make the noise stronger than a node's
(``secure-noise=true``), never weaker. A request the policy does not accept is refused with one
line in the node's log and a refusal the server sees, which names the policy key and never
anything computed from the data.

Flower's simulation runs every ClientApp in a Ray actor; a ClientApp anywhere else is a real
node (:func:`simulated`).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpfl.algorithms import ALGORITHMS
from dpfl.client.node_ledger import convertible
from dpfl.errors import ConfigError, did_you_mean
from dpfl.privacy import Randomness, Relation
from dpfl.privacy.randomness import MODES

if TYPE_CHECKING:
    from dpfl.runconfig import RunConfig

log = logging.getLogger("dpfl")

#: node config keys that place the node's clients and files (read in dpfl.client.numpy_client,
#: dpfl.client.cache and dpfl.client.state_files)
PLACEMENT = ("partition-id", "num-partitions", "partition-ids", "data-path", "state-dir")
POLICY = ("trust-server", "noise", "noise-key", "max-epsilon", "delta", "accountant",
          "cap-relation", "min-noise-multiplier", "diagnostics", "distributed-noise",
          "relations", "algorithms", "min-client-records")
ACCOUNTANTS = ("rdp", "prv")
#: a real node's ε cap when its node config sets none
DEFAULT_MAX_EPSILON = 10.0
DEFAULT_DELTA = 1e-5
KEY_BYTES = 32


class NodeConfigError(ConfigError):
    """A node config value is unknown or out of range (the node's operator's input)."""

    def __init__(self, key: str, problem: str, allowed: Iterable[object] | str | None = None):
        super().__init__(key, problem, allowed)
        self.args = (str(self.args[0]).replace("run config key", "node config key", 1),)

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
        return NodeConfigError, (self.key, self.problem, self.allowed)


def simulated() -> bool:
    """Whether this ClientApp runs in Flower's simulation: its ClientApps run only in Ray actors
    (``flwr.simulation.ray_transport.ray_actor.ClientAppActor``); a SuperNode runs them in its
    own process or a ``flwr-clientapp`` process, never in Ray. Erring here would only make a
    simulated node behave as a real one (secret noise, a cap), never the reverse."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized()) and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - any failure means: not inside a Ray actor
        return False


def local_algorithms() -> frozenset[str]:
    """The algorithms whose clients noise every upload themselves (no central, server-noised
    upload): what a real node accepts unless its policy lists others."""
    return frozenset(name for name in ALGORITHMS.names()
                     if not ALGORITHMS.get(name).central_releases())


def _flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    text = str(value).lower()
    if text not in ("true", "false"):
        raise NodeConfigError(key, f"{value!r}", allowed="true, false")
    return text == "true"


def _number(config: Mapping[str, Any], key: str, default: float, *, low: float,
            high: float = math.inf, closed: bool = True) -> float:
    value = config.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    inside = (low <= number if closed else low < number) and number <= high
    if not inside or math.isnan(number):
        bound = f"{'at least' if closed else 'above'} {low:g}" + (
            f" and at most {high:g}" if math.isfinite(high) else " (inf allowed)")
        raise NodeConfigError(key, f"{value!r}", allowed=f"a number {bound}")
    return number


RELATION_NAMES = tuple(r.value for r in Relation)


def _records(node_config: Mapping[str, Any], trust: bool) -> int | None:
    """The node's own ``min-client-records`` (None: the run's, which the node then takes as it
    is: a node that trusts the server, or one hosting clients of the run's split, whose record
    counts the run config itself decides). A node with its own data (``data-path``) must set it:
    a count only the node knows must never decide what it answers."""
    if "min-client-records" not in node_config:
        if "data-path" in node_config and not trust:
            raise NodeConfigError("min-client-records", "a node with its own data (data-path) "
                                  "needs its own public lower bound on its records",
                                  allowed="an integer >= 1, at most the site's record count")
        return None
    value = node_config["min-client-records"]
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise NodeConfigError("min-client-records", f"{value!r}", allowed="an integer >= 1")
    return int(value)


def _names(config: Mapping[str, Any], key: str, default: Iterable[str],
           known: Iterable[str]) -> frozenset[str]:
    known = sorted(known)
    if key not in config:
        return frozenset(default)
    names = [n.strip() for n in str(config[key]).split(",") if n.strip()]
    for name in names:
        if name not in known:
            raise NodeConfigError(key, f"unknown name {name!r}{did_you_mean(name, known)}",
                                  allowed=", ".join(known))
    return frozenset(names)


@dataclass(frozen=True)
class NodePolicy:
    """What one node accepts (see the module docstring); built by :meth:`of`."""

    trust_server: bool
    noise: str
    noise_key: Path
    max_epsilon: float
    delta: float
    accountant: str
    cap_relation: Relation | None  # None: the run's own (a node that trusts the server)
    min_noise_multiplier: float
    diagnostics: bool
    distributed: bool
    relations: frozenset[str]
    algorithms: frozenset[str]
    min_client_records: int | None
    state_dir: Path

    @classmethod
    def of(cls, node_config: Mapping[str, Any], run_config: RunConfig) -> NodePolicy:
        """The policy of a node with ``node_config`` serving a run of ``run_config`` (a
        validated :class:`~dpfl.runconfig.RunConfig`); raises :class:`NodeConfigError` on a
        bad node config."""
        from dpfl.client.state_files import state_folder

        for key in node_config:
            if key not in PLACEMENT + POLICY:
                raise NodeConfigError(key, "unknown key" + did_you_mean(key, PLACEMENT + POLICY)
                                      + (" (a node's noise is set by noise=\"secure\")"
                                         if key == "secure-noise" else ""),
                                      allowed=", ".join(PLACEMENT + POLICY))
        trust = _flag(node_config, "trust-server", simulated())
        noise = str(node_config.get("noise", "seeded" if trust else "secure"))
        if noise not in MODES:
            raise NodeConfigError("noise", f"{noise!r}", allowed=MODES)
        asked = run_config.privacy
        if asked.secure_noise:  # the run may ask for more, never for less
            noise = "secure"
        run_cap = asked.max_epsilon or math.inf
        accountant = str(node_config.get("accountant", asked.accountant if trust else "rdp"))
        if accountant not in ACCOUNTANTS:
            raise NodeConfigError("accountant", f"{accountant!r}", allowed=ACCOUNTANTS)
        cap_relation = node_config.get("cap-relation", None if trust else Relation.REPLACE_ONE)
        if cap_relation is not None and str(cap_relation) not in RELATION_NAMES:
            raise NodeConfigError("cap-relation", f"{cap_relation!r}", allowed=RELATION_NAMES)
        state_dir = state_folder(node_config)
        return cls(
            trust_server=trust, noise=noise,
            noise_key=Path(str(node_config.get("noise-key", state_dir / "noise.key")))
            .expanduser(),
            max_epsilon=_number(node_config, "max-epsilon",
                                run_cap if trust else DEFAULT_MAX_EPSILON, low=0.0,
                                closed=False),
            delta=_number(node_config, "delta", asked.delta if trust
                          else DEFAULT_DELTA, low=0.0, high=1.0, closed=False),
            accountant=accountant,
            cap_relation=None if cap_relation is None else Relation(str(cap_relation)),
            min_noise_multiplier=_number(node_config, "min-noise-multiplier", 0.0, low=0.0),
            diagnostics=_flag(node_config, "diagnostics", trust),
            distributed=_flag(node_config, "distributed-noise", trust),
            relations=_names(node_config, "relations", RELATION_NAMES, RELATION_NAMES),
            algorithms=_names(node_config, "algorithms",
                              ALGORITHMS.names() if trust else local_algorithms(),
                              ALGORITHMS.names()),
            min_client_records=_records(node_config, trust),
            state_dir=state_dir)

    # ---- what the node refuses ---------------------------------------------------------
    def refusal(self, config: RunConfig, relation: str) -> str | None:
        """Why the node refuses every round of a run of ``config`` whose algorithm protects
        ``relation`` (one line naming the policy key), or None."""
        name = config.run.algorithm
        if name not in self.algorithms:
            return (f"node policy algorithms: {name!r} is not accepted (allowed: "
                    f"{', '.join(sorted(self.algorithms))})")
        if relation not in self.relations:
            return (f"node policy relations: relation {str(relation)!r} is not accepted (allowed: "
                    f"{', '.join(sorted(self.relations))})")
        if self.cap_relation is not None and not convertible(relation, self.cap_relation):
            return (f"node policy cap-relation={self.cap_relation}: the cap is stated under "
                    f"{self.cap_relation}, and a {relation} release has no {self.cap_relation} "
                    f"ε (allowed: runs under {self.cap_relation})")
        declared = config.privacy.min_client_records
        if self.min_client_records is not None and declared != self.min_client_records:
            return (f"node policy min-client-records={self.min_client_records}: the run "
                    f"declares min-client-records={declared} (allowed: "
                    f"{self.min_client_records})")
        if config.evaluation.non_private_diagnostics and not self.diagnostics:
            return ("node policy diagnostics=false: exact, un-noised statistics "
                    "(non-private-diagnostics) may not leave this node")
        if config.secure.distributed_noise and not self.distributed:
            return ("node policy distributed-noise=false: this node adds each client's whole "
                    "noise (a share of it protects an upload only while the server follows "
                    "SecAgg+); its operator allows a share with the node config key "
                    "distributed-noise=true (flower-supernode --node-config "
                    "'distributed-noise=true')")
        return None

    def weak_noise(self, multipliers: Iterable[float]) -> str | None:
        """Why releases at noise ``multipliers`` (std over sensitivity) are refused, or
        None."""
        least = min(multipliers, default=math.inf)
        if least < self.min_noise_multiplier:
            return (f"node policy min-noise-multiplier={self.min_noise_multiplier:g}: the run "
                    f"asks for noise multiplier {least:.4g}")
        return None

    # ---- randomness --------------------------------------------------------------------
    def randomness(self, seed: int, context: str) -> Randomness:
        """The draws of the node's clients: seeded, keyed by the node's secret (``context``
        names the run configuration), or from the OS CSPRNG."""
        if self.noise == "secure":
            return Randomness(seed, secure=True)
        if self.noise == "keyed":
            return Randomness(seed, key=self.secret(), context=context)
        return Randomness(seed)

    def secret(self) -> bytes:
        """The node's secret for keyed noise: ``noise-key``'s bytes, written (32 random bytes,
        readable by this user only) where the file does not exist yet."""
        path = self.noise_key
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(descriptor, "wb") as out:
                    out.write(secrets.token_bytes(KEY_BYTES))
            key = path.read_bytes()
        except FileExistsError:  # another process of this node made it meanwhile
            key = path.read_bytes()
        except OSError as error:
            raise NodeConfigError("noise-key", f"cannot read or create {str(path)!r}: "
                                  f"{error.strerror}", allowed="a file this user can "
                                  "read (or create)") from None
        if len(key) < 16:
            raise NodeConfigError("noise-key", f"{str(path)!r} holds {len(key)} bytes",
                                  allowed="a file of at least 16 secret bytes")
        return key
