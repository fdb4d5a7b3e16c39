"""The dpfl ``ServerApp``: validates the run config, then runs ``AlgorithmStrategy``.

Bad input, a federation that does not match the run, and a run stopped by lost clients end
with one line ``dpfl: error: …`` and no traceback. The app then returns normally: Flower flushes
a ServerApp's log stream (what ``flwr run --stream`` shows) only on a normal return or an
exception, and an exception would print a traceback."""

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


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        config = RunConfig(context.run_config)
        check_runtime(config, "flower")
        problem = cached_problem(tuple(sorted(config.as_dict().items())))
        strategy = AlgorithmStrategy(problem)
        strategy.start(grid=grid, initial_arrays=to_record({"x": problem.x0}),
                       num_rounds=int(config["num-server-rounds"]))
    except (ConfigError, FederationError) as exc:
        print(f"dpfl: error: {exc}", file=sys.stderr, flush=True)
