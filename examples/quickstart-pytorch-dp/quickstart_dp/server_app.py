"""quickstart-dp: the ServerApp."""

import os
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from quickstart_dp.task import Net, federation, load_mnist, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    num_rounds = int(context.run_config["num-server-rounds"])

    private = federation(context.run_config)
    arrays = private.initial_arrays()  # Net() as the run's seed initialises it

    strategy = private.strategy()
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds,
                            evaluate_fn=global_evaluate)

    print("\nSaving final model to disk...")
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """The global model on MNIST's test set, on the server."""
    net = Net()
    net.load_state_dict(arrays.to_torch_state_dict())
    *_, test_x, test_y = load_mnist(Path(os.environ.get("DPFL_DATA_DIR", "data")), seed=0)
    loss, accuracy = test(net, test_x, test_y)
    return MetricRecord({"accuracy": accuracy, "loss": loss})
