"""Everything a run needs, built from its configuration (the same on every runtime)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dpfl.algorithms import ALGORITHMS, Algorithm, Cohort, check_schema
from dpfl.config import parse_options
from dpfl.datasets import DATASETS, Dataset, load_dataset, partition
from dpfl.datasets import reference as referenced_data
from dpfl.datasets.base import HELD_OUT
from dpfl.datasets.loading import PROVIDED, data_folder
from dpfl.datasets.population import LazyPartitions, Population
from dpfl.errors import ConfigError
from dpfl.models import MODELS, FlatModel, build_model, zoo
from dpfl.privacy import Accounting, Query, Release, Target, calibrate
from dpfl.reference import is_reference, keyword_parameters, resolve
from dpfl.runconfig import RunConfig

LOSS_OF_TASK = {"classification": "cross-entropy", "binary": "logistic", "regression": "squared"}


def data_dir(config: RunConfig) -> str:
    """The run's data folder, absolute: ``data-dir``, else ``$DPFL_DATA_DIR``, else ``data`` in
    dpfl's per-user cache folder (:func:`dpfl.datasets.loading.data_folder`)."""
    return str(data_folder(config.data.data_dir or None))


def resolve_device(config: RunConfig) -> torch.device:
    name = config.model.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA is not available on this machine",
                          allowed="cpu, auto" + (", cuda" if torch.cuda.is_available() else ""))
    return torch.device(name)


