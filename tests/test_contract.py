"""The algorithm contract carries what later families need: two exchanges per round,
several noisy local steps with a radius the server sends, persistent client state, client
sampling, server-side noise with its own ledger — and Flower's code path (strategy, messages,
Context.state) gives the engine's result bit for bit."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
import torch
from opacus.accountants import RDPAccountant

from dpfl.algorithms import ALGORITHMS, Algorithm, Exchange, Upload
from dpfl.config import BATCH_SIZE, LEARNING_RATE, hyperparameter
from dpfl.privacy import SERVER, Query
from dpfl.runconfig import RunConfig
from tests.inprocess_grid import run_flower_code_path

LOCAL_STEPS = 2


@dataclass(frozen=True)
class ProbeHyperparameters:
    batch_size: int = hyperparameter(BATCH_SIZE)
    learning_rate: float = hyperparameter(LEARNING_RATE)


class ContractProbe(Algorithm):
    """A noisy statistic sets the clip radius, then momentum SGD with noisy local steps, and
    the server adds noise of its own to the average update.

    Exercises every contract feature at once; it is not a published algorithm.
    """

    name = "test-contract-probe"
    Hyperparameters = ProbeHyperparameters
    exchanges = (Exchange("statistic", ("x",), {"s": Upload("statistic")}),
                 Exchange("train", ("x", "radius"),
                          {"delta": Upload("train", post_processing=True)}))
    protection = "test only"

    def queries(self, num_samples):
        b = self.hp.batch_size
        return [Query("statistic", "statistic", radius=1 / b, relation=self.relation,
                      sample_rate=b / num_samples, stream="statistic-noise"),
                Query("train", "train", radius=None, relation=self.relation,
                      sample_rate=b / num_samples, steps=LOCAL_STEPS)]

    def server_queries(self):
        return [Query("model", "train", radius=0.01, relation="add-remove", side="server",
                      stream="model-noise")]

    def init_server_state(self, x0):
        return {"x": x0.clone(), "radius": torch.ones(1)}

    def participants(self, server_round, clients, rng):
        order = torch.randperm(len(clients),
                               generator=rng.generator(SERVER, server_round, "clients"))
        return sorted(clients[i] for i in order[: len(clients) // 2].tolist())

    def broadcast(self, exchange, state, server_round):
        return {"x": state["x"]} if exchange == "statistic" else dict(state)

    def init_client_state(self, num_clients):
        return {"m": torch.zeros(num_clients, self.model.d)}

    def client_step(self, exchange, states, broadcast, cohort, ctx):
        b = self.hp.batch_size
        x0 = broadcast["x"].to(ctx.device)
        if exchange == "statistic":
            xb, yb = (t.to(ctx.device)
                      for t in cohort.sample(ctx.rng, ctx.server_round, "statistic", b))
            _, norms = self.model.clipped_mean(x0, xb, yb, 1.0)
            return {"s": norms.clamp(max=1.0).square().mean(dim=1, keepdim=True)}, states
        radius = float(broadcast["radius"])
        params = x0.unsqueeze(0).repeat(len(cohort), 1)
        m = states["m"].to(ctx.device)
        for k in range(LOCAL_STEPS):
            xb, yb = (t.to(ctx.device)
                      for t in cohort.sample(ctx.rng, ctx.server_round, f"batch-{k}", b))
            g, _ = self.model.clipped_mean(params, xb, yb, radius)
            g = ctx.privatize("train", g, radius=radius / b, step=k)
            m = 0.5 * m + g
            params = params - self.hp.learning_rate * m
        return {"delta": x0 - params}, {"m": m}

    def server_step(self, exchange, state, sums, ctx):
        mean = {k: v / len(ctx.participants) for k, v in sums.items()}
        if exchange == "statistic":
            radius = mean["s"].clamp(min=1e-4).sqrt().clamp(0.05, 5.0)
            return {"x": state["x"], "radius": radius.reshape(1)}
        step = ctx.privatize("model", mean["delta"])
        return {"x": state["x"] - step, "radius": state["radius"]}


@pytest.fixture(autouse=True, scope="module")
def _registered():
    """The probe is an algorithm only while this module's tests run: registered at import, it
    would join every other test's list of algorithms, depending on which files are collected."""
    ALGORITHMS.add(ContractProbe.name, ContractProbe)
    yield
    ALGORITHMS.remove(ContractProbe.name)


