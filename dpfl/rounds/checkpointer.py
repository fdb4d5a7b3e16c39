"""The checkpointer: where a run is written, whether it resumes, and when it checkpoints
(:mod:`dpfl.checkpoint` holds the file format and the configuration checks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpfl import checkpoint
from dpfl.checkpoint import Lineage
from dpfl.config import format_overrides
from dpfl.errors import ConfigError
from dpfl.results import results_path
from dpfl.runconfig import RunConfig


class Checkpointer:
    """A run's checkpoints: with ``resume=true`` the checkpoint it resumes (:attr:`resumed`,
    loaded and checked against the configuration here, before anything starts), its results
    folder (:attr:`path`) and :class:`~dpfl.checkpoint.Lineage`; with ``checkpoint-every=N``
    a checkpoint after every N-th round and the last."""

    def __init__(self, config: RunConfig, runtime: str) -> None:
        self.config = config
        self.every = config.run.checkpoint_every
        self.resumed: dict[str, Any] | None = (checkpoint.load(config, runtime)
                                               if config.run.resume else None)
        self.path: Path = (checkpoint.folder_of(config) if self.resumed
                           else results_path(config, runtime))
        self.lineage = Lineage.fresh()
        if self.resumed is not None:
            self.lineage = Lineage(tuple((str(s), int(r)) for s, r in self.resumed["segments"])
                                   ).resumed(int(self.resumed["round"]))

    def check_releases(self, releases: dict[str, Any]) -> None:
        """Refuse to resume with other releases than the checkpoint ran with: a changed
        ``num-server-rounds`` whose calibrated noise depends on it."""
        if self.resumed is None or self.resumed["releases"] == releases:
            return
        rounds = self.resumed["run_config"]["num-server-rounds"]
        if rounds == self.config.run.num_server_rounds:
            raise ConfigError("resume", "the run's calibrated releases differ from the "
                              "checkpointed run's (another version of dpfl?)")
        raise ConfigError("num-server-rounds", f"the run's noise was calibrated for its "
                          f"{rounds} rounds: {checkpoint.EXTEND}",
                          allowed=f"{format_overrides({'num-server-rounds': rounds})} to "
                          f"resume it as it was")

    def interrupted(self, rounds_done: int) -> int:
        """The last round an interrupted attempt may have released after its checkpoint of
        ``rounds_done`` rounds: the last it recorded in ``rounds.jsonl``, plus the one it was
        in (at most the run's last)."""
        try:
            lines = (self.path / "rounds.jsonl").read_text().splitlines()
            last = max([rounds_done, *(int(json.loads(line)["round"]) for line in lines)])
        except (OSError, ValueError, KeyError):
            last = rounds_done
        return min(last + 1, self.config.run.num_server_rounds)

    def due(self, server_round: int) -> bool:
        """Whether the run checkpoints after ``server_round``."""
        return bool(self.every) and (server_round % self.every == 0
                                     or server_round == self.config.run.num_server_rounds)

    def save(self, server_round: int, state: dict[str, Any]) -> None:
        """Checkpoint ``state`` (the run's parts, each its own ``state_dict``) after
        ``server_round``."""
        checkpoint.save(self.path, {
            "round": server_round, "run_config": self.config.as_dict(),
            "segments": [list(s) for s in self.lineage.segments], **state})
