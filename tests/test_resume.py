"""Runs survive interruption: a run killed mid-way and resumed from its checkpoint ends with the
model, rounds and ε of an uninterrupted run, bit for bit, on the engine and over the real
strategy and ClientApp (whose clients keep their state in files on their own nodes); a
checkpoint whose configuration differs is refused with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dpfl.checkpoint import CHECKPOINT, Lineage
from dpfl.cli import main
from dpfl.engine import run
from dpfl.runconfig import RunConfig
from tests.conftest import ROOT
from tests.inprocess_grid import InProcessGrid, run_flower_code_path

# client state (v_i, g_i), client sampling, noise set directly (so the rounds may be extended)
STATEFUL = {"algorithm": "clip21-sgd2m", "num-partitions": 5, "fraction-train": 0.6,
            "batch-size": 16, "seed": 3, "noise-multiplier": 1.0, "clip": 0.1, "beta": 0.5,
            "beta-hat": 0.5, "learning-rate": 0.5, "checkpoint-every": 2}
TIMES = ("wall_seconds", "seconds_per_round", "cpu_seconds", "results")


def assert_same_run(folder: Path, reference: Path, *, runtimes: bool = False) -> None:
    """``folder`` holds the run of ``reference``: model bit for bit, every round's record but
    its time, the summary but its timings and folder (and its runtime, when ``runtimes``
    differ)."""
    skipped = (*TIMES, "runtime") if runtimes else TIMES
    ours, theirs = torch.load(folder / "model.pt"), torch.load(reference / "model.pt")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    rounds = [[{k: v for k, v in json.loads(line).items() if k != "seconds"}
               for line in (f / "rounds.jsonl").read_text().splitlines()]
              for f in (folder, reference)]
    assert rounds[0] == rounds[1]
    summaries = [{k: v for k, v in json.loads((f / "summary.json").read_text()).items()
                  if k not in skipped} for f in (folder, reference)]
    assert summaries[0] == summaries[1]


@pytest.mark.slow
def test_an_engine_run_killed_mid_way_resumes_to_the_uninterrupted_result(tmp_path, device):
    """SIGKILL after a checkpoint is on disk, then ``dpfl run --resume FOLDER``."""
    values = {**STATEFUL, "num-server-rounds": 10, "results-dir": str(tmp_path), "device": device}
    folder = tmp_path / "killed"
    given = " ".join(f"{k}={json.dumps(v)}" for k, v in {**values, "run-name": "killed"}.items())
    command = [sys.executable, "-m", "dpfl", "run", "-q", "-c", given]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        while not (folder / CHECKPOINT).exists() and proc.poll() is None:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err
    assert not (folder / "summary.json").exists()  # killed mid-way, not finished
    done = torch.load(folder / CHECKPOINT, weights_only=True)["round"]
    assert 2 <= done < 10
    # resumed in this process: only the kill needs a process of its own
    assert main(["run", "-q", "--resume", str(folder)]) == 0
    run(RunConfig({**values, "run-name": "uninterrupted"}), echo=False)
    assert_same_run(folder, tmp_path / "uninterrupted")
    assert len(json.loads((folder / "summary.json").read_text())["epsilon"]) == 5


def test_resume_refuses_a_folder_without_checkpoint_or_another_configuration(tmp_path, capsys):
    values = {**STATEFUL, "num-server-rounds": 2, "results-dir": str(tmp_path)}
    run(RunConfig({**values, "run-name": "plain", "checkpoint-every": 0}), echo=False)
    run(RunConfig({**values, "run-name": "done"}), echo=False)
    cases = {
        ("--resume", str(tmp_path / "plain")): "run config key 'resume': ",
        ("--resume", str(tmp_path / "absent")): "--resume: ",
        ("--resume", str(tmp_path / "done"), "-c", "seed=4"):
            "run config key 'seed': seed=4 differs from the checkpointed run's",
        ("--resume", str(tmp_path / "done"), "-c", "num-server-rounds=1"):
            "run config key 'num-server-rounds': 1 is fewer than the 2 rounds",
        ("--resume", str(tmp_path / "done")):
            "run config key 'num-server-rounds': the run in",
    }
    for args, start in cases.items():
        assert main(["run", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dpfl: error: {start}") and err.count("\n") == 1, err
    assert main(["flower", "--resume", str(tmp_path / "done"), "-c",
                 "num-server-rounds=3"]) == 2
    assert "ran on the engine" in capsys.readouterr().err


def test_rounds_extend_when_the_noise_does_not_depend_on_them(tmp_path, capsys):
    """A finished run with noise-multiplier set continues to more rounds, as if it had been
    started with them; a calibrated run refuses (its noise was calibrated for its rounds)."""
    values = {**STATEFUL, "results-dir": str(tmp_path)}
    run(RunConfig({**values, "num-server-rounds": 3, "run-name": "short"}), echo=False)
    assert main(["run", "-q", "--resume", str(tmp_path / "short"), "-c",
                 "num-server-rounds=5"]) == 0
    run(RunConfig({**values, "num-server-rounds": 5, "run-name": "long"}), echo=False)
    assert_same_run(tmp_path / "short", tmp_path / "long")
    calibrated = {**values, "noise-multiplier": -1.0, "num-server-rounds": 2}
    run(RunConfig({**calibrated, "run-name": "calibrated"}), echo=False)
    capsys.readouterr()
    assert main(["run", "--resume", str(tmp_path / "calibrated"), "-c",
                 "num-server-rounds=4"]) == 2
    more = capsys.readouterr().err
    assert more.startswith("dpfl: error: run config key 'num-server-rounds': the run's noise "
                           "was calibrated for its 2 rounds: a longer run needs noise "
                           "calibrated for its own rounds, i.e. a new run")
    assert main(["run", "--resume", str(tmp_path / "calibrated")]) == 2  # as it was: finished
    again = capsys.readouterr().err
    assert "has completed its 2 rounds, with noise calibrated for ε=8 over them: a longer run " \
           "needs noise calibrated for its own rounds, i.e. a new run" in again
    assert "raise num-server-rounds" not in again and more.count("\n") == again.count("\n") == 1


def killed_in(server_round: int, after_nodes: int) -> type[InProcessGrid]:
    """A grid whose server process dies in ``round``: the messages of the round reach the
    first ``after_nodes`` nodes (whose clients compute and write their state), then the
    exchange fails."""

    class Killed(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if messages and messages[0].metadata.message_type == "train" \
                    and int(messages[0].content["config"]["round"]) == server_round:
                super().send_and_receive(messages[:after_nodes])
                raise KeyboardInterrupt
            return super().send_and_receive(messages)

    return Killed


def test_flower_clients_resume_from_their_node_files_to_the_engine_result(tmp_path):
    """Over the real strategy and ClientApp, killed twice (in round 3, after the checkpoint of
    round 2, and in round 5 of the resumed run), resumed twice with fresh nodes' Contexts (a
    new ``flwr run``): each client takes its state from its node's files, never from the
    server, and the result is the engine's, bit for bit."""
    values = {**STATEFUL, "num-server-rounds": 6, "results-dir": str(tmp_path),
              "run-name": "flower"}
    nodes = [{"partition-id": i, "state-dir": str(tmp_path / f"node-{i}")} for i in range(5)]
    for attempt, grid_class in enumerate((killed_in(3, 2), killed_in(5, 1), InProcessGrid)):
        resume = {"resume": True} if attempt else {}
        if grid_class is InProcessGrid:
            run_flower_code_path({**values, **resume}, nodes, grid_class=grid_class)
        else:
            with pytest.raises(KeyboardInterrupt):
                run_flower_code_path({**values, **resume}, nodes, grid_class=grid_class)
            summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
            assert summary["stopped_early"].startswith("interrupted in round")
        checkpoint = torch.load(tmp_path / "flower" / CHECKPOINT, weights_only=True)
        assert checkpoint["client_states"] == {}  # the clients' states stay on their nodes
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    assert_same_run(tmp_path / "flower", tmp_path / "engine", runtimes=True)
    lineage = Lineage(tuple(map(tuple, checkpoint["segments"])))
    assert [start for _, start in lineage.segments] == [0, 2, 4]
    for node in nodes:  # only files of the run's history are left, a few per client
        files = list(Path(node["state-dir"]).glob("*/client-*/*.pt"))
        assert files and len(files) <= 3
        assert all(lineage.holds(int(f.stem.split("-")[0]), f.stem.split("-")[1])
                   for f in files)


