"""The ``dpfl reproduce <paper> <experiment>`` registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dpfl_reproductions.lab import Lab
from dpfl.registry import Registry


@dataclass(frozen=True)
class Experiment:
    """One reproduction: ``run(lab)`` runs it and returns the report title. ``axes`` are the
    names ``dpfl reproduce --only`` may restrict (e.g. ``epsilon``)."""

    paper: str
    name: str
    summary: str
    run: Callable[[Lab], str]
    axes: tuple[str, ...] = ()


EXPERIMENTS: Registry = Registry("experiment")


def experiment(paper: str, name: str, summary: str, axes: tuple[str, ...] = ()
               ) -> Callable[[Callable[[Lab], str]], Callable[[Lab], str]]:
    """Decorator registering ``fn`` as experiment ``paper/name``."""

    def add(fn: Callable[[Lab], str]) -> Callable[[Lab], str]:
        EXPERIMENTS.add(f"{paper}/{name}", Experiment(paper, name, summary, fn, axes))
        return fn

    return add
