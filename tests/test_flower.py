"""Flower runtime: `flwr run` (Ray simulation) gives the engine's model, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpfl.engine import run
from dpfl.launch import flwr_run, started_processes
from dpfl.privacy import Randomness
from dpfl.problem import build_problem
from dpfl.runconfig import RunConfig
from tests.interrupting import STOPS, interrupted, round_done

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
    # secure aggregation: Flower's SecAgg+ stages for every exchange, each client's noise split
    # over the 4 (distributed noise), the engine's quantised sum bit for bit
    "secagg": {"algorithm": "dpsgd-gc", "num-partitions": 4, "num-server-rounds": 2,
               "batch-size": 16, "seed": 6, "secure-aggregation": True,
               "distributed-noise": True},
}


SUPERNODES = {"clip21-sgd2m": 4}  # fewer virtual SuperNodes than clients: cohort SuperNodes


def _equals_engine(results: Path, case: dict) -> None:
    """The engine's run of ``case`` (run name ``engine``) equals the Flower run in ``results``
    (run name ``flower``): model bit for bit, every round's numbers (but their wall times)."""
    run(RunConfig({**case, "results-dir": str(results), "run-name": "engine"}), echo=False)
    flower = torch.load(results / "flower" / "model.pt")
    engine = torch.load(results / "engine" / "model.pt")
    assert flower.keys() == engine.keys()
    for k in flower:
        assert torch.equal(flower[k], engine[k]), k
    f_rounds = (results / "flower" / "rounds.jsonl").read_text().splitlines()
    e_rounds = (results / "engine" / "rounds.jsonl").read_text().splitlines()
    for f, e in zip(f_rounds, e_rounds, strict=True):
        f, e = json.loads(f), json.loads(e)
        f.pop("seconds"), e.pop("seconds")
        assert f == e  # losses, accuracy, ε per client, clipped fraction: all identical
    # the virtual SuperNodes ran in Ray actors, so they trusted the server, as the summary says:
    # every client that took part (the server's sampling, as the engine's loop draws it) drew
    # seeded noise
    summary = json.loads((results / "flower" / "summary.json").read_text())
    problem = build_problem(RunConfig({**case, "results-dir": str(results)}))
    clients = list(range(problem.num_clients))
    took_part = set().union(*(problem.algorithm.participants(r, clients, Randomness(case["seed"]))
                              for r in range(1, case["num-server-rounds"] + 1)))
    assert summary["privacy"]["noise"] == {"seeded": len(took_part)}
    assert summary["privacy"]["guarantee_against_server"] is False


# dpsgd-gc's case runs twice at once (test_two_runs_at_once_each_get_a_superlink_of_their_own)
@pytest.mark.parametrize("case", sorted(set(CASES) - {"dpsgd-gc"}))
def test_flower_simulation_equals_engine_bitwise(tmp_path, case):
    results = tmp_path / "results"
    home = tmp_path / "flwr-home"
    code = flwr_run({**CASES[case], "results-dir": str(results), "run-name": "flower"},
                    num_supernodes=SUPERNODES.get(case), flwr_home=home, timeout=600)
    assert code == 0
    assert started_processes(home) == []  # the managed SuperLink was stopped
    _equals_engine(results, CASES[case])


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
        _equals_engine(Path(case["results-dir"]), case)


def test_a_federation_of_the_wrong_size_fails_the_run_at_once(tmp_path, capfd):
    """Three virtual SuperNodes for two partitions: ``dpfl flower`` refuses before anything
    starts (tests/test_bad_input.py); under a plain ``flwr run`` the nodes refuse within seconds
    (not the 120 s a deployment waits for nodes), in one line naming both ways to size the
    federation, and Flower lists the run as failed."""
    import time

    from dpfl.config import format_overrides
    from dpfl.flower_app import app_folder
    from dpfl.launch import BIN, Stream, final_status, simulation_env, stop, stream

    overrides = {**CASES["dpsgd-gc"], "num-partitions": 2, "results-dir": str(tmp_path)}
    home = tmp_path / "home"
    env = simulation_env(home)
    start = time.monotonic()
    try:
        with app_folder() as app:
            stream([str(BIN / "flwr"), "run", str(app), "--stream", "--run-config",
                    format_overrides(overrides), "--federation-config", "num-supernodes=3"],
                   env, app, Stream(), timeout=600, wind_down=lambda: False)
            status, _ = final_status(BIN / "flwr", env, app)
    finally:
        stop(started_processes(home))
    elapsed = time.monotonic() - start
    out, err = capfd.readouterr()
    assert status == "finished:failed"
    assert "\x1b[" not in out and "DEBUG" not in out
    assert ('2 clients for 3 SuperNodes: a SuperNode would host none (allowed: num-partitions '
            'of at least 3, or at most 2 SuperNodes: flwr run --federation-config '
            '"num-supernodes=2", dpfl flower --num-supernodes 2)') in out
    assert "Traceback" not in out + err
    assert elapsed < 120, elapsed  # waiting out the 120 s node timeout would take longer
    assert started_processes(tmp_path / "home") == []


@pytest.mark.parametrize(("signum", "group", "status"), STOPS)
def test_ctrl_c_or_sigterm_stops_dpfl_flower_and_every_process_it_started(tmp_path, signum,
                                                                          group, status):
    """Ctrl-C, or SIGTERM to dpfl alone, on ``dpfl flower`` mid-run: exit status 130 (143)
    without a traceback, the ServerApp closed its results folder, ``flower.log`` is kept
    there, and no process it started is left (Flower's SuperLink and SuperExec, the
    simulation, Ray's processes: Ctrl-C used to leave them orphaned, SIGTERM left the run going
    to its last round)."""
    stopped = interrupted(["flower", "-c", f'num-server-rounds=300 num-partitions=4 '
                           f'results-dir="{tmp_path}" run-name="cut"'], round_done(2), signum,
                          group)
    stopped.check(status)
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["rounds_completed"] < 300 and summary["stopped_early"]
    assert f"results in {tmp_path / 'cut'}" in (tmp_path / "cut" / "flower.log").read_text()
