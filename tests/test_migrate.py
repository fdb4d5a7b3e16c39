"""Migrating a run archive across a change of run-config keys, checked by re-running runs."""

from __future__ import annotations

import pytest

from dpfl_reproductions.lab import Lab, read_archive, run_key
from dpfl_reproductions.migrate import main

RUNS = [{"algorithm": "dpsgd-gc", "num-server-rounds": 2, "num-partitions": 3, "seed": s,
         "noise-multiplier": 1.0} for s in (0, 1)]


@pytest.fixture
def archive(tmp_path):
    lab = Lab(tmp_path / "lab", smoke=True)
    lab.run_many(RUNS)
    return lab.write_archive()


def test_a_migration_that_keeps_every_result_rekeys_every_run(archive, capsys):
    before = read_archive(archive)
    assert main([str(archive), "--set", "eval-every=1", "--check", "2"]) == 0  # the default
    after = read_archive(archive)
    assert set(after) == {run_key({**r, "eval-every": 1}) for r in RUNS}
    assert not set(after) & set(before)
    for key, old in before.items():
        new = after[run_key({**old["config"], "eval-every": 1})]
        assert new["summary"] == old["summary"]
    assert capsys.readouterr().out.count("(equal)") == 2


def test_a_migration_that_changes_a_result_is_refused_and_writes_nothing(archive, capsys):
    before = archive.read_bytes()
    assert main([str(archive), "--set", "learning-rate=0.5", "--check", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "computes something else under the migrated keys: test_loss" in err
    assert len(err.splitlines()) == 1
    assert archive.read_bytes() == before


@pytest.mark.parametrize("args, message", [
    (["--set", "beta=0.5"], "a migrated configuration is not valid: run config key 'beta': not "
                            "used by algorithm 'dpsgd-gc'"),
    (["--drop", "seed"], "maps 2 runs onto 1 configurations"),
    ([], "nothing to migrate"),
])
def test_a_migration_that_cannot_hold_is_refused_in_one_line(archive, capsys, args, message):
    before = archive.read_bytes()
    assert main([str(archive), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert archive.read_bytes() == before


def test_a_changed_field_is_dropped_not_compared(archive, tmp_path):
    out = tmp_path / "migrated.jsonl.gz"
    assert main([str(archive), "--set", "eval-every=1", "--changed", "epsilon_max",
                 "--check", "1", "--output", str(out)]) == 0
    assert all("epsilon_max" not in r["summary"] and "test_loss" in r["summary"]
               for r in read_archive(out).values())
    assert all("epsilon_max" in r["summary"] for r in read_archive(archive).values())


def test_where_migrates_only_the_matching_runs(archive, capsys):
    """A key only some algorithms read: ``--where`` picks the runs it is set for; the others are
    kept as they are, and only migrated runs are re-run."""
    before = read_archive(archive)
    assert main([str(archive), "--where", "seed=1", "--set", "eval-every=1", "--check", "5"]) == 0
    after = read_archive(archive)
    assert set(after) == {run_key(RUNS[0]), run_key({**RUNS[1], "eval-every": 1})}
    assert after[run_key(RUNS[0])] == before[run_key(RUNS[0])]
    assert capsys.readouterr().out.count("(equal)") == 1
    assert main([str(archive), "--where", "seed=7", "--set", "eval-every=1"]) == 2
    assert "no run matches --where seed=7" in capsys.readouterr().err
