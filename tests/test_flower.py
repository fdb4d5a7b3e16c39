"""Flower runtime: `flwr run` (Ray simulation) gives the engine's model, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from dpfl.engine import run
from dpfl.launch import flwr_run, started_processes
from dpfl.runconfig import RunConfig

pytestmark = pytest.mark.flower


CASES = {
    # stateless, per-sample clipping: DPSGD-GC, 3 rounds, 4 clients
    "dpsgd-gc": {"algorithm": "dpsgd-gc", "num-partitions": 4, "num-server-rounds": 3,
                 "batch-size": 16, "seed": 3},
    # stateful clients (v_i, g_i in Context.state), 25 clients, sampling, on 4 cohort
    # SuperNodes (SUPERNODES) hosting 7, 6, 6 and 6 of them
    "clip21-sgd2m": {"algorithm": "clip21-sgd2m", "num-partitions": 25, "num-server-rounds": 3,
                     "batch-size": 16, "seed": 4, "beta": 0.5, "beta-hat": 0.5, "clip": 0.1,
                     "fraction-train": 0.8, "calibration": "practice", "learning-rate": 0.5},
    # a first round of its own, then x^t and x^{t-1} broadcast, the noisy v_i in Context.state
    # (server-clip stays at its default, inf, through Flower's run config)
    "prisma": {"algorithm": "prisma", "num-partitions": 4, "num-server-rounds": 3,
               "batch-size": 16, "seed": 5, "gamma": 0.3, "clip-diff": 0.2,
               "learning-rate": 0.5},
}


SUPERNODES = {"clip21-sgd2m": 4}  # fewer virtual SuperNodes than clients: cohort SuperNodes


@pytest.mark.parametrize("case", sorted(CASES))
def test_flower_simulation_equals_engine_bitwise(tmp_path, case):
    overrides = {**CASES[case], "results-dir": str(tmp_path / "results")}
    home = tmp_path / "flwr-home"
    code = flwr_run({**overrides, "run-name": "flower"}, num_supernodes=SUPERNODES.get(case),
                    flwr_home=home, timeout=600)
    assert code == 0
    assert started_processes(home) == []  # the managed SuperLink was stopped
    run(RunConfig({**overrides, "run-name": "engine"}), echo=False)
    flower = torch.load(tmp_path / "results" / "flower" / "model.pt")
    engine = torch.load(tmp_path / "results" / "engine" / "model.pt")
    assert flower.keys() == engine.keys()
    for k in flower:
        assert torch.equal(flower[k], engine[k]), k
    f_rounds = (tmp_path / "results" / "flower" / "rounds.jsonl").read_text().splitlines()
    e_rounds = (tmp_path / "results" / "engine" / "rounds.jsonl").read_text().splitlines()
    for f, e in zip(f_rounds, e_rounds, strict=True):
        f, e = json.loads(f), json.loads(e)
        f.pop("seconds"), e.pop("seconds")
        assert f == e  # losses, accuracy, ε per client, clipped fraction: all identical
    # the virtual SuperNodes ran in Ray actors, so they trusted the server, as the summary says
    summary = json.loads((tmp_path / "results" / "flower" / "summary.json").read_text())
    assert summary["privacy"]["noise"] == {"seeded": CASES[case]["num-partitions"]}
    assert summary["privacy"]["guarantee_against_server"] is False


def test_two_runs_at_once_each_get_a_superlink_of_their_own(tmp_path):
    """Two ``dpfl flower`` runs started together on one machine: each on a private
    ``FLWR_HOME`` and free ports, both complete, each equals its engine run."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [{**CASES["dpsgd-gc"], "seed": seed, "num-server-rounds": 2,
              "results-dir": str(tmp_path / f"results-{seed}")} for seed in (1, 2)]
    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(lambda c: flwr_run({**c, "run-name": "flower"}, timeout=600),
                              cases))
    assert codes == [0, 0]
    for case in cases:
        run(RunConfig({**case, "run-name": "engine"}), echo=False)
        results = tmp_path / case["results-dir"]
        flower = torch.load(results / "flower" / "model.pt")
        engine = torch.load(results / "engine" / "model.pt")
        assert all(torch.equal(flower[k], engine[k]) for k in engine)


def test_a_federation_of_the_wrong_size_fails_the_run_at_once(tmp_path, capfd):
    """Three virtual SuperNodes for two partitions: the ServerApp refuses within seconds (not
    the 120 s a deployment waits for nodes), Flower lists the run as failed, and
    ``dpfl flower`` exits non-zero naming the ``--federation-config`` to use."""
    import time

    overrides = {**CASES["dpsgd-gc"], "num-partitions": 2, "results-dir": str(tmp_path)}
    start = time.monotonic()
    code = flwr_run(overrides, num_supernodes=3, flwr_home=tmp_path / "home", timeout=600)
    elapsed = time.monotonic() - start
    out, err = capfd.readouterr()
    assert code == 1
    assert err.splitlines()[-1].startswith("dpfl: error: the Flower run ended finished:failed "
                                           f"(Flower's log: {tmp_path}/flower-")
    assert "\x1b[" not in out and "DEBUG" not in out
    assert ('2 clients for 3 SuperNodes: a SuperNode would host none; run at most 2 '
            'SuperNodes (simulation: --federation-config "num-supernodes=2")') in out
    assert "Traceback" not in out + err
    assert elapsed < 90, elapsed
    assert started_processes(tmp_path / "home") == []
