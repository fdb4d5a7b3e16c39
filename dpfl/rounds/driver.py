"""Driving round loops: :func:`drive` runs one over one transport; :func:`advance` takes one to
its next exchange, which is how :func:`dpfl.engine.many.run_fold` interleaves many."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from dpfl.rounds.loop import RoundLoop, Rounds
from dpfl.rounds.transport import ExchangeRequest, Request, Transport


@dataclass(frozen=True)
class Finished:
    """A round loop's end: the run's summary."""

    summary: dict[str, Any]


def answered(request: Request, transport: Transport) -> tuple[Any, BaseException | None]:
    """``request`` sent over ``transport``: its answer, or what sending it raised (for the
    round loop, which re-raises it after closing its results folder)."""
    try:
        return request.sent_over(transport), None
    except BaseException as exc:  # noqa: BLE001 - raised in the loop, which re-raises it
        return None, exc


def advance(rounds: Rounds, transport: Transport, answer: Any = None,
            error: BaseException | None = None) -> ExchangeRequest | Finished:
    """Send ``rounds`` the answer to its last request (or throw in ``error``, what answering
    it raised), then answer its requests from ``transport`` up to its next exchange request,
    which is returned, or to its end. What the loop raises (after closing its results folder)
    propagates."""
    while True:
        try:
            request = rounds.send(answer) if error is None else rounds.throw(error)
        except StopIteration as done:
            return Finished(done.value)
        if isinstance(request, ExchangeRequest):
            return request
        answer, error = answered(request, transport)


def drive(loop: RoundLoop, transport: Transport) -> dict[str, Any]:
    """Run ``loop`` to its end over ``transport``: every request it yields is answered by the
    transport, and what the transport raises is raised in the loop (which closes the results
    folder and goes on failing). Returns the run's summary."""
    rounds = loop.run()
    try:
        step = advance(rounds, transport)
        while isinstance(step, ExchangeRequest):
            step = advance(rounds, transport, *answered(step, transport))
    except BaseException as exc:
        if inspect.getgeneratorstate(rounds) == inspect.GEN_SUSPENDED:
            # raised here between the loop's steps (Ctrl-C at that moment), not by the loop:
            # thrown in, the loop closes its results folder and raises it again
            advance(rounds, transport, error=exc)
        raise
    return step.summary
