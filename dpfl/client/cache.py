"""The node-local cache: what a SuperNode's ClientApp prepares once and reads every message.

Flower's SuperNode starts a fresh ClientApp process for every message it pulls, so whatever
the ClientApp builds in memory is gone after each reply. A node therefore keeps, under
``nodes`` in dpfl's per-user cache folder (``$DPFL_CACHE_DIR``, default ``~/.cache/dpfl`` on
Linux; :func:`dpfl.folders.user_cache`):

* ``data-<key>.pt``: its clients' training rows and the public records
  (:meth:`Problem.node_data`), keyed by the settings that decide them
  (:func:`dpfl.problem.data_key`), the clients it hosts, the data folder and the size and time
  of every file in it (two levels deep) and of the file a dataset option ``path`` names, and
  dpfl's version; for a node with its own data
  (node config ``data-path``), keyed by that file, its size and time. Built on the first
  message (load the dataset, partition it, keep the node's rows), memory-mapped by the later
  ones: a dataset is never loaded or re-partitioned per message.
* ``releases-<key>.json``: the calibrated noise of its clients and the server's, keyed by the
  whole run config (but ``results-dir`` and ``run-name``), so that a message does not load an
  accountant to recalibrate.

The model, algorithm and initial point are rebuilt from the run config each message (cheap,
seeded, the same as the server's). Files are written atomically (a temporary file, then a
rename), so nodes sharing the folder never read half a file; an unreadable entry is rebuilt;
the most recently used data entries are kept up to :data:`KEEP_BYTES` (2 GiB) in all, the
newest :data:`KEEP_RELEASES` releases entries. Deleting the folder is always safe. Where the
folder cannot be written, the node works without it and warns once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from dpfl.atomic import write_atomically
from dpfl.config import parse_options
from dpfl.datasets import arrays
from dpfl.datasets.loading import stamp
from dpfl.datasets.site import site_node_data
from dpfl.errors import ConfigError
from dpfl.folders import CACHE_DIR_ENV, user_cache
from dpfl.problem import Problem, cached_problem, data_dir, data_key
from dpfl.reference import is_reference
from dpfl.runconfig import RunConfig
from dpfl.version import __version__

log = logging.getLogger("dpfl")

KEEP_BYTES = 2 << 30  # data entries kept, the most recently used first (the newest always)
KEEP_RELEASES = 256  # releases entries kept, the most recently written first
OUTPUT_KEYS = ("results-dir", "run-name")  # run-config keys that change no node's work


def cache_folder() -> Path:
    """``nodes`` in dpfl's per-user cache folder, e.g. ``~/.cache/dpfl/nodes``."""
    return user_cache() / "nodes"


def _fingerprint(folder: str) -> list[tuple[str, int, int]]:
    """(path, size, mtime) of the files in ``folder`` and its subfolders, two levels deep."""
    found = []
    for depth in range(3):
        for path in sorted(Path(folder).glob("/".join(["*"] * (depth + 1)))):
            if path.is_file():
                stat = path.stat()
                found.append((str(path), stat.st_size, stat.st_mtime_ns))
    return found


def _named_file(config: RunConfig, source: str) -> tuple[int, int] | None:
    """Size and time of the file a dataset option ``path`` names (the ``npz`` dataset's, which
    may lie outside the data folder), None without one."""
    try:
        path = parse_options(config.data.dataset_options).get("path")
    except ValueError:  # the run's own checks name the key
        return None
    return stamp(arrays.source(str(path), Path(source))) if path else None


def _referenced_code(config: RunConfig) -> tuple[str, int, int] | None:
    """Path, size and time of the module a ``dataset="module:callable"`` reference names (its
    own file: what a user edits between runs), None for a registered dataset."""
    dataset = config.data.dataset
    if not is_reference(dataset):
        return None
    spec = importlib.util.find_spec(dataset.partition(":")[0])
    origin = spec.origin if spec is not None else None
    found = stamp(Path(origin)) if origin is not None else None
    return None if found is None else (origin, *found)


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[
        :32]