def _config(tmp_path, name, **extra):
    values = {"algorithm": "test-contract-probe", "num-partitions": 4, "num-server-rounds": 3,
              "batch-size": 8, "learning-rate": 0.5, "seed": 5, "noise-multiplier": 2.0,
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

    # The server's own noise has its ledger: 3 rounds at multiplier 2 (add/remove), as Opacus
    # counts them independently.
    accountant = RDPAccountant()
    for _ in range(3):
        accountant.step(noise_multiplier=2.0, sample_rate=1.0)
    assert summary["server_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert [r["server_epsilon"] for r in e_rounds][-1] == summary["server_epsilon"]

    # Context.state keeps momentum and the node's ledger for the clients that took part; each
    # participation recorded one statistic release and LOCAL_STEPS training steps.
    for node, context in grid.contexts.items():
        client = node - 1
        ledger_record = context.state.get(f"dpfl.node.{client}")
        if ledger_record is None:
            assert f"dpfl.state.{client}" not in context.state
            continue
        ledger = json.loads(str(ledger_record["json"]))
        steps = sum(steps for _, _, _, steps in ledger["events"])
        assert steps % (1 + LOCAL_STEPS) == 0 and steps > 0
        (run,) = ledger["runs"].values()
        counts = run["total"]
        assert counts["train"] == counts["statistic"] == steps // (1 + LOCAL_STEPS)
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

    with pytest.raises(FederationError) as refused:
        run_flower_code_path(_config(tmp_path, "mismatch"),
                             [{"partition-id": i} for i in range(3)], connect_timeout=0.0)
    assert re.match(r"num-partitions=4, but no SuperNode hosts clients \[3\] \(the 3 SuperNodes "
                    r"that answered in \d+ s host \[0-2\]\)", str(refused.value)), refused.value
    assert 'num-supernodes=4' in str(refused.value)


def test_simulation_is_told_by_flowers_grid_class():
    """Flower gives no public signal that a grid is its simulation's: the strategy reads the
    class name in one place (a rename in Flower fails here)."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    from dpfl.strategies.algorithm import simulated_grid

    assert simulated_grid(InMemoryGrid.__new__(InMemoryGrid))

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


def test_a_poisson_batch_packs_each_clients_kept_records_in_order():
    """``Cohort.poisson``: each client's records kept by its own coins (its stream, whatever
    the others'), in stored order, packed one client after another with nothing between them;
    ``Batches`` gives them back client by client, an empty batch included."""
    from dpfl.algorithms import Cohort
    from dpfl.algorithms.base import Batches
    from dpfl.privacy import Randomness

    x = torch.arange(24.0).reshape(12, 2)
    y = torch.arange(12)
    indices = [torch.tensor([5, 0, 7, 2]), torch.tensor([1, 3, 4, 6]), torch.tensor([8, 9, 10, 11])]
    cohort = Cohort([0, 1, 2], x, y, indices)
    rates = [0.5, 0.0, 0.8]
    xb, yb, lengths = cohort.poisson(Randomness(3), 1, "batch", rates)
    assert len(yb) == sum(lengths) and lengths[1] == 0
    for i, (xs, ys) in enumerate(Batches(2, xb, yb, lengths)):
        picks = Randomness(3).bernoulli_rows([i], [4], 1, "batch", [rates[i]])[0]
        assert torch.equal(ys, indices[i][picks]) and torch.equal(xs, x[ys])
        alone = Cohort([i], x, y, [indices[i]]).poisson(Randomness(3), 1, "batch", [rates[i]])
        assert torch.equal(alone[1], ys)


def _probe(**declarations):
    """A ContractProbe whose class attributes or methods are replaced by ``declarations``."""
    return type("Probe", (ContractProbe,), declarations)(ProbeHyperparameters(), None, 4)


@pytest.mark.parametrize("declarations, message", [
    ({"exchanges": (Exchange("statistic", ("x",), {"s": Upload("nothing")}),)},
     "upload 's' of exchange 'statistic' is covered by no client-side query of it"),
    ({"exchanges": (Exchange("statistic", ("x",), {"s": Upload("train")}),)},
     "upload 's' of exchange 'statistic' is covered by no client-side query of it"),
    ({"exchanges": (Exchange("train", ("x",), {"delta": Upload("train")}),)},
     "upload 'delta' is noised by the runtime, so its query needs one step and a fixed radius"),
    ({"queries": lambda self, n: [Query("statistic", "statistic", 1.0, "replace-one"),
                                  Query("statistic", "train", None, "replace-one", steps=2)]},
     "queries must have distinct names, and the queries of one exchange distinct streams"),
    ({"queries": lambda self, n: [Query("statistic", "statistic", 1.0, "replace-one"),
                                  Query("other", "statistic", 1.0, "replace-one"),
                                  Query("train", "train", None, "replace-one", steps=2)]},
     "queries must have distinct names, and the queries of one exchange distinct streams"),
    ({"server_queries": lambda self: [Query("model", "train", 0.01, "add-remove")]},
     "queries() are client-side, server_queries() server-side"),
])
def test_the_schema_check_refuses_declarations_that_do_not_fit(declarations, message):
    from dpfl.algorithms import check_schema

    probe = _probe(**declarations)
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_schema(probe, probe.queries(100))
    check_schema(_probe(), _probe().queries(100))  # the probe itself fits


def test_the_client_runtime_refuses_a_step_that_breaks_its_declarations(tmp_path):
    """A step must return exactly its declared uploads and draw exactly the in-step noise its
    releases declare (one draw per step of a post-processing upload's query)."""
    from dpfl.problem import build_problem
    from dpfl.rounds import ClientRuntime

    problem = build_problem(RunConfig(_config(tmp_path, "runtime")))
    state = problem.algorithm.init_server_state(problem.x0)
    states = problem.algorithm.init_client_state(4)
    cohort = problem.full_cohort()
    honest = ContractProbe.client_step

    def one_draw_short(self, exchange, states, broadcast, cohort, ctx):
        ctx.drawn["train"] -= 1  # as if the step had skipped one local step's noise
        return honest(self, exchange, states, broadcast, cohort, ctx)

    def extra_upload(self, exchange, states, broadcast, cohort, ctx):
        uploads, states = honest(self, exchange, states, broadcast, cohort, ctx)
        return {**uploads, "loss": torch.zeros(len(cohort))}, states

    for step, message in ((one_draw_short, "release 'train' declares 2 in-step draws, the "
                           "step made 1"),
                          (extra_upload, r"returned \['delta', 'loss'\], declared \['delta'\]")):
        runtime = ClientRuntime.of(problem)
        runtime.algorithm = type("Probe", (ContractProbe,), {"client_step": step})(
            ProbeHyperparameters(), problem.model, 4)
        broadcast = {"x": state["x"], "radius": torch.ones(1)}
        with pytest.raises((RuntimeError, TypeError), match=message):
            runtime.step("train", 1, broadcast, states, cohort)


def test_exchanges_of_one_round_may_not_share_a_noise_stream(tmp_path):
    """Two queries of different exchanges may share a stream only if no round runs both: the
    probe's statistic and train exchanges run in every round."""
    from dpfl.problem import build_problem
    from dpfl.rounds import RoundLoop

    problem = build_problem(RunConfig(_config(tmp_path, "streams")))
    problem.algorithm = _probe(queries=lambda self, n: [
        Query("statistic", "statistic", 1 / 8, "replace-one", sample_rate=8 / n),
        Query("train", "train", None, "replace-one", sample_rate=8 / n, steps=LOCAL_STEPS)])
    loop = RoundLoop(problem, runtime="engine", echo=False)
    with pytest.raises(TypeError, match="round 1's exchanges share a noise stream"):
        next(loop.play(1, [0, 1, 2, 3]))
