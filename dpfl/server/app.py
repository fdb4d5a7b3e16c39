"""The dpfl ``ServerApp``: validates the run config, then runs ``AlgorithmStrategy``.

Bad input, a federation that does not match the run, and a run stopped by lost clients print
one line ``dpfl: error: …`` and then raise :class:`RunFailed` with that line, so that Flower
marks the run ``finished:failed`` (``flwr ls``) rather than completed; Flower logs the exception
with its traceback after the line. ``dpfl flower`` validates the run config and sizes the
federation before it submits a run, and exits non-zero on any status but completed."""

from __future__ import annotations

import logging
import sys

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from dpfl.errors import ConfigError
from dpfl.problem import cached_problem
from dpfl.runconfig import RunConfig, check_runtime
from dpfl.strategies import AlgorithmStrategy, FederationError
from dpfl.strategies.algorithm import to_record

app = ServerApp()
log = logging.getLogger("dpfl")


class RunFailed(RuntimeError):
    """The run stopped on an error already explained by a ``dpfl: error:`` line."""


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        config = RunConfig(context.run_config)
        check_runtime(config, "flower")
        # the run config as given: keys left at "auto" stay so (the driver names their values)
        problem = cached_problem(tuple(sorted(context.run_config.items())))
        strategy = AlgorithmStrategy(problem)
        strategy.start(grid=grid, initial_arrays=to_record({"x": problem.x0}),
                       num_rounds=int(config["num-server-rounds"]))
    except (ConfigError, FederationError) as exc:
        print(f"dpfl: error: {exc}", file=sys.stderr, flush=True)
        raise RunFailed(str(exc)) from None
