"""A bare Flower PyTorch app, written the way Flower's PyTorch quickstart is: the yardstick
against which ``benchmarks/bench_deployment.py`` measures dpfl's ClientApp over real processes.

Each message, as in the quickstart: import torch, torchvision and flwr-datasets; open the
dataset from its on-disk (memory-mapped Arrow) copy, take this node's partition with
flwr-datasets' ``IidPartitioner`` (kept for the process's later messages, as the quickstart keeps
its ``FederatedDataset``: a warm simulation actor partitions once), transform it with torchvision
(``ToTensor``, ``Normalize``) and run ``local-steps`` plain SGD steps of the same MLP as dpfl's
``mlp`` (784-256-10, tanh). A node's partition is its node config's ``partition-ids`` (a real
SuperNode) or ``partition-id`` (a simulated one). The ServerApp is Flower's ``FedAvg``; it writes
the wall time of each round to ``times-file``. The yardstick of ``benchmarks/bench_deployment.py``
(real processes) and ``benchmarks/bench_flower_vs_bare.py`` (Ray simulation).
"""

import json
import time

import torch
from datasets import load_from_disk
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr_datasets.partitioner import IidPartitioner
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms import Compose, Normalize, ToTensor

client = ClientApp()
server = ServerApp()


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.Tanh(), nn.Linear(256, 10))


_partitioners: dict[tuple[int, str], IidPartitioner] = {}


def load_data(partition_id: int, num_partitions: int, path: str, batch_size: int) -> DataLoader:
    if (num_partitions, path) not in _partitioners:
        partitioner = IidPartitioner(num_partitions=num_partitions)
        partitioner.dataset = load_from_disk(path)
        _partitioners[num_partitions, path] = partitioner
    partition = _partitioners[num_partitions, path].load_partition(partition_id)
    transform = Compose([ToTensor(), Normalize((0.1307,), (0.3081,))])

    def apply(batch: dict) -> dict:
        batch["image"] = [transform(image) for image in batch["image"]]
        return batch

    return DataLoader(partition.with_format("numpy").with_transform(apply),
                      batch_size=batch_size, shuffle=True)


def fit(model: nn.Module, loader: DataLoader, local_steps: int, learning_rate: float) -> int:
    """``local_steps`` plain SGD steps on the partition's batches; returns the steps taken."""
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    steps = 0
    for batch in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(batch["image"]), batch["label"]).backward()
        optimizer.step()
        steps += 1
        if steps == local_steps:
            break
    return steps


@client.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    model = net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    node = context.node_config
    loader = load_data(int(node.get("partition-ids", node.get("partition-id", 0))),
                       int(cfg["num-partitions"]),
                       str(cfg["data-path"]), int(cfg["batch-size"]))
    steps = fit(model, loader, int(cfg["local-steps"]), float(cfg["learning-rate"]))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": steps})})
    return Message(content=content, reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    marks: list[float] = []

    def mark(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        marks.append(time.perf_counter())
        return MetricRecord({})

    nodes = int(cfg["num-partitions"])
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes,
                      min_evaluate_nodes=0, min_available_nodes=nodes)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(net().state_dict()),
                   num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=mark)
    seconds = [b - a for a, b in zip(marks, marks[1:])]
    with open(str(cfg["times-file"]), "w") as out:
        json.dump({"seconds_per_round": seconds}, out)
