"""The dpfl ``ServerApp``: validates the run config, then runs ``AlgorithmStrategy``.

Bad input, a federation that does not match the run, and a run stopped by lost clients print
one line ``dpfl: error: …`` and then raise :class:`RunFailed` with that line, so that Flower
marks the run ``finished:failed`` (``flwr ls``) rather than completed; Flower logs that the
ServerApp raised, without the traceback (:class:`Explained`). ``flwr run --stream`` exits 0
whatever the run's fate: ``flwr ls`` says how it ended. ``dpfl flower`` validates the run
config and sizes the federation before it submits a run, and exits non-zero on any status but
completed.

Flower ends a ServerApp whose SuperLink went away, or whose run was stopped, with a signal, and
its handler kills the process 5 s after it starts exiting; the ServerApp therefore takes the
signal first, closes the results folder, and only then hands it to Flower's handler."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from dpfl.errors import ConfigError
from dpfl.flower_internals import add_exit_handler
from dpfl.interrupt import wake_main_thread_when_parent_exits
from dpfl.problem import cached_problem
from dpfl.results import CLOSE_WAIT
from dpfl.rounds import Stopped
from dpfl.runconfig import RunConfig, check_runtime
from dpfl.strategies import AlgorithmStrategy, FederationError
from dpfl.strategies.algorithm import to_record

app = ServerApp()
log = logging.getLogger("dpfl")


class RunFailed(RuntimeError):
    """The run stopped on an error already explained by a ``dpfl: error:`` line."""


class Explained(logging.Filter):
    """Flower logs an app's exception with its traceback; a :class:`RunFailed` was explained
    in one line already, so its record keeps the line and loses the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RunFailed):
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("flwr").addFilter(Explained())


SIGNALS = (signal.SIGINT, signal.SIGTERM)



@contextmanager
def results_closed_first(strategy: AlgorithmStrategy) -> Iterator[None]:
    """SIGINT and SIGTERM, where Python handles them (Flower's exit), raise :class:`Stopped` in
    the round loop, which closes the results folder, and then go to those handlers; signals
    that come while the folder closes are ignored (Flower's parent monitor raises its own
    SIGINT late, once the exited SuperExec is reaped: it would start Flower's 5 s kill clock
    while the ledger's other accountants are still computing). Only the main thread takes signals: a ServerApp run in a
    thread (Flower's simulation runtime runs it so) registers with Flower's exit instead a
    handler that runs before its kill clock starts: it asks the strategy to stop (its exchange
    raises :class:`Stopped`, the round loop closes the results folder) and waits for that. In
    the main thread, the SIGINT of Flower's parent monitor is delivered to the main thread
    itself (:func:`~dpfl.interrupt.wake_main_thread_when_parent_exits`), or a ServerApp waiting
    on Flower's object transfers would outlive its SuperExec, retrying."""
    if threading.current_thread() is not threading.main_thread():
        closed = threading.Event()

        def stop_then_wait() -> None:
            strategy.request_stop(signal.SIGINT)
            closed.wait(timeout=CLOSE_WAIT)

        add_exit_handler(stop_then_wait, run_before_force_exit=True)
        try:
            yield
        except Stopped:
            pass  # Flower is exiting the process: the folder is closed
        finally:
            closed.set()
        return
    previous = {sig: handler for sig in SIGNALS if callable(handler := signal.getsignal(sig))}
    handled = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        handled.set()
        for sig in previous:  # the folder is closing: what comes now waits for it
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    for sig in previous:
        signal.signal(sig, stop)
    wake_main_thread_when_parent_exits(handled)
    try:
        yield
    except Stopped as stopped:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        previous[stopped.signum](stopped.signum, None)  # Flower's exit: raises SystemExit
        raise
    finally:
        handled.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        config = RunConfig(context.run_config)
        check_runtime(config, "flower")
        # the run config as given: keys left at "auto" stay so (the round loop names their values)
        problem = cached_problem(tuple(sorted(context.run_config.items())))
        strategy = AlgorithmStrategy(problem)
        with results_closed_first(strategy):
            strategy.start(grid=grid, initial_arrays=to_record({"x": problem.x0}),
                           num_rounds=config.run.num_server_rounds)
    except (ConfigError, FederationError) as exc:
        print(f"dpfl: error: {exc}", file=sys.stderr, flush=True)
        raise RunFailed(str(exc)) from None