def test_a_node_that_lost_its_files_starts_afresh_and_is_flagged(tmp_path):
    """A resumed client whose node kept no file starts from fresh state: the server's ledger
    (the reported ε) keeps its rounds, and the run warns that its node's ledger is behind."""
    values = {**STATEFUL, "fraction-train": 1.0, "num-server-rounds": 4,
              "results-dir": str(tmp_path), "run-name": "flower"}
    nodes = [{"partition-id": i, "state-dir": str(tmp_path / f"node-{i}")} for i in range(5)]
    with pytest.raises(KeyboardInterrupt):
        run_flower_code_path(values, nodes, grid_class=killed_in(3, 5))
    nodes[4] = {**nodes[4], "state-dir": str(tmp_path / "empty")}
    run_flower_code_path({**values, "resume": True}, nodes)
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert len(set(summary["epsilon"].values())) == 1
    flagged = [w for w in summary["warnings"] if w.startswith("client ")]
    assert len(flagged) == 1 and flagged[0].startswith(
        "client 4's node reports fewer releases at round 2 than the server's ledger holds")


def node_epsilon(state_dir: Path, client: int, delta: float = 1e-5) -> float:
    """ε of client ``client``'s ledger as its node keeps it for the run (rdp)."""
    from dpfl.client.node_ledger import NodeLedger

    (path,) = state_dir.glob(f"*/ledger/client-{client}.json")
    return NodeLedger.from_json(path.read_text()).epsilon("rdp", delta)


