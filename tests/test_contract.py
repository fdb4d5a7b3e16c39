"""The algorithm contract carries what later families need: two exchanges per round,
several local steps, persistent client state, client sampling — and Flower's code path
(strategy, messages, Context.state) gives the engine's result bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from dpfl.algorithms import ALGORITHMS, Algorithm, Release
from dpfl.config import RunConfig
from dpfl.privacy import SERVER
from tests.inprocess_grid import run_flower_code_path

LOCAL_STEPS = 2


@ALGORITHMS.register_class
class ContractProbe(Algorithm):
    """A noisy statistic sets the clip radius, then momentum SGD with local steps.

    Exercises every contract feature at once; it is not a published algorithm.
    """

    name = "test-contract-probe"
    exchanges = ("statistic", "train")
    protection = "test only"

    def releases(self, num_samples):
        q = int(self.config["batch-size"]) / num_samples
        return [Release("statistic", 2.0, q, 1), Release("train", 1.0, q, LOCAL_STEPS)]

    def init_server_state(self, x0):
        return {"x": x0.clone(), "radius": torch.ones(1)}

    def participants(self, round, clients, rng):
        order = torch.randperm(len(clients), generator=rng.generator(SERVER, round, "clients"))
        return sorted(clients[i] for i in order[: len(clients) // 2].tolist())

    def broadcast(self, exchange, state, round):
        return {"x": state["x"]} if exchange == "statistic" else dict(state)

    def init_client_state(self, num_clients):
        return {"m": torch.zeros(num_clients, self.model.d)}

    def client_step(self, exchange, states, broadcast, cohort, ctx):
        b = int(self.config["batch-size"])
        x0 = broadcast["x"]
        if exchange == "statistic":
            xb, yb = cohort.sample(ctx.rng, ctx.round, "statistic", b)
            _, norms = self.model.clipped_mean(x0, xb, yb, 1.0)
            stat = norms.clamp(max=1.0).square().mean(dim=1, keepdim=True)
            std = ctx.noise_multiplier(exchange) * 2 / b
            return {"s": stat + ctx.rng.normal(cohort.ids, ctx.round, "stat-noise", (1,), std)}, \
                states, {"statistic": stat[:, 0]}
        radius = float(broadcast["radius"])
        params = x0.unsqueeze(0).repeat(len(cohort), 1)
        m = states["m"].clone()
        for k in range(LOCAL_STEPS):
            xb, yb = cohort.sample(ctx.rng, ctx.round, f"batch-{k}", b)
            g, _ = self.model.clipped_mean(params, xb, yb, radius)
            std = ctx.noise_multiplier(exchange) * 2 * radius / b
            g = g + ctx.rng.normal(cohort.ids, ctx.round, f"noise-{k}", (self.model.d,), std)
            m = 0.5 * m + g
            params = params - float(self.config["learning-rate"]) * m
        return {"delta": x0 - params}, {"m": m}, {}

    def server_step(self, exchange, state, uploads, participants, round):
        if exchange == "statistic":
            radius = uploads["s"].mean().clamp(min=1e-4).sqrt().clamp(0.05, 5.0)
            return {"x": state["x"], "radius": radius.reshape(1)}
        return {"x": state["x"] - uploads["delta"].mean(dim=0), "radius": state["radius"]}


def _config(tmp_path, name, **extra):
    values = {"algorithm": "test-contract-probe", "num-partitions": 4, "num-server-rounds": 3,
              "batch-size": 8, "learning-rate": 0.5, "seed": 5,
              "results-dir": str(tmp_path), "run-name": name}
    values.update(extra)
    return values


def test_flower_code_path_equals_engine_with_two_exchanges_state_and_sampling(tmp_path):
    from dpfl.engine import run

    summary = run(RunConfig(_config(tmp_path, "engine")), echo=False)
    grid, _ = run_flower_code_path(_config(tmp_path, "flower"),
                                         [{"partition-id": i} for i in range(4)])
    engine = torch.load(tmp_path / "engine" / "model.pt")
    flower = torch.load(tmp_path / "flower" / "model.pt")
    assert all(torch.equal(engine[k], flower[k]) for k in engine)
    f_rounds, e_rounds = ([json.loads(x) for x in (tmp_path / run / "rounds.jsonl").read_text()
                           .splitlines()] for run in ("flower", "engine"))
    assert [r["participants"] for r in e_rounds] == [2, 2, 2]
    for f, e in zip(f_rounds, e_rounds, strict=True):
        f.pop("seconds"), e.pop("seconds")
        assert f == e
    assert summary["rounds_completed"] == 3

    # Context.state keeps momentum and ledger for the clients that took part; each
    # participation recorded one statistic release and LOCAL_STEPS training steps.
    for node, context in grid.contexts.items():
        client = node - 1
        ledger_record = context.state.get(f"dpfl.ledger.{client}")
        if ledger_record is None:
            assert f"dpfl.state.{client}" not in context.state
            continue
        ledger = json.loads(str(ledger_record["json"]))
        steps = sum(e[2] for e in ledger["history"])
        assert steps % (1 + LOCAL_STEPS) == 0 and steps > 0
        momentum = context.state[f"dpfl.state.{client}"]["m"].numpy()
        assert abs(momentum).sum() > 0


def test_a_node_can_host_a_cohort_of_clients(tmp_path):
    run_flower_code_path(_config(tmp_path, "single"), [{"partition-id": i} for i in range(4)])
    run_flower_code_path(_config(tmp_path, "cohort"),
                          [{"partition-ids": "0,2"}, {"partition-ids": "1,3"}])
    single = torch.load(tmp_path / "single" / "model.pt")
    cohort = torch.load(tmp_path / "cohort" / "model.pt")
    assert all(torch.equal(single[k], cohort[k]) for k in single)


def test_strategy_refuses_a_federation_that_does_not_match(tmp_path):
    from dpfl.strategies import FederationError

    with pytest.raises(FederationError, match="num-supernodes=4"):
        run_flower_code_path(_config(tmp_path, "mismatch"),
                             [{"partition-id": i} for i in range(3)], connect_timeout=0.0)

def test_max_epsilon_stops_the_flower_code_path_where_the_engine_stops(tmp_path):
    from dpfl.engine import run

    values = {"algorithm": "dpsgd-gc", "num-partitions": 4, "num-server-rounds": 40,
              "batch-size": 16, "noise-multiplier": 4.0, "max-epsilon": 0.5,
              "results-dir": str(tmp_path)}
    engine = run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                          [{"partition-id": i} for i in range(4)])
    flower = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert 0 < flower["rounds_completed"] == engine["rounds_completed"] < 40
    assert flower["epsilon_max"] == engine["epsilon_max"] <= 0.5


def test_a_whole_data_batch_is_the_clients_data_and_a_smaller_one_is_drawn():
    """``Cohort.sample`` at b = m returns each client's own rows (no draw, the set is certain);
    below m it draws a fresh subset per round."""
    from dpfl.algorithms import Cohort
    from dpfl.privacy import Randomness

    x = torch.arange(24.0).reshape(12, 2)
    y = torch.arange(12)
    indices = [torch.tensor([5, 0, 7, 2]), torch.tensor([1, 3, 4, 6]), torch.tensor([8, 9, 10, 11])]
    cohort = Cohort([0, 1, 2], x, y, indices)
    rng = Randomness(0)
    xb, yb = cohort.sample(rng, 1, "batch", 4)
    assert torch.equal(yb, torch.stack(indices)) and torch.equal(xb, x[torch.stack(indices)])
    assert torch.equal(cohort.sample(rng, 2, "batch", 4)[1], yb)
    small = [set(cohort.sample(rng, r, "batch", 2)[1][0].tolist()) for r in range(1, 30)]
    assert all(s <= {5, 0, 7, 2} and len(s) == 2 for s in small)
    assert len(set(map(frozenset, small))) > 1
