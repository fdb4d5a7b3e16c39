"""Every benchmark script imports what it uses (``make bench`` runs them only at the end of a
long run, where a broken import would stop it), and ``make bench``'s GPU form
(``benchmarks/run_all.py --device cuda``, run where a GPU is; here only its refusals, one line
each, before any benchmark starts)."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, bash_blocks

BENCHMARKS = ROOT / "benchmarks"
RUN_ALL = BENCHMARKS / "run_all.py"


def _load(script: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{script[:-3]}", BENCHMARKS / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_the_benchmark_script_imports(script, monkeypatch):
    _load(script, monkeypatch)


def test_a_benchmark_rerun_into_earlier_rows_replaces_its_rows_in_place(monkeypatch):
    """``run_all.py --rows-from FILE --only NAME``: the re-run's rows stand where that
    benchmark's rows stood, another benchmark's rows of the same section kept; rows of a
    benchmark FILE lacks (an interrupted run going on) follow."""
    run_all = _load("run_all.py", monkeypatch)

    def row(benchmark: str, section: str, measure: str):
        return run_all.Row(section, measure, "w", "", 1.0, 1.0, 1.0, "×", 1,
                           benchmark=benchmark)
    earlier = [row("bench_limit", "hardware limit", "a"), row("bench_limit", "hardware limit", "b"),
               row("bench_scale", "scale", "c"), row("bench_flower_scale", "scale", "f")]
    rerun = [row("bench_limit", "hardware limit", m) for m in ("a2", "b2", "d")]
    assert run_all.replaced(earlier, rerun) == [*rerun, *earlier[2:]]
    scale = [row("bench_scale", "scale", "c2")]
    assert run_all.replaced(earlier, scale) == [*earlier[:2], *scale, earlier[3]]
    memory = [row("bench_memory", "memory", "m")]
    assert run_all.replaced(earlier, memory) == [*earlier, *memory]
    assert run_all.replaced(earlier, []) == earlier


def test_a_benchmark_names_itself_in_the_rows_it_writes(tmp_path, monkeypatch):
    common = _load("common.py", monkeypatch)
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "bench_scale.py")])
    rows = tmp_path / "rows.jsonl"
    common.emit([common.Row("scale", "m", "w", "", 1.0, 1.0, 1.0, "s", 1)], rows)
    loaded = common.load(rows)
    assert [r.benchmark for r in loaded] == ["bench_scale"]
    common.save(loaded, rows)  # what run_all.py keeps of a --rows-from file
    assert common.load(rows) == loaded


def _run_all(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN_ALL), *args], capture_output=True,
                          text=True, timeout=120)


def test_a_cpu_only_benchmark_on_the_gpu_is_refused_naming_the_ones_that_run_there():
    done = _run_all("--device", "cuda", "--only", "bench_scale", "bench_flower_scale")
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.strip() == (
        "run_all.py: --device cuda: bench_flower_scale runs on the CPU only (allowed: "
        "bench_limit, bench_per_sample, bench_memory, bench_scale)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without one")
def test_the_gpu_form_without_a_gpu_stops_in_one_line_before_any_benchmark():
    done = _run_all("--device", "cuda")
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.strip() == "run_all.py: --device cuda, but torch sees no CUDA device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without one")
def test_the_gpu_commands_of_the_performance_guide_name_what_exists():
    """docs/performance.md's GPU block: its test module exists, and its `run_all.py` line
    parses as written (here, without a GPU, it stops at the device in one line)."""
    block = next(b for b in bash_blocks(ROOT / "docs" / "performance.md") if "--device cuda" in b)
    pytest_line, bench_line = block.strip().splitlines()
    assert (ROOT / shlex.split(pytest_line)[-1]).exists()
    words = shlex.split(bench_line)
    assert words[:2] == [".venv/bin/python", "benchmarks/run_all.py"]
    done = _run_all(*words[2:])
    assert done.returncode == 2
    assert done.stderr.strip() == "run_all.py: --device cuda, but torch sees no CUDA device"
