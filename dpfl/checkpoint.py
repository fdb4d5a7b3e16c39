"""Checkpoints: what a run needs to continue where it stopped, bit for bit.

A run with ``checkpoint-every=N`` writes ``checkpoint/state.pt`` into its results folder after
every N-th round and after its last one: the server state, the client states the server holds
(every client's in the engine; none under Flower, where each client keeps its own on its node,
:mod:`dpfl.client.state_files`), the ledgers, the rounds' records, warnings and checks, and the
run's :class:`Lineage`. Every random draw is keyed by (seed, client, round, purpose)
(:mod:`dpfl.privacy.randomness`; client sampling included), so the round is the only position
of the run's randomness that a checkpoint needs. It is written atomically: a run killed while
writing it keeps the previous one.

``resume=true`` (``dpfl run --resume FOLDER``) continues the run in ``results-dir/run-name``
from its checkpoint. The configuration must be the checkpoint's, but for the keys that say
where the run is written and how it waits (:data:`FREE`) and ``num-server-rounds``, which may
change (to at least the rounds the checkpoint holds) when the calibrated noise does not depend
on it (the round loop compares the releases).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpfl.atomic import write_atomically
from dpfl.config import Value, format_overrides
from dpfl.errors import ConfigError, UsageError
from dpfl.runconfig import RunConfig

CHECKPOINT = Path("checkpoint") / "state.pt"
ROUNDS = "num-server-rounds"
#: where each runtime's client states are, and so how its runs resume
WHERE = {"engine": "the engine, whose checkpoint holds its clients' states: resume it with "
                   "dpfl run",
         "flower": "Flower, whose clients keep their states on their nodes: resume it with "
                   "dpfl flower (or flwr run with resume=true)"}
#: keys a resumed run may change: how often it checkpoints and how long it waits
CHANGEABLE = ("checkpoint-every", "round-timeout")
#: keys that say where a run is written and how it waits, not what it computes
FREE = ("resume", "results-dir", "run-name", *CHANGEABLE)


@dataclass(frozen=True)
class Lineage:
    """The segments of a run: its start and each resume, as ``(id, round it started after)``,
    oldest first; the first id names the run. A client's state written after ``server_round`` by a
    segment belongs to the run's history when that segment ran that round before the next
    segment took over (:meth:`holds`): what an interrupted attempt wrote after the checkpoint
    its successor resumed from does not."""

    segments: tuple[tuple[str, int], ...]

    @classmethod
    def fresh(cls) -> Lineage:
        return cls(((secrets.token_hex(8), 0),))

    def resumed(self, server_round: int) -> Lineage:
        """The lineage of a resume from the checkpoint of ``server_round``."""
        return Lineage((*self.segments, (secrets.token_hex(8), server_round)))

    @property
    def run(self) -> str:
        return self.segments[0][0]

    @property
    def current(self) -> str:
        return self.segments[-1][0]

    @property
    def start(self) -> int:
        """The round the current segment started after (0 for a fresh run)."""
        return self.segments[-1][1]

    def holds(self, server_round: int, segment: str) -> bool:
        """Whether state written after ``server_round`` by ``segment`` is part of this run."""
        ends = [start for _, start in self.segments[1:]] + [math.inf]
        return any(name == segment and start < server_round <= end
                   for (name, start), end in zip(self.segments, ends, strict=True))


def folder_of(config: RunConfig) -> Path:
    """The results folder ``resume=true`` continues: ``results-dir/run-name``."""
    if not config.run.run_name:
        raise ConfigError("run-name", "resume=true needs the name of the run to continue",
                          allowed="the run's folder name in results-dir")
    return Path(config.run.results_dir).expanduser() / config.run.run_name


def resume_overrides(folder: Path, given: Mapping[str, Value]) -> dict[str, Value]:
    """The run config that continues the run in ``folder``: its ``config.json``, then the
    keys ``given`` (``dpfl run --resume FOLDER -c …``), then ``resume=true`` and the folder."""
    try:
        saved = json.loads((folder / "config.json").read_text())["run_config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"--resume: {folder} is not the results folder of a run (it has no "
                         f"readable config.json)") from None
    folder = folder.expanduser().resolve()
    return {**saved, **given, "resume": True, "results-dir": str(folder.parent),
            "run-name": folder.name}


def load(config: RunConfig, runtime: str) -> dict[str, Any]:
    """The checkpoint of the run ``config`` resumes, checked against ``config`` and
    ``runtime``; raises :class:`ConfigError` (one line naming the key) where it cannot be
    resumed so."""
    folder = folder_of(config)
    path = folder / CHECKPOINT
    if not path.is_file():
        raise ConfigError("resume", f"{folder} holds no checkpoint (the run had "
                          f"checkpoint-every=0, or stopped before its first checkpoint)",
                          allowed="the folder of a run with checkpoint-every > 0")
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as exc:  # a damaged file: say which, without a traceback
        raise ConfigError("resume", f"{path} cannot be read ({type(exc).__name__}: "
                          f"{exc})") from None
    if saved["runtime"] != runtime:
        raise ConfigError("resume", f"the run in {folder} ran on {WHERE[saved['runtime']]}")
    check_config(saved["run_config"], config, int(saved["round"]))
    done = int(saved["round"])
    if done >= int(config[ROUNDS]) and (folder / "summary.json").exists():
        if calibrated_for_rounds(config):
            raise ConfigError(ROUNDS, f"the run in {folder} has completed its {done} rounds, "
                              f"with noise calibrated for ε={config.privacy.epsilon:g} over them: "
                              f"{EXTEND}", allowed="a new run (another run-name)")
        raise ConfigError(ROUNDS, f"the run in {folder} has completed its {done} rounds; "
                          f"raise num-server-rounds to continue it",
                          allowed=f"more than {done}")
    return saved


#: what can be extended, said once wherever a resume asks for more rounds
EXTEND = ("a longer run needs noise calibrated for its own rounds, i.e. a new run; a run that "
          "sets noise-multiplier (or a calibration without an ε target) can be resumed with "
          "more rounds")


def calibrated_for_rounds(config: RunConfig) -> bool:
    """Whether ``config``'s noise is calibrated for an ε over its rounds (so more rounds would
    need more noise)."""
    from dpfl.algorithms import ALGORITHMS
    from dpfl.privacy import CALIBRATIONS

    algorithm = ALGORITHMS.get(config.run.algorithm)
    return (config.privacy.noise_multiplier < 0 and not algorithm.noise_free
            and CALIBRATIONS.get(config.privacy.calibration, algorithm.name).targets_epsilon)


def check_config(saved: Mapping[str, Value], config: RunConfig, rounds_done: int) -> None:
    """Refuse a configuration that differs from the checkpoint's ``saved`` in a key that
    decides what the run computes (all but :data:`FREE`), or that ends before the
    ``rounds_done`` the checkpoint holds."""
    for key, value in config.as_dict().items():
        if key in FREE or key not in saved:
            continue
        if key == ROUNDS:
            if int(value) < rounds_done:
                raise ConfigError(key, f"{value} is fewer than the {rounds_done} rounds the "
                                  f"checkpoint holds", allowed=f"at least {rounds_done}")
        elif value != saved[key]:
            raise ConfigError(key, f"{format_overrides({key: value})} differs from the "
                              f"checkpointed run's: a resumed run keeps its configuration (only "
                              f"{', '.join((ROUNDS, *CHANGEABLE))} may change)",
                              allowed=format_overrides({key: saved[key]}))


def save(folder: Path, checkpoint: dict[str, Any]) -> None:
    """Write ``checkpoint`` (plain containers and CPU tensors) as ``folder``'s checkpoint,
    atomically."""
    write_atomically(folder / CHECKPOINT, lambda p: torch.save(checkpoint, p))