def test_a_secure_noise_run_resumes_and_charges_what_the_interrupted_attempt_released(
        tmp_path):
    """secure-noise: resumable, not reproducible. Round 3 reached two nodes before the server
    died: their clients released it, and release it again, with fresh noise, in the resumed
    run. Their nodes count both; the server, told by their replies, charges both: every
    client's reported ε is its own node's ledger's."""
    values = {**STATEFUL, "fraction-train": 1.0, "num-server-rounds": 4, "secure-noise": True,
              "results-dir": str(tmp_path), "run-name": "flower"}
    nodes = [{"partition-id": i, "state-dir": str(tmp_path / f"node-{i}")} for i in range(5)]
    with pytest.raises(KeyboardInterrupt):
        run_flower_code_path(values, nodes, grid_class=killed_in(3, 2))
    run_flower_code_path({**values, "resume": True}, nodes)
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert summary["rounds_completed"] == 4 and summary["stopped_early"] is None
    charged = [w for w in summary["warnings"] if "did not hold" in w]
    assert [w.split("'")[0] for w in charged] == ["client 0", "client 1"]
    assert all("(1 × 'message', by round 3)" in w for w in charged)
    for c in range(5):
        assert summary["epsilon"][str(c)] == pytest.approx(
            node_epsilon(tmp_path / f"node-{c}", c), rel=1e-12)
    assert summary["epsilon"]["0"] > summary["epsilon"]["4"]  # 5 releases against 4
    assert summary["privacy"]["guarantee_against_server"] is True


def test_a_secure_engine_run_resumed_charges_the_rounds_after_its_checkpoint(tmp_path,
                                                                             monkeypatch):
    """The engine has no node to report: a secure-noise run that stopped in round 4 after its
    checkpoint of round 2 had released rounds 3 (recorded) and 4 (begun) with noise it does not
    draw again; its resumed run charges both to every client, then their new releases."""
    from dpfl.engine import runner

    values = {**STATEFUL, "fraction-train": 1.0, "num-server-rounds": 4, "secure-noise": True,
              "results-dir": str(tmp_path), "run-name": "engine"}
    exchange = runner.EngineTransport.send_and_receive

    def dies_in_round_4(self, name, server_round, *args):
        if server_round == 4:
            raise KeyboardInterrupt
        return exchange(self, name, server_round, *args)

    with monkeypatch.context() as patch:
        patch.setattr(runner.EngineTransport, "send_and_receive", dies_in_round_4)
        with pytest.raises(KeyboardInterrupt):
            run(RunConfig(values), echo=False)
    resumed = run(RunConfig({**values, "resume": True}), echo=False)
    longer = run(RunConfig({**values, "num-server-rounds": 6, "run-name": "six",
                            "resume": False}), echo=False)
    assert resumed["epsilon"] == longer["epsilon"]  # 2 + 2 charged + 2 run again
    assert [w for w in resumed["warnings"] if w.startswith("secure-noise")] == [
        "secure-noise: the interrupted attempt may have released rounds 3-4 with noise this "
        "resumed run does not draw again: they are charged to every client"]


@pytest.mark.flower
def test_a_flwr_run_continues_in_a_new_simulation_from_its_checkpoint(tmp_path, monkeypatch):
    """Through ``flwr run`` (Ray): a run stopped after its checkpoint is continued by a new
    simulation (a new SuperLink, run id and Contexts) with ``dpfl flower --resume``: the
    ServerApp takes the checkpoint, each virtual SuperNode's client its files on this
    machine, and the result is the engine's, bit for bit."""
    from dpfl.launch import flwr_run

    monkeypatch.setenv("DPFL_STATE_DIR", str(tmp_path / "state"))
    values = {**STATEFUL, "num-partitions": 4, "num-server-rounds": 2,
              "results-dir": str(tmp_path), "run-name": "flower"}
    assert flwr_run(values, flwr_home=tmp_path / "home", timeout=600) == 0
    assert main(["flower", "--resume", str(tmp_path / "flower"), "-c",
                 "num-server-rounds=4"]) == 0
    run(RunConfig({**values, "num-server-rounds": 4, "run-name": "engine"}), echo=False)
    assert_same_run(tmp_path / "flower", tmp_path / "engine", runtimes=True)
    assert list((tmp_path / "state").glob("*/client-*/*.pt"))