@dataclass
class Problem:
    """Data, partition, model, algorithm and initial point of a run.

    ``hosted``: None for the whole run (the server's and the engine's view), or the clients of
    one node, whose view (:meth:`node_data`, :func:`node_problem`) holds only their rows;
    ``source`` names the data a node holds (its cache key: the data's files, the split, the
    clients), which the provenance of its clients' states starts from
    (:func:`dpfl.client.node_ledger.initial_chain`).
    """

    config: RunConfig
    dataset: Dataset
    partitions: Sequence[np.ndarray]  # a list, or a population's LazyPartitions
    model: FlatModel
    algorithm: Algorithm
    x0: torch.Tensor
    device: torch.device
    hosted: tuple[int, ...] | None = None
    source: str = ""
    #: the fewest records a client of the whole split holds, where this view holds only some
    #: clients' rows (a node's, from the split it was built from); None: its own partitions'
    split_smallest: int | None = None
    _releases: dict[int, list[Release]] = field(default_factory=dict)
    _server_releases: list[Release] | None = None
    _cohorts: dict[tuple[int, ...], Cohort] = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.partitions)

    def _check_hosted(self, client_ids: list[int]) -> None:
        if self.hosted is not None and not set(client_ids) <= set(self.hosted):
            raise ValueError(f"clients {sorted(set(client_ids) - set(self.hosted))} are not "
                             f"hosted by this node (it hosts {list(self.hosted)})")

    @property
    def population(self) -> Population | None:
        """The clients whose rows are made when a round needs them, if the data are such."""
        return self.dataset.population

    def cohort(self, client_ids: list[int]) -> Cohort:
        """The given clients' data, holding only their own rows (cached per client set; a
        population's cohorts are made afresh, so that memory holds one round's)."""
        self._check_hosted(client_ids)
        key = tuple(client_ids)
        if self.population is not None:
            return self._gather(client_ids)
        if key not in self._cohorts:
            self._cohorts[key] = self._gather(client_ids)
        return self._cohorts[key]

    def _gather(self, client_ids: list[int]) -> Cohort:
        if self.population is not None:
            made = [self.population.rows(c) for c in client_ids]
            x = torch.cat([rows[0] for rows in made])
            y = torch.cat([rows[1] for rows in made])
            sizes = [len(rows[1]) for rows in made]
        else:
            rows = np.concatenate([self.partitions[c] for c in client_ids])
            x = self.dataset.train_x[torch.from_numpy(rows)]
            y = self.dataset.train_y[torch.from_numpy(rows)]
            sizes = [len(self.partitions[c]) for c in client_ids]
        offsets = np.cumsum([0] + sizes)
        indices = [torch.arange(offsets[i], offsets[i + 1]) for i in range(len(client_ids))]
        return Cohort(list(client_ids), x, y, indices)

    def full_cohort(self) -> Cohort:
        """All clients over the whole training set (the engine's view; a population has
        none: its rounds gather their cohorts, :meth:`cohort`)."""
        if self.population is not None:
            raise ValueError("a population's clients are made per round: gather a cohort")
        return Cohort(list(range(self.num_clients)), self.dataset.train_x, self.dataset.train_y,
                      [torch.from_numpy(p) for p in self.partitions])

    def releases(self, client: int) -> list[Release]:
        """The calibrated mechanisms of one round of ``client`` (calibrated once per distinct
        data size: a client calibrates from its own record count, or from the public lower
        bound ``min-client-records`` where one is set). Under ``secure-aggregation`` every
        client calibrates alike (from that bound, else the smallest client's count: the sum's
        noise must cover each of them, and every upload is quantised on one grid), and with
        ``distributed-noise`` draws a share of the noise (:meth:`~dpfl.privacy.Release.split`
        over :attr:`survivors`)."""
        self._check_hosted([client])
        size = self.config.privacy.min_client_records or (
            self.smallest_client() if self.config.secure.secure_aggregation
            else len(self.partitions[client]))
        if size not in self._releases:
            queries = self.algorithm.queries(size)
            check_schema(self.algorithm, queries)
            releases = self._calibrate(queries, size)
            if self.config.secure.distributed_noise:
                releases = [r.split(self.survivors) for r in releases]
            self._releases[size] = releases
        return self._releases[size]

    def smallest_client(self) -> int:
        """The fewest records a client of the run holds (a node's view: of the split it was
        built from)."""
        if self.split_smallest is not None:
            return self.split_smallest
        if self.population is not None:
            return self.population.smallest
        if self.hosted is not None:
            raise ConfigError("min-client-records", "this node does not know every client's "
                              "record count: secure aggregation calibrates every client from "
                              "the run's public lower bound", allowed="an integer >= batch-size")
        return min(len(p) for p in self.partitions)

    @property
    def survivors(self) -> int:
        """``distributed-noise``: the fewest clients whose noise shares every released sum
        holds (``min-survivors``, else every participant of an exchange)."""
        return self.config.secure.min_survivors or self.algorithm.participants_per_round(
            self.algorithm.hp, self.num_clients)

    def server_releases(self) -> list[Release]:
        """The calibrated mechanisms of the server's own noise in one round (client-level: its
        "records" are the clients)."""
        if self._server_releases is None:
            self._server_releases = self._calibrate(self.algorithm.server_queries(),
                                                    self.num_clients)
        return self._server_releases

    def accounting(self, *, limit: float = 0.0, also: tuple[str, ...] = ()) -> Accounting:
        """Every client's ledger of this run's releases (its own, the central ones, the
        population's), and the server's; ``limit`` and ``also`` as :class:`Accounting` reads
        them."""
        privacy, algorithm, server = self.config.privacy, self.algorithm, self.server_releases()
        return Accounting(
            num_clients=self.num_clients, releases=self.releases,
            accountant=privacy.accountant, relation=algorithm.relation, delta=privacy.delta,
            limit=limit, also=also,
            central=tuple(r for r in server if r.name in algorithm.central_releases()),
            population=tuple(r for r in server if r.name in algorithm.population_releases()))

    def node_data(self, clients: list[int]) -> dict[str, Any]:
        """What a node hosting ``clients`` keeps of the run's data, as plain tensors and lists
        (what :meth:`from_node_data` rebuilds from): its clients' training rows, client by
        client, their sizes, the public records and the dataset's description."""
        ds = self.dataset
        own = self._gather(list(clients))  # a population makes its clients' rows here
        return {"name": ds.name, "task": ds.task, "num_classes": ds.num_classes,
                "num_clients": self.num_clients, "clients": list(clients),
                "sizes": own.sizes,
                "train_x": own.x.contiguous(), "train_y": own.y.contiguous(),
                "public_x": ds.public_x, "public_y": ds.public_y,
                "smallest": self.smallest_client()}

    @classmethod
    def from_node_data(cls, config: RunConfig, data: dict[str, Any]) -> Problem:
        """The run as the node of :meth:`node_data` sees it: its clients' rows (the other
        clients hold none, and asking for them is an error), no test rows, the same model,
        algorithm and initial point as the whole run's."""
        x, sizes, clients = data["train_x"], data["sizes"], data["clients"]
        bound = config.privacy.min_client_records
        if bound > min(sizes):  # said without the count: a site's count never leaves it
            raise ConfigError("min-client-records", "a client of this node holds fewer records "
                              "than the bound every client is charged from",
                              allowed="at most the smallest client's record count")
        if config.hyperparameters.batch_size > (bound or min(sizes)):
            raise ConfigError("batch-size", "exceeds the records of a client of this node",
                              allowed=f"1..{bound}" if bound else "at most its record count")
        ends = np.cumsum(sizes)
        own = {c: np.arange(end - size, end, dtype=np.int64)
               for c, size, end in zip(clients, sizes, ends, strict=True)}
        parts = [own.get(c, np.empty(0, dtype=np.int64)) for c in range(data["num_clients"])]
        dataset = Dataset(data["name"], x, data["train_y"], x[:0], data["train_y"][:0],
                          task=data["task"], num_classes=data["num_classes"],
                          public_x=data["public_x"], public_y=data["public_y"])
        problem = assemble(config, dataset, parts, hosted=tuple(clients))
        problem.split_smallest = data.get("smallest")  # a site's data: None (its own count)
        return problem

    def calibrations(self) -> dict[str, list[dict[str, Any]]]:
        """The releases calibrated so far, as JSON-ready records (:meth:`restore_calibrations`
        takes them back): per client data size, and the server's."""
        saved = {str(size): releases for size, releases in self._releases.items()}
        if self._server_releases is not None:
            saved["server"] = self._server_releases
        return {key: [r.record() for r in releases] for key, releases in saved.items()}

    def restore_calibrations(self, saved: dict[str, list[dict[str, Any]]]) -> None:
        for key, records in saved.items():
            releases = [Release(**r) for r in records]
            if key == "server":
                self._server_releases = releases
            else:
                self._releases[int(key)] = releases

    @property
    def calibration_rounds(self) -> int:
        """The rounds the noise is calibrated for: ``calibration-rounds``, else the run's."""
        return self.config.privacy.calibration_rounds or self.config.run.num_server_rounds

    @functools.cached_property
    def exchange_rounds(self) -> Counter[str]:
        """How many of the calibrated rounds (:attr:`calibration_rounds`) run each exchange."""
        return Counter(e.name for r in range(1, self.calibration_rounds + 1)
                       for e in self.algorithm.round_exchanges(r))

    def _calibrate(self, queries: list[Query], num_samples: int) -> list[Release]:
        privacy = self.config.privacy
        steps = sum(q.steps * self.exchange_rounds[q.exchange] for q in queries)
        target = Target(epsilon=privacy.epsilon, delta=privacy.delta,
                        rounds=self.calibration_rounds, accountant=privacy.accountant,
                        num_samples=num_samples, steps=steps)
        return calibrate(self.algorithm, queries, target, calibration=privacy.calibration,
                         noise_multiplier=privacy.noise_multiplier,
                         options=self.config.calibration_options)


