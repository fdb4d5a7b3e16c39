"""quickstart-dp: the ServerApp."""

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from quickstart_dp.task import federation

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    num_rounds = int(context.run_config["num-server-rounds"])

    private = federation(context.run_config)
    arrays = private.initial_arrays()  # Net() as the run's seed initialises it

    strategy = private.strategy()
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)

    print("\nSaving final model to disk...")
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
