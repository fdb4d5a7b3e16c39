"""Differential privacy for a Flower app of one's own: :class:`PrivateFederation`.

A team with its own ServerApp and ClientApp, model and data describes the private run once,
in the module both apps import (Flower's ``task.py``): the algorithm and its hyperparameters,
the privacy target, and its model and data by reference (``"module:callable"``, Flower's
convention; the callables themselves are accepted where they are importable by that name). The
server gets a Flower ``Strategy`` (:meth:`PrivateFederation.strategy`) to ``start`` in its own
ServerApp, from its own model's ``state_dict``; the client side is a ``ClientApp``
(:meth:`PrivateFederation.client_app`) that runs the algorithm's client step on the node's
records. Both are dpfl's own, unchanged: the ledger and its cap on every release, the node's
policy (node config), secret noise on real SuperNodes, replay refusal and secure aggregation
are exactly those of ``dpfl run``/``dpfl flower`` (docs/your-own-app.md).

The settings are validated when the federation is made, with dpfl's one-line errors naming the
key (:class:`~dpfl.errors.ConfigError`): every key of ``dpfl keys`` may be given through
``options``, the algorithm's hyperparameters through ``hyperparameters`` (run-config keys, or
the algorithm's own ``Hyperparameters`` dataclass).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from dpfl.config import Value, values_of
from dpfl.errors import ConfigError
from dpfl.problem import Problem, cached_problem
from dpfl.runconfig import RunConfig, check_runtime
from dpfl.strategies import AlgorithmStrategy
from dpfl.strategies.algorithm import from_record, to_record

Reference = str | Callable[..., Any]


def reference(key: str, value: Reference) -> str:
    """``value`` as a ``"module:callable"`` reference: itself, or the name a callable is
    imported by (which the nodes import it by: it must be defined at a module's top level)."""
    if isinstance(value, str):
        return value
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not module or not name or "<" in name or module == "__main__":
        raise ConfigError(key, f"{value!r} is not importable by name on the nodes",
                          allowed="a \"module:callable\" reference, or a callable defined at "
                                  "the top level of an importable module")
    return f"{module}:{name}"


def hyperparameter_values(hyperparameters: Any) -> dict[str, Value]:
    """Run-config keys and values of ``hyperparameters``: a mapping of keys, or an algorithm's
    ``Hyperparameters`` dataclass."""
    if dataclasses.is_dataclass(hyperparameters) and not isinstance(hyperparameters, type):
        return values_of(hyperparameters)
    return dict(hyperparameters)


@dataclass(frozen=True)
class PrivateFederation:
    """A private run of ``algorithm`` (``dpfl keys`` lists them) over ``num_clients`` clients
    for ``num_rounds`` rounds, each client's ε at most ``epsilon`` at ``delta`` (record-level,
    the noise calibrated to it), training ``model`` on ``data``.

    ``model``: a callable returning the ``nn.Module`` (``input_shape``, ``num_classes`` and
    ``model-options`` given where it takes them; docs/your-own-model.md). ``data``: a callable
    returning the training and test sets (docs/your-own-model.md#data); the training
    set is split over the clients by ``options["partitioner"]`` (IID by default), and the
    server evaluates on the test set each round. ``seed`` fixes the split, the initial model
    and, in simulation, the noise (real SuperNodes draw secret noise by their own policy)."""

    algorithm: str
    model: Reference
    data: Reference
    num_clients: int
    num_rounds: int
    epsilon: float = 8.0
    delta: float = 1e-5
    hyperparameters: Any = field(default_factory=dict)
    seed: int = 0
    options: Mapping[str, Value] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_runtime(self.run_config, "flower")

    @functools.cached_property
    def values(self) -> dict[str, Value]:
        """The run config of dpfl's own app that this federation is."""
        given = {"algorithm": self.algorithm, "model": reference("model", self.model),
                 "dataset": reference("dataset", self.data),
                 "num-partitions": self.num_clients, "num-server-rounds": self.num_rounds,
                 "epsilon": self.epsilon, "delta": self.delta, "seed": self.seed}
        values = {**hyperparameter_values(self.hyperparameters), **dict(self.options)}
        for key in given.keys() & values.keys():
            raise ConfigError(key, "given twice: as an argument of PrivateFederation and in "
                              "its hyperparameters or options", allowed="one of them")
        return {**given, **values}

    @functools.cached_property
    def run_config(self) -> RunConfig:
        return RunConfig(self.values)

    @property
    def problem(self) -> Problem:
        """The server's view of the run (data, split, model, algorithm), built once."""
        return cached_problem(tuple(sorted(self.values.items())))

    def initial_arrays(self) -> ArrayRecord:
        """The model as ``seed`` initialises it, as an ``ArrayRecord`` of its ``state_dict``:
        the starting point that makes the run the same on every runtime (a model built without
        the seed starts elsewhere each time)."""
        return ArrayRecord(self.problem.model.flat.template.state_dict())

    def run(self, *, echo: bool = True) -> dict[str, Any]:
        """The same run on dpfl's in-process engine, on this machine, without Flower: the
        model Flower's runtimes give, bit for bit, from :meth:`initial_arrays`; returns the
        run's summary (``summary.json``). With ``num_clients=1`` it is centralized DP
        training of one dataset."""
        from dpfl.engine import run

        return run(self.run_config, echo=echo)

    def strategy(self) -> PrivateStrategy:
        """The server side, a Flower ``Strategy`` to ``start`` in a ServerApp."""
        return PrivateStrategy(self.problem)

    def client_app(self) -> ClientApp:
        """The client side: :func:`client_app` of this federation."""
        return client_app(self)


def client_app(federation: PrivateFederation | Callable[[Context], PrivateFederation]
               ) -> ClientApp:
    """The client side of ``federation``, or of the federation a function of the node's
    ``Context`` gives (built from the app's own run config, as the ServerApp builds it): a
    ``ClientApp`` that answers its runs, whatever run config Flower gives the app."""
    from dpfl.client.app import client_app as answering

    if isinstance(federation, PrivateFederation):
        return answering(lambda context: federation.values)
    return answering(lambda context: federation(context).values)


class PrivateStrategy(AlgorithmStrategy):
    """dpfl's strategy (:class:`~dpfl.strategies.AlgorithmStrategy`) on the user's model's own
    arrays: ``start`` takes the model's ``state_dict`` as an ``ArrayRecord`` and its result holds
    the trained model's, so that a ServerApp written for Flower's strategies keeps its shape."""

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """Run the federation from ``initial_arrays`` (the model's ``state_dict``; its
        trainable parameters are trained, the rest kept). Evaluation is the server's, on the
        test set of the federation's data (every ``eval-every`` rounds); ``evaluate_fn``, as
        Flower's strategies call it, is called then too with the model's ``state_dict``, and
        its metrics join the server's in ``Result.evaluate_metrics_serverapp``. The train and
        evaluate configs are not used. The results folder is closed, with ``stopped_early``,
        when Flower stops the ServerApp."""
        from dpfl.server.app import results_closed_first

        module = copy.deepcopy(self.problem.model.flat.template)
        module.load_state_dict(initial_arrays.to_torch_state_dict())
        trainable = [p for p in module.parameters() if p.requires_grad]
        x0 = torch.cat([p.detach().reshape(-1) for p in trainable]).to(torch.float32)

        def arrays(record: ArrayRecord) -> ArrayRecord:
            """The model's ``state_dict`` at the flat point ``record`` holds."""
            with torch.no_grad():
                for p, v in zip(trainable, from_record(record)["x"].split(
                        [p.numel() for p in trainable]), strict=True):
                    p.copy_(v.view_as(p))
            return ArrayRecord(module.state_dict())

        own = None if evaluate_fn is None else (
            lambda server_round, record: evaluate_fn(server_round, arrays(record)))
        with results_closed_first(self):
            result = super().start(grid, to_record({"x": x0}), num_rounds, timeout,
                                   evaluate_fn=own)
        result.arrays = arrays(result.arrays)
        return result