def _newest_first(folder: Path, pattern: str) -> list[tuple[Path, os.stat_result]]:
    entries = []
    for path in folder.glob(pattern):
        try:
            entries.append((path, path.stat()))
        except FileNotFoundError:  # pruned by another node meanwhile
            continue
    return sorted(entries, key=lambda e: e[1].st_mtime_ns, reverse=True)


def _prune(folder: Path) -> None:
    """Drop the least recently used data entries beyond :data:`KEEP_BYTES` in all, and the
    oldest releases entries beyond :data:`KEEP_RELEASES`."""
    total = 0
    for i, (path, stat) in enumerate(_newest_first(folder, "data-*.pt")):
        total += stat.st_size
        if i and total > KEEP_BYTES:
            path.unlink(missing_ok=True)
    for path, _ in _newest_first(folder, "releases-*.json")[KEEP_RELEASES:]:
        path.unlink(missing_ok=True)


@functools.cache
def _warn_unwritable(folder: Path, error: str) -> None:
    log.warning("dpfl: the node cache %s cannot be written (%s): every message rebuilds the "
                "node's data; set %s to a writable folder", folder, error, CACHE_DIR_ENV)


#: the layout of a node's cached split data (:meth:`Problem.node_data`); 2: with the split's
#: smallest client ("smallest"), which secure aggregation calibrates every client from
NODE_DATA_LAYOUT = 2


def _node_data(config: RunConfig, clients: tuple[int, ...], folder: Path,
               site: str) -> tuple[dict[str, Any], str]:
    """The node's data (:meth:`Problem.node_data`) and its key (what decides it)."""
    if site:
        source = str(Path(site).resolve())
        stat = Path(source).stat() if Path(source).is_file() else None
        key = _digest("site", source, stat and (stat.st_size, stat.st_mtime_ns),
                      config.data.dataset, config.data.num_partitions, clients, __version__)
    else:
        source = data_dir(config)
        key = _digest(data_key(config), clients, source, _fingerprint(source),
                      _named_file(config, source), _referenced_code(config), __version__,
                      NODE_DATA_LAYOUT)
    path = folder / f"data-{key}.pt"
    try:
        data = torch.load(path, mmap=True, weights_only=True)
        os.utime(path)
        return data, key
    except (OSError, RuntimeError, EOFError):  # not there yet, or unreadable: rebuild it
        pass
    data = (site_node_data(site, dataset=config.data.dataset, clients=list(clients),
                           num_clients=config.data.num_partitions) if site else
            cached_problem(tuple(sorted(config.as_dict().items()))).node_data(list(clients)))
    try:
        write_atomically(path, lambda p: torch.save(data, p))
        _prune(folder)
    except OSError as error:
        _warn_unwritable(folder, str(error))
    return data, key


@functools.lru_cache(maxsize=64)
def node_problem(items: tuple[tuple[str, object], ...], clients: tuple[int, ...],
                 site: str = "") -> Problem:
    """The run of config ``items`` as the node hosting ``clients`` sees it: their rows of the
    run's split or, given ``site`` (node config ``data-path``), the one client's own data
    (:mod:`dpfl.datasets.site`). Cached in-process too: a simulation's worker serves many
    messages of many virtual nodes."""
    config = RunConfig(dict(items))
    if site and not config.privacy.min_client_records:
        raise ConfigError("min-client-records", "a node with its own data (data-path) needs "
                          "the run's public lower bound on every client's records",
                          allowed=f"an integer >= batch-size "
                          f"({config.hyperparameters.batch_size})")
    folder = cache_folder()
    data, source = _node_data(config, clients, folder, site)
    problem = Problem.from_node_data(config, data)
    problem.source = source
    key = _digest({k: v for k, v in items if k not in OUTPUT_KEYS}, clients, site,
                  __version__)
    path = folder / f"releases-{key}.json"
    try:
        problem.restore_calibrations(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):  # not there yet, or unreadable
        for c in clients:
            problem.releases(c)
        problem.server_releases()
        try:
            write_atomically(path, lambda p: p.write_text(json.dumps(problem.calibrations())))
            _prune(folder)
        except OSError as error:
            _warn_unwritable(folder, str(error))
    return problem
