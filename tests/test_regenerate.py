"""reports/regenerate.py: a committed report regenerates from its own archive with equal cells,
and the check fails, naming the cell, where one differs."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest

from tests.conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("regenerate", ROOT / "reports" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["regenerate"] = module  # a dataclass resolves its module by name
    spec.loader.exec_module(module)
    return module


regenerate = _script()

REPORT = """# A title

Mode: full; wall time of this invocation 4.6 s on 2 CPU cores.

Some prose with a number, 0.5.

### Table 2: lowest training loss

| level | method | loss |
|---|---|---|
| Lv.1 | DP-FedAvg | 6.73e-06 |
| Lv.1 | AdaptDP-FedAvg | 3.34e-07 |

![a figure](figure1.png)

*a figure*
"""


def test_tables_are_compared_cell_by_cell_and_the_header_and_prose_are_not():
    assert regenerate.differences(REPORT, REPORT) == []
    retimed = REPORT.replace("4.6 s", "1.2 s").replace("0.5.", "0.6.")
    assert regenerate.differences(REPORT, retimed) == []
    edited = REPORT.replace("3.34e-07", "3.35e-07")
    assert regenerate.differences(REPORT, edited) == [
        "Table 2: lowest training loss: row 2, loss: '3.34e-07' became '3.35e-07'"]
    shorter = REPORT.replace("| Lv.1 | AdaptDP-FedAvg | 3.34e-07 |\n", "")
    assert regenerate.differences(REPORT, shorter) == [
        "Table 2: lowest training loss: 2 rows committed, 1 regenerated"]
    added = REPORT.replace("### Table 2", "### A new section\n\n| a |\n|---|\n| 1 |\n\n### Table 2")
    assert regenerate.differences(REPORT, added) == []  # a section added since
    assert regenerate.differences(added, REPORT) == ["A new section: not in the regenerated report"]


def test_every_report_folder_is_regenerated_or_skipped_with_its_reason():
    todo, skipped = regenerate.plan(ROOT / "reports", [])
    folders = {job.folder.name for job in todo} | {name for name, _ in skipped}
    assert folders == {p.name for p in (ROOT / "reports").iterdir() if p.is_dir()}
    assert not [name for name, why in skipped if "EXPERIMENTS" in why]  # none unmapped
    probe = [job for job in todo if job.folder.name == "pcdp-federated-mnist-probe"]
    assert [(job.report, job.only.get("reading")) for job in probe] == [
        ("report-code.md", None), ("report-plain.md", ["plain"])]


@pytest.mark.slow
def test_a_committed_report_regenerates_from_its_archive_with_equal_cells(capsys):
    """AdaptDP-FedAvg's T1 (its grid ranked by the mean training loss over two seeds, then the
    walk past the grid's edge) and the secure-aggregation gain (a step axis ranked on a
    validation split): no run, every table equal."""
    assert regenerate.main(["adaptive-t1", "secagg-gain"]) == 0
    out = capsys.readouterr().out
    assert "adaptive-t1: equal" in out and "secagg-gain: equal" in out


@pytest.mark.slow
def test_a_regenerated_cell_that_differs_fails_the_check_naming_it(tmp_path, capsys):
    committed = ROOT / "reports" / "adaptive-t1"
    copy = tmp_path / "adaptive-t1"
    copy.mkdir()
    for name in ("report.md", "report.json", "runs.jsonl.gz"):
        shutil.copy(committed / name, copy / name)
    report = (committed / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| Lv.1 | DP-FedAvg |"))
    cell = row.split(" | ")[2]
    (copy / "report.md").write_text(report.replace(row, row.replace(cell, "1.00e-06 ± 0", 1)))
    assert regenerate.main(["--reports", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "adaptive-t1: differs" in out
    assert f"row 1, train loss, R = 150: '1.00e-06 ± 0' became '{cell}'" in out
