"""reports/verdict_intervals.py: every interval and mean ± std cell of the docs' verdict table
recomputes from the reports' archives as printed; an edited digit is a difference, and a
selection that is not one run per seed and method is refused."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("verdict_intervals",
                                                  ROOT / "reports" / "verdict_intervals.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["verdict_intervals"] = module  # a dataclass resolves its module by name
    spec.loader.exec_module(module)
    return module


verdict = _script()

DOCS = ROOT / "docs" / "reproductions.md"
REPORTS = ROOT / "reports"
INTERVAL = "+5.97 [+4.62, +7.32]"  # Clip21-SGD2M − Clip-SGD at ε = 3
EDITED = "+5.97 [+4.62, +7.33]"


def _edited_docs(tmp_path: Path) -> Path:
    text = DOCS.read_text(encoding="utf-8")
    assert text.count(INTERVAL) == 1
    docs = tmp_path / "reproductions.md"
    docs.write_text(text.replace(INTERVAL, EDITED), encoding="utf-8")
    return docs


def _recomputed(lines, printed: str) -> list[tuple[str, str]]:
    """(recomputed, status) of each line of ``printed``."""
    return [(recomputed, status) for _, _, shown, recomputed, status in lines
            if shown == printed]


def test_every_interval_and_cell_of_the_verdict_table_recomputes_as_printed(capsys):
    assert verdict.main(["--docs", str(DOCS), "--reports", str(REPORTS)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.endswith("| OK") for line in out) == len(verdict.SPECS)
    assert sum(line.endswith("| NOT RECOMPUTABLE") for line in out) == len(
        verdict.NOT_RECOMPUTABLE)
    assert not [line for line in out if line.endswith(verdict.FAILING)]


def test_the_statistics_and_the_docs_formatting():
    assert verdict.t_interval([1.0, 2.0, 3.0]) == pytest.approx((2.0, -0.4841377, 4.4841377))
    spec = verdict.SPECS[0]
    assert verdict.render(dataclasses.replace(spec, printed="+0.1 [−0.001, +3]"),
                          (0.04, -0.0004, 2.6)) == "+0.0 [−0.000, +3]"
    ratio = dataclasses.replace(spec, statistic="ratio", printed="4.72× [0.31, 72.8]")
    assert verdict.render(ratio, (4.7249, 0.3061, 72.84)) == "4.72× [0.31, 72.8]"


def test_an_edited_digit_in_the_docs_is_a_difference(tmp_path, capsys, monkeypatch):
    docs = _edited_docs(tmp_path)
    assert verdict.main(["--docs", str(docs), "--reports", str(REPORTS)]) == 1
    out = capsys.readouterr().out
    assert (f"printed {INTERVAL} | recomputed {INTERVAL} (the row does not print the spec's "
            "string) | DIFF") in out
    assert f"printed {EDITED} | recomputed no spec, not in NOT_RECOMPUTABLE | UNCOVERED" in out
    # the spec edited as the docs were: the recomputation itself differs
    monkeypatch.setattr(verdict, "SPECS", tuple(
        dataclasses.replace(spec, printed=EDITED) if spec.printed == INTERVAL else spec
        for spec in verdict.SPECS))
    lines = verdict.check(docs.read_text(encoding="utf-8"), REPORTS)
    assert _recomputed(lines, EDITED) == [(INTERVAL, "DIFF")]
    assert not [line for line in lines if line[4] in verdict.FAILING and line[2] != EDITED]


def test_a_selection_that_is_not_one_run_per_seed_is_refused(monkeypatch):
    spec = next(s for s in verdict.SPECS if s.printed == "+23.4 [+11.0, +35.8]")
    dp_fedavg = spec.theirs[0]
    # without proximal-mu=null DP-FedAvg's filter holds DP FedProx's runs too
    loose = dataclasses.replace(dp_fedavg, keys=tuple(
        (k, v) for k, v in dp_fedavg.keys if k != "proximal-mu"))
    with pytest.raises(verdict.SelectionError, match="seed 0: 2 runs"):
        verdict.select(REPORTS, loose, spec.seeds)
    missing = dataclasses.replace(dp_fedavg, keys=(*dp_fedavg.keys, ("noise-multiplier", 5)))
    with pytest.raises(verdict.SelectionError, match="seed 0: 0 runs"):
        verdict.select(REPORTS, missing, spec.seeds)
    monkeypatch.setattr(verdict, "SPECS", (dataclasses.replace(spec, theirs=(loose,)),))
    lines = verdict.check(DOCS.read_text(encoding="utf-8"), REPORTS)
    [(why, status)] = _recomputed(lines, spec.printed)
    assert status == "REFUSED" and "must match one run per seed (seed 0: 2 runs" in why
    assert verdict.main(["--docs", str(DOCS), "--reports", str(REPORTS)]) == 1
