"""The command line a newcomer meets: ``dpfl keys``, suggestions for unknown names, and the
experiment names ``dpfl reproduce --list`` prints accepted as they are printed."""

from __future__ import annotations

import pytest

from dpfl.cli import main
from dpfl_reproductions import EXPERIMENTS
from tests.interrupting import STOPS, interrupted, round_done


def test_keys_lists_the_common_keys_and_each_algorithms_own(capsys):
    assert main(["keys"]) == 0
    out = capsys.readouterr().out
    assert 'epsilon=8.0  (ε)' in out and "Allowed: rdp, prv." in out
    assert "pcdp-sgd: batch-size, learning-rate, clip," in out
    assert "projection-dim" in out and "Local DP-SGD steps" not in out  # names only


def test_keys_of_an_algorithm_explain_its_own_keys_and_its_calibrations(capsys):
    assert main(["keys", "pcdp-sgd"]) == 0
    out = capsys.readouterr().out
    assert "Keys of algorithm pcdp-sgd:" in out
    assert "projection-dim=100  (k)" in out and "Allowed: rbs," in out
    assert main(["keys", "clip21-sgd2m"]) == 0
    assert 'Keys of calibration="practice":' in capsys.readouterr().out


def test_an_unknown_algorithm_or_value_suggests_the_nearest(capsys):
    assert main(["keys", "dpsgdgc"]) == 2
    err = capsys.readouterr()
    assert err.out == "" and "did you mean 'dpsgd-gc'" in err.err
    assert main(["run", "--run-config", 'accountant="rdpp"']) == 2
    assert "unknown value 'rdpp' (did you mean 'rdp'?) (allowed: rdp, prv)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("name", EXPERIMENTS.names())
def test_every_listed_experiment_name_is_accepted_as_printed(name, capsys):
    """``dpfl reproduce PAPER/EXPERIMENT`` resolves (the bad ``--only`` then stops it before
    anything runs, naming that experiment's axes)."""
    assert main(["reproduce", name, "--only", "nonsense=1"]) == 2
    assert "--only 'nonsense=1': expected AXIS=V1,V2" in capsys.readouterr().err


def test_a_paper_alone_names_its_experiments(capsys):
    assert main(["reproduce", "clip21"]) == 2
    assert "did you mean 'clip21/logreg'" in capsys.readouterr().err


def test_sigterm_takes_ctrl_cs_path_and_exits_143(tmp_path, monkeypatch, capsys):
    """SIGTERM mid-run, in-process: it interrupts the run where Ctrl-C would, the results folder
    is closed (interrupted), one line, exit status 143, and ``main`` gives back the SIGTERM
    handler it found."""
    import json
    import signal

    from dpfl.rounds import driver

    answered = driver.answered

    def terminated(request, transport):
        if isinstance(request, driver.ExchangeRequest) and request.server_round == 2:
            signal.raise_signal(signal.SIGTERM)
        return answered(request, transport)

    monkeypatch.setattr(driver, "answered", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["run", "-q", "-c", f'num-partitions=4 num-server-rounds=3 batch-size=16 '
                 f'results-dir="{tmp_path}" run-name="cut"']) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dpfl: interrupted"
    assert signal.getsignal(signal.SIGTERM) is before
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["stopped_early"] == "interrupted in round 2"


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "group", "status"), STOPS)
def test_ctrl_c_or_sigterm_on_dpfl_run_closes_its_results_folder(tmp_path, signum, group,
                                                                  status):
    """Ctrl-C, or SIGTERM: the results folder is closed (interrupted, with what was spent), one
    line, exit status 130 (143 for SIGTERM), no traceback."""
    import json

    stopped = interrupted(["run", "-c", f'num-server-rounds=500 results-dir="{tmp_path}" '
                           f'run-name="cut"'], round_done(2), signum, group)
    stopped.check(status)
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["stopped_early"].startswith("interrupted in round")
    assert "the run stopped after" in summary["calibration_check"]


def test_check_node_says_what_a_supernode_lacks_in_one_line(tmp_path, capsys, monkeypatch):
    """``dpfl check-node``: ready with the venv's programs on PATH; without them (the
    environment not activated: a SuperNode would hang, registered, never serving) one line
    naming the fix, exit status 2; a bad node config names its key."""
    import os
    import sys
    from pathlib import Path

    bin_dir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ.get("PATH", ""))
    config = f'partition-ids="0,1" state-dir="{tmp_path / "state"}"'
    assert main(["check-node", "--node-config", config]) == 0
    out = capsys.readouterr().out
    assert "clients [0, 1]; noise secure; ε at most 10" in out
    assert out.splitlines()[-1] == "this node can serve dpfl runs"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert main(["check-node", "--node-config", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "flower-supernode is not on PATH" in err[0]
    assert f"source {bin_dir}/activate" in err[0]
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + "/usr/bin:/bin")
    assert main(["check-node", "--node-config", 'partition-ids="0" secure-noise=true']) == 2
    assert capsys.readouterr().err.startswith("dpfl: error: node config key 'secure-noise'")


def test_dpfl_keys_says_whether_the_algorithm_takes_secure_aggregation(capsys):
    assert main(["keys", "clip21-sgd2m"]) == 0
    assert "secure-aggregation and distributed-noise: accepted" in capsys.readouterr().out
    assert main(["keys", "prisma"]) == 0
    assert "secure-aggregation and distributed-noise: refused: its uploads are built from noise" \
        in " ".join(capsys.readouterr().out.split())
