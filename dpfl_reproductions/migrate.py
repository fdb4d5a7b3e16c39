"""Carry a run archive across a change of run-config keys, checked by re-running a sample.

An archive (``runs.jsonl.gz``, :mod:`dpfl_reproductions.lab`) names each run by a hash of its
configuration, so a change of the keys an experiment passes (a key that is now required, or one
that is gone) would make every archived run look unfinished. When the change does not change
what a run computes, the archive can be migrated instead of re-run::

    python -m dpfl_reproductions.migrate reports/clip21-logreg/runs.jsonl.gz \\
        --set 'non-private-diagnostics=true' --check 5

Every configuration gets the ``--set`` keys (``flwr run --run-config`` syntax) and loses the
``--drop`` keys, and must then be a valid run configuration; with ``--where KEY=VALUE`` only the
configurations holding those values do (a key only some algorithms read, e.g.
``--where 'algorithm="rpdp-sgd"' --set 'random-basis="qr"'``), the others are kept as they are.
Then ``--check`` of the migrated runs, drawn at random (``--seed``), run again with the
migrated configuration on the engine, and their final results (:data:`CHECKED`, as a summary
file holds them) must equal the archived ones exactly; only then is the archive rewritten under
the new keys (``--output``, the archive itself by default). A field whose meaning the code
change altered (``--changed``) is not compared and is dropped from the migrated summaries, so
nothing reads a stale value. Numbers an experiment
derived from a run's rounds (``derived``) are carried over: a run whose final model is bitwise
the same went through the same rounds.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dpfl.config import Value, parse_overrides
from dpfl.errors import ConfigError, UsageError
from dpfl_reproductions.lab import one_thread, read_archive, run_key, write_archive
from dpfl.results import jsonable
from dpfl.runconfig import RunConfig

# The archived summary fields a re-run must reproduce exactly (wall times may differ).
CHECKED = ("rounds_completed", "stopped_early", "test_loss", "test_accuracy", "epsilon_max")


def migrated(config: Mapping[str, Value], changes: Mapping[str, Value],
             drop: Sequence[str]) -> dict[str, Value]:
    out = {k: v for k, v in config.items() if k not in drop}
    out.update(changes)
    return out


def check(runs: dict[str, dict[str, Any]], sample: int, seed: int,
          changed: Sequence[str] = ()) -> list[str]:
    """Re-run ``sample`` of the migrated ``runs`` (key -> config, summary) on the engine and
    compare :data:`CHECKED` but the ``changed`` fields; the lines describing each comparison
    (raises :class:`UsageError` on a mismatch)."""
    from dpfl.engine import run

    picked = random.Random(seed).sample(sorted(runs), min(sample, len(runs)))
    fields = [f for f in CHECKED if f not in changed]
    lines = []
    with tempfile.TemporaryDirectory() as folder, one_thread():
        for key in picked:
            config, archived = runs[key]["config"], runs[key]["summary"]
            summary = jsonable(run(RunConfig({**config, "results-dir": folder,
                                              "run-name": key}), echo=False))
            differ = [f for f in fields if f in archived and archived[f] != summary[f]]
            if differ:
                raise UsageError(f"run {key} computes something else under the migrated keys: "
                                 + ", ".join(f"{f} {archived[f]!r} -> {summary[f]!r}"
                                             for f in differ))
            lines.append(f"{key}: " + ", ".join(f"{f}={summary[f]!r}" for f in fields
                                                  if f in archived) + " (equal)")
    return lines


def migrate(path: Path, *, changes: Mapping[str, Value], drop: Sequence[str], sample: int,
            changed: Sequence[str] = (), seed: int = 0, output: Path | None = None,
            where: Mapping[str, Value] | None = None, echo: bool = True) -> Path:
    """Migrate the archive ``path`` (see the module docstring); returns the path written."""
    runs = read_archive(path)
    moved: dict[str, tuple[dict[str, Value], dict[str, Any]]] = {}
    kept: dict[str, tuple[dict[str, Value], dict[str, Any]]] = {}
    for key, record in runs.items():
        if where and any(record["config"].get(k) != v for k, v in where.items()):
            kept[key] = (record["config"], record["summary"])
            continue
        config = migrated(record["config"], changes, drop)
        try:
            RunConfig(config)
        except ConfigError as exc:
            raise UsageError(f"{path}: a migrated configuration is not valid: {exc}") from None
        summary = {k: v for k, v in record["summary"].items() if k not in changed}
        moved[run_key(config)] = (config, summary)
    if not moved:
        raise UsageError(f"{path}: no run matches --where "
                         + " ".join(f"{k}={v!r}" for k, v in (where or {}).items()))
    if len(moved) + len(kept) < len(runs) or moved.keys() & kept.keys():
        raise UsageError(f"{path}: the migration maps {len(runs)} runs onto "
                         f"{len(moved.keys() | kept.keys())} configurations; it would merge "
                         "different runs")
    lines = check({k: {"config": c, "summary": s} for k, (c, s) in moved.items()}, sample, seed,
                  changed)
    if echo:
        print("\n".join(lines), flush=True)
    written = write_archive(output or path, {**kept, **moved})
    if echo:
        print(f"migrated {len(moved)} runs ({len(lines)} re-run and equal), kept {len(kept)} "
              f"as they were, to {written}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpfl_reproductions.migrate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("archive", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE ...",
                        help="keys every configuration gets (flwr run --run-config syntax)")
    parser.add_argument("--drop", action="append", default=[], metavar="KEY",
                        help="a key every configuration loses")
    parser.add_argument("--where", action="append", default=[], metavar="KEY=VALUE ...",
                        help="migrate only the configurations holding these values")
    parser.add_argument("--changed", action="append", default=[], metavar="FIELD",
                        choices=CHECKED, help="a summary field whose meaning changed: not "
                        "compared, dropped from the migrated summaries")
    parser.add_argument("--check", type=int, default=5, metavar="N",
                        help="runs re-run and compared before anything is written (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="draws the checked runs")
    parser.add_argument("--output", type=Path, default=None,
                        help="where to write the migrated archive (default: in place)")
    args = parser.parse_args(argv)
    try:
        if args.check < 1:
            raise UsageError("--check: at least one run must be re-run (allowed: 1, 2, ...)")
        changes = parse_overrides(args.set) if args.set else {}
        if not changes and not args.drop:
            raise UsageError("nothing to migrate: give --set KEY=VALUE or --drop KEY")
        where = parse_overrides(args.where) if args.where else None
        migrate(args.archive, changes=changes, drop=args.drop, sample=args.check,
                changed=args.changed, seed=args.seed, output=args.output, where=where)
    except (ConfigError, UsageError) as exc:
        print(f"dpfl: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
