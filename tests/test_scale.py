"""Many clients: the one reduction in blocks, the engine in blocks, cohort SuperNodes."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import Context, RecordDict

from dpfl.client.numpy_client import node_block, node_clients
from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.rounds import RowSum, sum_rows, transport
from dpfl.runconfig import RunConfig
from tests.inprocess_grid import run_flower_code_path

CPU = torch.device("cpu")


def test_the_reduction_is_one_sum_up_to_a_block_then_the_block_sums_in_order():
    gen = torch.Generator().manual_seed(0)
    block = transport.BLOCK
    for rows in (1, 7, block):
        values = torch.randn(rows, 1001, generator=gen)
        assert torch.equal(sum_rows({"u": values}, CPU)["u"], values.sum(dim=0))
    values = torch.randn(2 * block + 5, 1001, generator=gen)
    parts = [values[:block].sum(dim=0), values[block:2 * block].sum(dim=0),
             values[2 * block:].sum(dim=0)]
    assert torch.equal(sum_rows({"u": values}, CPU)["u"], parts[0] + parts[1] + parts[2])
    fed = RowSum(CPU)  # blocks fed as tensors of their own (the engine, the strategy)
    for start in range(0, len(values), block):
        fed.add({"u": values[start:start + block].clone()})
    assert torch.equal(fed.sums["u"], sum_rows({"u": values}, CPU)["u"])


@pytest.mark.parametrize("nodes,clients", [(1, 1), (1, 5), (3, 8), (4, 4), (7, 1000)])
def test_node_blocks_are_balanced_contiguous_disjoint_and_cover_every_client(nodes, clients):
    hosted = [node_block(p, nodes, clients) for p in range(nodes)]
    assert [c for block in hosted for c in block] == list(range(clients))
    assert max(map(len, hosted)) - min(map(len, hosted)) <= 1
    assert all(block == list(range(block[0], block[-1] + 1)) for block in hosted)


def test_a_simulated_supernode_hosts_its_block_of_the_run_s_clients():
    def hosted(node_config: dict, partitions: int) -> list[int]:
        return node_clients(Context(run_id=1, node_id=1, node_config=node_config,
                                    state=RecordDict(),
                                    run_config={"num-partitions": partitions}))

    assert hosted({"partition-id": 2, "num-partitions": 4}, 4) == [2]  # one client a node
    assert hosted({"partition-id": 1, "num-partitions": 3}, 10) == [3, 4, 5]
    assert hosted({"partition-id": 2}, 10) == [2]  # a deployed node naming its client
    assert hosted({"partition-ids": "5,1", "partition-id": 0}, 10) == [1, 5]
    with pytest.raises(ConfigError, match='at most 2 SuperNodes: flwr run --federation-config '
                       '"num-supernodes=2"'):
        hosted({"partition-id": 0, "num-partitions": 3}, 2)


def test_the_engine_in_blocks_equals_cohort_supernodes_bit_for_bit(tmp_path, monkeypatch):
    """Blocks of 3 clients (the reduction's, and the engine's batched steps) against the real
    strategy and ClientApp over 3 cohort nodes hosting 3, 3 and 2 of 8 stateful clients
    sampled 6 a round: the same model and rounds, bit for bit; and the same model, up to the
    order of the sum, as one block."""
    values = {"algorithm": "clip21-sgd2m", "num-partitions": 8, "num-server-rounds": 3,
              "batch-size": 16, "seed": 4, "beta": 0.5, "beta-hat": 0.5, "clip": 0.1,
              "fraction-train": 0.75, "calibration": "practice", "learning-rate": 0.5,
              "results-dir": str(tmp_path)}
    run(RunConfig({**values, "run-name": "one-block"}), echo=False)
    monkeypatch.setattr(transport, "BLOCK", 3)
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": p, "num-partitions": 3} for p in range(3)])
    engine, flower, one = (torch.load(tmp_path / name / "model.pt")
                           for name in ("engine", "flower", "one-block"))
    assert all(torch.equal(engine[k], flower[k]) for k in engine)
    assert all(torch.allclose(engine[k], one[k], rtol=0, atol=1e-6) for k in engine)
    e_rounds, f_rounds = ([json.loads(line) for line in
                           (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
                          for name in ("engine", "flower"))
    assert [r["participants"] for r in e_rounds] == [6, 6, 6]
    for e, f in zip(e_rounds, f_rounds, strict=True):
        e.pop("seconds"), f.pop("seconds")
        assert e == f