def options(kind: str, name: str, text: str) -> dict[str, object]:
    """``text``, the options of the run's ``kind`` (``model`` or ``dataset``) ``name`` (its
    run-config key ``{kind}-options``), parsed (``key=value`` pairs, keys with ``_`` or ``-``)
    and checked against the keyword arguments of that builder (:func:`option_parameters`):
    each must be one, of its default's type where it has one."""
    key, text = f"{kind}-options", text.strip()
    if not text:
        return {}
    try:
        parsed = parse_options(text)
    except ValueError as exc:
        raise ConfigError(key, f"cannot parse {exc}", allowed="space-separated key=value pairs, "
                          "e.g. 'scaling=symmetric duplicate=3'") from None
    given = {k.replace("-", "_"): v for k, v in parsed.items()}
    accepted, takes_any = option_parameters(kind, name)
    for option, value in given.items():
        if option not in accepted:
            if takes_any:
                continue
            raise ConfigError(key, f"{kind} {name!r} has no option {option!r}",
                              allowed=list(accepted) or "none")
        if accepted[option] is inspect.Parameter.empty or accepted[option] is None:
            continue  # no default to take a kind from
        wanted = type(accepted[option])  # an option's kind is its default's
        if type(value) is not wanted and not (wanted is float and type(value) is int):
            raise ConfigError(key, f"{kind} {name!r}: option {option} must be "
                              f"{wanted.__name__}, got {type(value).__name__} {value!r}",
                              allowed="true or false" if wanted is bool else None)
    return given


