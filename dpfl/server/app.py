"""The dpfl ``ServerApp``: validates the run config, then runs ``AlgorithmStrategy``."""

from __future__ import annotations

import logging
import sys

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from dpfl.config import RunConfig
from dpfl.errors import ConfigError
from dpfl.problem import cached_problem
from dpfl.server.runtime import ServerRuntime
from dpfl.strategies import AlgorithmStrategy, FederationError

app = ServerApp()
log = logging.getLogger("dpfl")


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        config = RunConfig(context.run_config)
        problem = cached_problem(tuple(sorted(config.as_dict().items())))
        server = ServerRuntime(problem, "flower")
        strategy = AlgorithmStrategy(server)
        strategy.start(grid=grid, initial_arrays=strategy.global_arrays(),
                       num_rounds=int(config["num-server-rounds"]))
    except (ConfigError, FederationError) as exc:
        print(f"dpfl: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
