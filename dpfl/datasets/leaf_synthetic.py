"""LEAF's Synthetic(α, β): a cross-device task with one distribution per client.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous
Networks" (FedProx), MLSys 2020, §5.1 and App. C.1, the generator LEAF ships (Caldas et al.,
"LEAF: A Benchmark for Federated Settings", arXiv:1812.01097). Client k draws
u_k ~ N(0, α) and B_k ~ N(0, β), then its model W_k ∈ R^{K×d} and b_k ∈ R^K with entries
N(u_k, 1), and its inputs' centre v_k ∈ R^d with entries N(B_k, 1); each of its samples is
x ~ N(v_k, Σ), Σ = diag(j^−1.2), labelled y = argmax(W_k x + b_k). α sets how much the
clients' models differ, β how much their inputs do; Synthetic(0, 0) is the IID-like corner
the papers call "Synthetic IID" only when W and v are shared, which this generator does not do.
A client's sample count is ⌊lognormal(4, 2)⌋ + 50 (LEAF's), capped at ``max_samples``.

With independent models W_k, nothing is shared across clients but the input's scales: over a
large population a single global model has nothing to learn (by symmetry every label is equally
likely given x, so accuracy is chance, 10%), whatever the training. The papers use 30 clients,
whose test samples come from the same 30 models. ``iid=true`` is FedProx's Synthetic IID
(its ``synthetic_iid`` generator): one W and b, N(0, 1) entries drawn from the run seed's own
stream, label every client's samples, and every client's inputs are centred at 0; α and β are
then unused. The clients still draw their counts and samples from their own streams, the same
counts as without ``iid``. That task is a population with one shared model, learnable at any
size: the cross-device benchmark's.

Every client is drawn from its own stream (the run seed and its index), so its data do not
depend on how many clients the population has: the first n clients of a larger population
are the same n clients. Each client keeps the last ``test_fraction`` of its samples (at least
one) as test data, and before that ``validation_fraction`` of the rest as validation data;
the server evaluates on the union of the clients' test (validation) samples, and the training
rows, client after client, are the natural split (``partitioner="natural"``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from dpfl.datasets.base import Dataset
from dpfl.datasets.loading import DATASETS, positive_int
from dpfl.datasets.population import Population
from dpfl.errors import ConfigError


def fraction(key: str, value: object, high: float) -> float:
    """``value`` as a float in [0, ``high``), or a ConfigError for the option ``key``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < high:
        raise ConfigError(key, f"must be a number in [0, {high:g}), got {value!r}",
                          allowed=f"0 <= {key} < {high:g}")
    return float(value)