def option_parameters(kind: str, name: str) -> tuple[dict[str, object], bool]:
    """The options ``kind`` (``model`` or ``dataset``) ``name`` takes, with their defaults,
    and whether it takes any (``**kwargs``): a registered builder's keyword-only parameters
    (but those the run config fills in, :data:`~dpfl.datasets.loading.PROVIDED`); a referenced
    callable's keyword parameters (but ``input_shape`` and ``num_classes``, or ``seed`` and
    ``data_dir``), a dataset's with ``num_public`` and ``num_validation``, which dpfl holds
    out itself."""
    if is_reference(name):
        given = zoo.GIVEN if kind == "model" else referenced_data.GIVEN
        accepted, takes_any = keyword_parameters(resolve(kind, name), given)
        if kind == "dataset":
            accepted |= {f"num_{split}": 0 for split in HELD_OUT}
        return accepted, takes_any
    builder = (MODELS if kind == "model" else DATASETS).get(name)
    return {p.name: p.default for p in inspect.signature(builder).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in PROVIDED}, False


def dataset_of(config: RunConfig) -> Dataset:
    """The run's dataset (cached in-process): a registered one, or the callable a reference
    names (:mod:`dpfl.datasets.reference`); raises ConfigError where it is not available."""
    data, seed = config.data, config.run.seed
    name, folder = data.dataset, data.data_dir
    given = options("dataset", name, data.dataset_options)
    if is_reference(name):
        return referenced_data.load_referenced(name, seed=seed,
                                               data_dir=data_folder(folder or None), **given)
    return load_dataset(name, seed=seed, data_dir=folder or None,
                        download=data.download, **given)


def data_key(config: RunConfig) -> dict[str, object]:
    """The settings that decide what data each client holds (its rows, the public records):
    the data settings but the folder (a node's cached data is keyed by the folder it resolves
    to), and the seed."""
    return dataclasses.asdict(dataclasses.replace(config.data, data_dir="")) | {
        "seed": config.run.seed}


def build_problem(config: RunConfig) -> Problem:
    """Load, partition and initialise; raises ConfigError on bad input."""
    resolve_device(config)
    dataset = dataset_of(config)
    data = config.data
    if dataset.population is not None:
        return assemble(config, dataset, population_partitions(config, dataset.population))
    parts = partition(dataset, partitioner=data.partitioner, num_partitions=data.num_partitions,
                      seed=config.run.seed, alpha=data.alpha,
                      shards_per_partition=data.shards_per_partition)
    check_sizes(config, [len(p) for p in parts])
    return assemble(config, dataset, parts)


def population_partitions(config: RunConfig, population: Population) -> LazyPartitions:
    """A population's own clients, one partition each (``partitioner="natural"``, as many
    partitions as clients), checked against the fewest rows a client of it may hold."""
    data = config.data
    if data.partitioner != "natural":
        raise ConfigError("partitioner", "a population's clients are its partitions",
                          allowed="natural")
    if data.num_partitions != population.num_clients:
        raise ConfigError("num-partitions", f"{data.num_partitions} partitions of a population "
                          f"of {population.num_clients} clients",
                          allowed=str(population.num_clients))
    check_sizes(config, [population.smallest])
    return LazyPartitions(population)


