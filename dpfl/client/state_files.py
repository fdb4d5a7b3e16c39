"""Client state on its own node's disk: what a resumed run's clients start from.

A client's algorithm state (momentum, error feedback, a kept message) and its provenance (the
digest of the exchanges it went through, :func:`~dpfl.client.node_ledger.input_digest`) never
leave its node. They live in the node's ``Context.state``, which a new run (a resumed one
included: ``flwr run`` gives it a new run id) starts empty. So with ``checkpoint-every > 0``
each client also writes them, after every round it takes part in, to

    <state-dir>/<run>/client-<id>/<round>-<segment>.pt

(written atomically), where ``<run>`` names the run and ``<segment>`` the attempt that wrote it
(:class:`~dpfl.checkpoint.Lineage`, sent by the server with every message). A client whose
``Context.state`` holds nothing for it (the run was resumed, or its SuperNode restarted) starts
from its newest file that belongs to the run's history: written by one of the run's segments
before the next took over, so never by an interrupted attempt after the checkpoint its
successor resumed from. A client with no such file starts afresh (it had not taken part yet,
or its files are gone). Its ledger is not here: a resume must not roll it back
(:mod:`dpfl.client.node_ledger`).

``state-dir`` is the node config key ``state-dir``, else ``$DPFL_STATE_DIR``, else
``$XDG_STATE_HOME/dpfl`` (default ``~/.local/state/dpfl``). A client keeps, besides its newest
file, the newest one as of each round a resume may start from (the last two checkpoint rounds
and its segment's start); a finished run's folder can be deleted once it will not be extended.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from dpfl.algorithms import State
from dpfl.atomic import write_atomically
from dpfl.checkpoint import Lineage

log = logging.getLogger("dpfl")

STATE_DIR_ENV = "DPFL_STATE_DIR"


def state_folder(node_config: Mapping[str, object]) -> Path:
    """Where this node keeps its clients' state files (see the module docstring)."""
    if node_config.get("state-dir"):
        return Path(str(node_config["state-dir"])).expanduser()
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV]).expanduser()
    home = os.environ.get("XDG_STATE_HOME") or "~/.local/state"
    return Path(home).expanduser() / "dpfl"


@functools.cache
def _warn_unwritable(folder: Path, error: str) -> None:
    log.warning("dpfl: the client state folder %s cannot be written (%s): a resumed run will "
                "start this node's clients afresh; set node config state-dir or %s", folder,
                error, STATE_DIR_ENV)


class StateFiles:
    """The state files of one run's clients on this node, in ``folder``; ``every`` is the
    run's ``checkpoint-every``."""

    def __init__(self, folder: Path, lineage: Lineage, every: int) -> None:
        self.folder = folder / lineage.run
        self.lineage = lineage
        self.every = every

    def _entries(self, client: int) -> list[tuple[int, Path]]:
        """The client's files of the run's history, ``(round, path)`` oldest first; the
        others (an interrupted attempt's) are deleted."""
        kept = []
        for path in (self.folder / f"client-{client}").glob("*.pt"):
            server_round, _, segment = path.stem.partition("-")
            if server_round.isdigit() and self.lineage.holds(int(server_round), segment):
                kept.append((int(server_round), path))
            else:
                path.unlink(missing_ok=True)
        return sorted(kept)

    def load(self, client: int) -> tuple[State, str] | None:
        """The client's newest state and its provenance digest of the run's history, or
        None."""
        for _, path in reversed(self._entries(client)):
            try:
                saved = torch.load(path, weights_only=True)
                return saved["state"], saved["chain"]
            except (OSError, RuntimeError, EOFError, KeyError):  # unreadable: an older one
                continue
        return None

    def save(self, client: int, server_round: int, state: State, chain: str) -> None:
        """Write the client's state and its provenance digest after ``server_round`` (when the run
        checkpoints), then drop the files no resume can start from."""
        if not self.every:
            return
        path = self.folder / f"client-{client}" / f"{server_round:06d}-{self.lineage.current}.pt"
        try:
            write_atomically(path, lambda p: torch.save({"state": state, "chain": chain}, p))
        except OSError as error:
            _warn_unwritable(self.folder, str(error))
            return
        entries = self._entries(client)
        # the latest checkpoint round, and the one before
        last = server_round // self.every * self.every
        needed = {entries[-1][1]}
        for start in (last, last - self.every, self.lineage.start):
            older = [p for r, p in entries if r <= start]
            if older:
                needed.add(older[-1])
        for _, old in entries:
            if old not in needed:
                old.unlink(missing_ok=True)