@functools.cache
def shared_model(seed: int, dim: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic IID's one (W, b), entries N(0, 1), from the run seed's own stream (entropy
    ``[seed]``, apart from every client's ``[seed, k]``)."""
    rng = np.random.default_rng([seed])
    return rng.normal(0.0, 1.0, size=(classes, dim)), rng.normal(0.0, 1.0, size=classes)


def client_samples(seed: int, client: int, *, alpha: float, beta: float, dim: int,
                   classes: int, max_samples: int, iid: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Client ``client``'s samples ``([n, dim] float32, [n] int64)`` from its own stream;
    ``iid``: labelled by :func:`shared_model`, centred at 0."""
    rng = np.random.default_rng([seed, client])
    u, shift = rng.normal(0.0, np.sqrt(alpha)), rng.normal(0.0, np.sqrt(beta))
    weights = rng.normal(u, 1.0, size=(classes, dim))
    bias = rng.normal(u, 1.0, size=classes)
    centre = rng.normal(shift, 1.0, size=dim)
    if iid:  # the client's own draws above are made all the same: its count and samples follow
        (weights, bias), centre = shared_model(seed, dim, classes), np.zeros(dim)
    n = min(max_samples, int(rng.lognormal(4.0, 2.0)) + 50)
    scale = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # √(j^−1.2)
    x = centre + rng.standard_normal((n, dim)) * scale
    y = np.argmax(x @ weights.T + bias, axis=1)
    return x.astype(np.float32), y.astype(np.int64)


Splits = dict[str, tuple[np.ndarray, np.ndarray]]


def client_splits(seed: int, client: int, *, alpha: float, beta: float, test_share: float,
                  validation_share: float, iid: bool, **shape: int) -> Splits:
    """Client ``client``'s samples split: the last ``test_share`` (at least one) for testing,
    ``validation_share`` of the rest before them for validation, the others for training."""
    x, y = client_samples(seed, client, alpha=alpha, beta=beta, iid=iid, **shape)
    held = max(1, int(round(test_share * len(y))))
    rest = len(y) - held
    checked = int(round(validation_share * rest))
    if rest - checked < 1:
        raise ConfigError("max-samples", f"client {client} keeps no training sample of its "
                          f"{len(y)}", allowed="a larger max-samples, or smaller fractions")
    bounds = {"train": (0, rest - checked), "validation": (rest - checked, rest),
              "test": (rest, len(y))}
    return {split: (x[start:end], y[start:end]) for split, (start, end) in bounds.items()}


@DATASETS.register("leaf-synthetic")
def load_leaf_synthetic(*, seed: int, num_clients: int = 1000, alpha: float = 1.0,
                        beta: float = 1.0, dim: int = 60, classes: int = 10,
                        max_samples: int = 1000, test_fraction: float = 0.1,
                        validation_fraction: float = 0.0, lazy: bool = False,
                        eval_clients: int = 1000, iid: bool = False) -> Dataset:
    """Synthetic(``alpha``, ``beta``) over ``num_clients`` clients, or with ``iid`` Synthetic
    IID (see the module docstring); task ``"classification"``, natural split one block of rows
    per client.
    ``lazy``: the clients' training rows are made when a round needs them
    (:class:`~dpfl.datasets.population.Population`), and the test (validation) set is the
    union of the first ``eval_clients`` clients' test (validation) samples."""
    clients = positive_int("num-clients", num_clients)
    options = {"alpha": alpha, "beta": beta}
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(key, f"must be a number >= 0, got {value!r}", allowed=">= 0")
    test_share = fraction("test-fraction", test_fraction, 1.0)
    validation_share = fraction("validation-fraction", validation_fraction, 1.0)
    shape = {"dim": positive_int("dim", dim), "classes": positive_int("classes", classes),
             "max_samples": positive_int("max-samples", max_samples)}
    if not isinstance(iid, bool):
        raise ConfigError("iid", f"must be true or false, got {iid!r}", allowed="true, false")
    split = functools.partial(client_splits, seed, alpha=float(alpha), beta=float(beta),
                              test_share=test_share, validation_share=validation_share,
                              iid=iid, **shape)
    held_clients = min(clients, positive_int("eval-clients", eval_clients)) if lazy else clients
    splits: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {
        "train": [], "validation": [], "test": []}
    for k in range(held_clients):
        for name, rows in split(k).items():
            splits[name].append(rows)

    def joined(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*splits[split], strict=True)
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    (train_x, train_y), (test_x, test_y) = joined("train"), joined("test")
    validation = joined("validation") if validation_share else (None, None)
    if lazy:
        def make(client: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = split(client)["train"]
            return torch.from_numpy(x), torch.from_numpy(y)

        # LEAF's counts are at least 50 samples (or max-samples): the fewest training rows
        # any client keeps, which grow with the count
        fewest = min(50, shape["max_samples"])
        rest = fewest - max(1, int(round(test_share * fewest)))
        smallest = max(1, rest - int(round(validation_share * rest)))
        population = Population(clients, make, smallest)
        return Dataset("leaf-synthetic", train_x[:0], train_y[:0], test_x, test_y,
                       task="classification", num_classes=shape["classes"],
                       validation_x=validation[0], validation_y=validation[1],
                       population=population)
    return Dataset("leaf-synthetic", train_x, train_y, test_x, test_y, task="classification",
                   num_classes=shape["classes"],
                   client_sizes=tuple(len(y) for _, y in splits["train"]),
                   validation_x=validation[0], validation_y=validation[1])