def check_sizes(config: RunConfig, sizes: list[int]) -> None:
    """ConfigError unless every client holds at least ``batch-size`` records and at least
    ``min-client-records`` (the bound every client is calibrated and charged from)."""
    smallest, bound = min(sizes), config.privacy.min_client_records
    if bound > smallest:
        raise ConfigError("min-client-records", f"{bound} exceeds a client's {smallest} "
                          f"records: its ε would be undercounted", allowed=f"0..{smallest}")
    batch_size, least = config.hyperparameters.batch_size, bound or smallest
    if batch_size > least:
        if bound:
            what = f"min-client-records ({least})"
        else:
            split = config.data.partitioner
            other = ("a larger alpha or fewer num-partitions" if split == "dirichlet"
                     else "fewer num-partitions")
            what = (f"client {sizes.index(least)}'s {least} records, the fewest of the "
                    f"{split} split: lower batch-size or choose {other}")
        raise ConfigError("batch-size", f"{batch_size} exceeds {what}", allowed=f"1..{least}")


def assemble(config: RunConfig, dataset: Dataset, parts: Sequence[np.ndarray],
             hosted: tuple[int, ...] | None = None, *, model: FlatModel | None = None
             ) -> Problem:
    """The model, algorithm and initial point of ``config`` over data already partitioned;
    ``model``: a model given instead of the config's (an audit's canary model)."""
    device = resolve_device(config)
    if model is None:
        chosen = config.model
        module = build_model(chosen.model, input_shape=dataset.input_shape,
                             num_classes=dataset.num_classes, seed=config.run.seed,
                             input_dtype=dataset.train_x.dtype,
                             **options("model", chosen.model, chosen.model_options)).to(device)
        # a layer without a per-sample rule (BatchNorm) is refused here, naming key model
        model = FlatModel(module, LOSS_OF_TASK[dataset.task],
                          nonconvex_reg=chosen.nonconvex_reg,
                          chunk_bytes=chosen.chunk_bytes or None)
    public = (None if dataset.public_y is None
              else (dataset.public_x.to(device), dataset.public_y.to(device)))
    algorithm = ALGORITHMS.get(config.run.algorithm)(config.hyperparameters, model,
                                                     num_clients=len(parts), public=public)
    rounds = config.run.num_server_rounds
    algorithm.check_run(rounds)
    algorithm.calibrated_for(config.privacy.calibration_rounds or rounds)
    if dataset.population is not None:
        check_stateless(algorithm)
    calibrated = config.privacy.calibration_rounds
    if calibrated and calibrated < rounds:  # less noise than the run's ε needs
        raise ConfigError("calibration-rounds", f"{calibrated} is fewer than the run's {rounds} "
                          f"rounds", allowed=f"0 or at least num-server-rounds ({rounds})")
    return Problem(config, dataset, parts, model, algorithm, model.initial_params().cpu(), device,
                   hosted)


def check_stateless(algorithm: Algorithm) -> None:
    """ConfigError where ``algorithm`` keeps state on each client: over a population that
    state would be the population's (in memory, or in a file a round reads and writes), and
    dpfl keeps it for the clients of an in-memory dataset only."""
    state = algorithm.init_client_state(1)
    if state:
        per_client = sum(v.numel() * v.element_size() for v in state.values())
        population = algorithm.num_clients
        raise ConfigError("algorithm", f"{algorithm.name!r} keeps {per_client:,} bytes of state "
                          f"on each client, {per_client * population / 2**30:.3g} GiB over a "
                          f"population of {population:,}: a population runs stateless "
                          f"algorithms", allowed="an algorithm without client state, e.g. "
                          "dp-fedavg-user, dp-ftrl, dp-fedavg-quantile")


@functools.lru_cache(maxsize=4)
def cached_problem(items: tuple[tuple[str, object], ...]) -> Problem:
    """One Problem per configuration per process (Flower rebuilds ClientApps every round)."""
    return build_problem(RunConfig(dict(items)))
