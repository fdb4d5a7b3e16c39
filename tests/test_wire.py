"""``dpfl.wire``: every message both ends exchange decodes to what was encoded, a refusal is
one type at both ends, and Flower's ``Strategy`` interface of ``AlgorithmStrategy``
(``configure_train``, ``aggregate_train``) returns what the round loop's transport gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from dpfl.checkpoint import Lineage
from dpfl.rounds import ClientRefused
from dpfl.wire import (
    ClientsQuery,
    Hosted,
    TrainReply,
    TrainRequest,
    decode_refusal,
    encode_refusal,
)

LINEAGE = Lineage((("a1b2", 0), ("c3d4", 7)))
RNG = np.random.default_rng(0)


def _equal_arrays(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        for x, y in zip(a.values(), b.values(), strict=True))


@pytest.mark.parametrize("lineage", [None, LINEAGE])
def test_the_query_carries_the_lineage(lineage):
    assert ClientsQuery.decode(ClientsQuery(lineage).encode()) == ClientsQuery(lineage)


def test_hosted_and_its_counts_come_back():
    hosted = Hosted([0, 3], {0: {"message": 2}, 3: {"message": 2, "count": 1}})
    assert Hosted.decode(hosted.encode()) == hosted
    assert set(hosted.encode()) == {"hosted", "charged.0", "charged.3"}


def test_a_train_request_keeps_its_arrays_bit_for_bit_and_in_order():
    broadcast = {"x": RNG.normal(size=7).astype(np.float32),
                 "g": RNG.normal(size=(2, 3)), "clip": np.array([0.25], dtype=np.float32)}
    request = TrainRequest("train", 4, [1, 2], broadcast, LINEAGE)
    back = TrainRequest.decode(request.encode())
    assert (back.exchange, back.server_round, back.clients, back.lineage) == \
        ("train", 4, [1, 2], LINEAGE)
    assert _equal_arrays(back.broadcast, broadcast)
    assert TrainRequest.decode(TrainRequest("stat", 1, [0], broadcast).encode()).lineage is None


@pytest.mark.parametrize("diagnostics", [{}, {1: {"norm": 0.5}, 2: {"norm": 1.5}}])
def test_a_train_reply_holds_each_clients_uploads_counts_and_diagnostics(diagnostics):
    uploads = {c: {"delta": RNG.normal(size=5).astype(np.float32), "count": np.ones(1)}
               for c in (1, 2)}
    reply = TrainReply(uploads, {1: {"model": 3}, 2: {"model": 3}}, "seeded", diagnostics)
    content = reply.encode()
    assert set(content) == {"node", *(f"{r}.{c}" for c in (1, 2) for r in ("client", "charged")),
                            *(f"diagnostics.{c}" for c in diagnostics)}
    back = TrainReply.decode(content)
    assert (back.charged, back.noise, back.diagnostics) == (reply.charged, "seeded", diagnostics)
    assert list(back.uploads) == [1, 2]
    assert all(_equal_arrays(back.uploads[c], uploads[c]) for c in (1, 2))


def test_a_refusal_is_one_type_at_both_ends():
    refused = ClientRefused([0, 1], "node policy max-epsilon=4: round 3 would take ε past it")
    content = encode_refusal(refused)
    assert set(content) == {"refused"}
    for decoded in (decode_refusal(content), Hosted.decode(content),
                    TrainReply.decode(content)):
        assert isinstance(decoded, ClientRefused)
        assert (decoded.clients, decoded.reason) == (refused.clients, refused.reason)
    assert decode_refusal(RecordDict({"config": ConfigRecord()})) is None


def test_flowers_strategy_interface_returns_what_the_transport_gets(tmp_path):
    """``configure_train`` then ``aggregate_train`` over in-process nodes: the sums are the
    ones :meth:`AlgorithmStrategy.collect` hands the round loop, with each client's
    diagnostics as ``<name>.<client>`` metrics."""
    from dpfl.client.app import app as client_app
    from dpfl.problem import build_problem
    from dpfl.runconfig import RunConfig
    from dpfl.strategies import AlgorithmStrategy
    from dpfl.strategies.algorithm import from_record, to_record
    from tests.inprocess_grid import InProcessGrid

    config = RunConfig({"algorithm": "dpsgd-gc", "num-partitions": 4, "seed": 3,
                        "non-private-diagnostics": True, "results-dir": str(tmp_path)})
    problem = build_problem(config)
    configs = [{"partition-ids": "0,1"}, {"partition-ids": "2,3"}]
    strategy = AlgorithmStrategy(problem, echo=False)
    grid = InProcessGrid(client_app, config.as_dict(), configs)
    strategy.discover(grid, LINEAGE)
    broadcast = {"x": problem.x0}
    messages = list(strategy.configure_train(1, to_record(broadcast), ConfigRecord(
        {"exchange": "train", "clients": [0, 1, 2, 3]}), grid))
    assert [m.metadata.message_type for m in messages] == [MessageType.TRAIN] * 2
    sums, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    again = InProcessGrid(client_app, config.as_dict(), configs)  # fresh nodes: same replies
    strategy.discover(again, LINEAGE)
    dispatch = strategy.dispatch(again, "train", 1, broadcast, [0, 1, 2, 3])
    replies = strategy.collect(dispatch, again.send_and_receive(dispatch.messages))
    assert all(torch.equal(from_record(sums)[k], v.cpu()) for k, v in replies.sums.items())
    assert dict(metrics) == {f"{k}.{c}": v for c, values in replies.diagnostics.items()
                             for k, v in values.items()}
    assert sorted(replies.diagnostics) == [0, 1, 2, 3] and replies.lost == {}


def test_aggregate_train_needs_a_configure_train_first():
    from dpfl.strategies import AlgorithmStrategy
    from tests.inprocess_grid import as_the_server

    as_the_server()  # without it Flower refuses to build the Message, whatever dpfl would do
    strategy = AlgorithmStrategy.__new__(AlgorithmStrategy)
    strategy.dispatched = None
    with pytest.raises(RuntimeError, match="configure_train"):
        strategy.aggregate_train(1, [Message(RecordDict(), 1, MessageType.TRAIN)])
