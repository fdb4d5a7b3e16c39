"""The dpfl ``ClientApp``: Message API handlers driving ``AlgorithmClient``."""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfl.client.numpy_client import AlgorithmClient, node_clients
from dpfl.problem import cached_problem

app = ClientApp()


def _client(context: Context) -> AlgorithmClient:
    return AlgorithmClient(cached_problem(tuple(sorted(context.run_config.items()))), context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server which clients this node hosts and how many records each holds."""
    problem = cached_problem(tuple(sorted(context.run_config.items())))
    ids = node_clients(context)
    sizes = [len(problem.partitions[c]) if c < problem.num_clients else 0 for c in ids]
    return Message(RecordDict({"config": ConfigRecord({"clients": ids, "sizes": sizes})}),
                   reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One exchange of the configured algorithm (see ``AlgorithmClient.fit``)."""
    config = dict(msg.content["config"])
    arrays = msg.content["arrays"]
    keys = str(config["keys"]).split(",")
    client = _client(context)
    uploads, num_examples, metrics = client.fit([arrays[k].numpy() for k in keys], config)
    content = RecordDict({
        "arrays": ArrayRecord({k: Array(u) for k, u in zip(client.upload_keys, uploads,
                                                           strict=True)}),
        "metrics": MetricRecord({**metrics, "num-examples": num_examples}),
        "config": ConfigRecord({"keys": ",".join(client.upload_keys)}),
    })
    return Message(content, reply_to=msg)
