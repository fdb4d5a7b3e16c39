"""The package outside the checkout: the wheel carries the Flower app's files unchanged, the
FAB unpacks to a project pip builds and holds the dependency pins, and an installed wheel runs
``dpfl run``, ``dpfl flower`` and writes the app ``flwr run`` reads, from any folder."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from dpfl.cli import main
from dpfl.flower_app import APP_FILES, PACKAGED
from dpfl.launch import _cmdlines, stop
from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BIN = Path(sys.executable).parent


def build_wheel(folder: Path, project: Path = ROOT) -> Path:
    """``pip wheel`` of ``project`` into ``folder`` with the installed hatchling (offline)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", str(project), "-w", str(folder)], check=True,
                   capture_output=True, timeout=300)
    return next(folder.glob("dpfl-*.whl"))


def build_fab(app: Path, folder: Path) -> Path:
    """``flwr build --app app``, the FAB written to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(BIN / "flwr"), "build", "--app", str(app)], cwd=folder, check=True,
                   capture_output=True, timeout=300)
    return next(folder.glob("*.fab"))


def test_the_wheel_carries_the_app_files_unchanged(tmp_path):
    """The wheel's copy of pyproject.toml (the app's components and run-config defaults
    included), README.md and LICENSE is the checkout's, byte for byte: they cannot drift."""
    extra = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["extra-metadata"]
    assert extra == {name: f"flower-app/{name}" for name in APP_FILES}
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as whl:
        for name in APP_FILES:
            packaged = whl.read(f"dpfl-{PYPROJECT['project']['version']}.dist-info/"
                                f"{PACKAGED}/{name}")
            assert packaged == (ROOT / name).read_bytes(), name


def pins(lines: list[str]) -> dict[str, str]:
    """``{name: version}`` of ``name==version`` lines (comments and blanks skipped)."""
    out = {}
    for line in lines:
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            out[canonicalize_name(req.name)] = spec.version
    return out


def test_constraints_txt_and_pyproject_pin_the_same_versions_of_every_dependency():
    uv = pins(PYPROJECT["tool"]["uv"]["constraint-dependencies"])
    assert uv == pins((ROOT / "constraints.txt").read_text().splitlines())
    for dependency in PYPROJECT["project"]["dependencies"]:
        req = Requirement(dependency)
        assert req.specifier.contains(uv[canonicalize_name(req.name)]), dependency


@pytest.mark.slow
def test_the_fab_unpacks_to_a_project_pip_builds_and_holds_the_pins(tmp_path):
    fab = build_fab(ROOT, tmp_path / "fab")
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(fab) as archive:
        archive.extractall(unpacked)
    for name in APP_FILES:
        assert (unpacked / name).is_file(), name
    config = tomllib.loads((unpacked / "pyproject.toml").read_text())
    assert config["tool"]["uv"] == PYPROJECT["tool"]["uv"]  # what Flower's `uv sync` reads
    wheel = build_wheel(tmp_path / "wheel", unpacked)
    with zipfile.ZipFile(wheel) as whl:
        assert "dpfl/server/app.py" in whl.namelist()


def test_export_app_writes_the_app_folder_and_refuses_a_folder_in_use(tmp_path, capsys):
    assert main(["export-app", str(tmp_path / "app")]) == 0
    for name in APP_FILES:
        assert (tmp_path / "app" / name).read_bytes() == (ROOT / name).read_bytes(), name
    assert (tmp_path / "app" / "dpfl" / "server" / "app.py").is_file()
    assert main(["export-app", str(tmp_path / "app")]) == 2
    assert capsys.readouterr().err == f"dpfl: error: {tmp_path / 'app'} is not empty\n"


def flower_scripts(bindir: Path) -> None:
    """Write Flower's console scripts (``flwr``, ``flower-superlink`` ...) to ``bindir``, run
    by its interpreter: the venv reuses this environment's packages, flwr included."""
    for ep in distribution("flwr").entry_points.select(group="console_scripts"):
        assert "." not in ep.attr, ep
        script = bindir / ep.name
        script.write_text(f"#!{bindir / 'python'}\nimport sys\nfrom {ep.module} import "
                          f"{ep.attr}\nsys.exit({ep.attr}())\n")
        script.chmod(0o755)


@pytest.mark.flower
def test_an_installed_wheel_runs_outside_the_checkout(tmp_path):
    """A fresh venv holding the wheel (its dependencies taken from this environment): from a
    folder that is not the checkout, ``dpfl run`` and ``dpfl flower`` complete, and the app
    that ``dpfl export-app`` writes builds the checkout's FAB, byte for byte."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    wheel = build_wheel(tmp_path / "dist")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    site = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig"
                           ".get_paths()['purelib'])"], check=True, capture_output=True,
                          text=True).stdout.strip()
    # after the install, so that pip never sees (nor touches) this environment's editable dpfl
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    flower_scripts(venv / "bin")
    work = tmp_path / "work"
    work.mkdir()
    where = subprocess.run([venv / "bin" / "python", "-c", "import dpfl; print(dpfl.__file__)"],
                           cwd=work, check=True, capture_output=True, text=True).stdout
    assert where.startswith(site), where

    def dpfl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([venv / "bin" / "dpfl", *args], cwd=work, capture_output=True,
                              text=True, timeout=300)

    config = 'num-partitions=4 num-server-rounds=2 batch-size=16 seed=1 run-name="{}"'
    try:
        done = dpfl("run", "-q", "-c", config.format("engine"))
        assert done.returncode == 0, done.stdout + done.stderr
        done = dpfl("flower", "-c", config.format("flower"))
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        stop([pid for pid, cmd in _cmdlines().items() if str(venv) in cmd])
    for run in ("engine", "flower"):
        assert (work / "results" / run / "model.pt").is_file(), run
    done = dpfl("export-app", "app")
    assert done.returncode == 0, done.stdout + done.stderr
    assert build_fab(work / "app", tmp_path / "a").name == build_fab(ROOT, tmp_path / "b").name
