"""The results folder of a run: config, per-round records, summary, model, plots.

``<results-dir>/<run-name>/`` receives ``config.json`` when the run starts (after
every input has been validated), one line of ``rounds.jsonl`` per round, and
``summary.json``, ``model.pt`` and PNG plots when it ends (``checkpoint/`` holds a run's
checkpoint: :mod:`dpfl.checkpoint`).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import torch

from dpfl.errors import ConfigError
from dpfl.runconfig import RunConfig

#: seconds an interrupted ServerApp gets to close its results folder (plot, model, summary)
#: before the processes around it are killed: Flower's exit waits this long for it, and
#: ``dpfl flower`` waits this long (and a little more) before it kills what it started
CLOSE_WAIT = 30.0


def jsonable(value: Any) -> Any:
    """Floats that JSON can hold: ±inf and NaN become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def run_name(config: RunConfig, runtime: str) -> str:
    """``run-name``, else ``algorithm-dataset-sSEED-runtime-time``, portable on every platform
    (a ``module:callable`` dataset's colon becomes a dash)."""
    if config.run.run_name:
        return config.run.run_name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dataset = re.sub(r"[^\w.-]", "-", config.data.dataset)
    return f"{config.run.algorithm}-{dataset}-s{config.run.seed}-{runtime}-{stamp}"


def results_path(config: RunConfig, runtime: str) -> Path:
    """The run's folder. A given ``run-name`` that already holds a run is refused; an
    automatic name gets a numeric suffix instead."""
    base = Path(config.run.results_dir).expanduser() / run_name(config, runtime)
    path, n = base, 1
    while (path / "config.json").exists():
        if config.run.run_name:
            raise ConfigError("run-name", f"results folder {path} already holds a run",
                              allowed="a new name, or empty for an automatic one")
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _line(record: dict[str, Any]) -> str:
    return json.dumps(jsonable(record)) + "\n"


class ResultsWriter:
    """Writes one run's results folder.

    ``rounds``: a resumed run's records so far (its checkpoint's): the folder is reopened,
    ``rounds.jsonl`` rewritten with them (dropping what an interrupted attempt wrote after its
    checkpoint) and appended to, and an earlier attempt's ``summary.json`` removed (the run is
    not finished)."""

    def __init__(self, path: Path, config: RunConfig, meta: dict[str, Any],
                 rounds: list[dict[str, Any]] | None = None) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self.rounds = list(rounds or [])
        if rounds is not None:
            (path / "summary.json").unlink(missing_ok=True)
        (path / "config.json").write_text(json.dumps(
            {"run_config": config.as_dict(), **jsonable(meta)}, indent=2))
        (path / "rounds.jsonl").write_text("".join(map(_line, self.rounds)))
        # line-buffered: every round is on disk as soon as it ends, without reopening the file
        self._rounds_file = (path / "rounds.jsonl").open("a", buffering=1)

    def add_round(self, record: dict[str, Any]) -> None:
        self.rounds.append(record)
        self._rounds_file.write(_line(record))

    def finish(self, summary: dict[str, Any], state_dict: dict[str, torch.Tensor], *,
               title: str, chance: float | None, plot: bool = True) -> None:
        """The plot (``summary.png``, named ``title``, ``chance`` the chance accuracy; where
        ``plot``) and the model first, ``summary.json`` last: its presence marks a finished run
        (``dpfl reproduce`` reuses such runs). The model is saved on the CPU whatever the run's
        device, so that it loads anywhere."""
        self._rounds_file.close()
        if plot:
            from dpfl.plots import plot_summary

            plot_summary(self.rounds, self.path, title=title, chance=chance)
        torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, self.path / "model.pt")
        (self.path / "summary.json").write_text(json.dumps(jsonable(summary), indent=2))
