"""The Flower app folder that ``flwr run`` and ``flwr build`` read.

A Flower app is a folder holding a ``pyproject.toml`` with ``[tool.flwr.app]`` (components
and run-config defaults) and the files that ``fab-include`` names. In a source checkout that
folder is the checkout itself. An installed wheel carries the checkout's ``pyproject.toml``,
``README.md`` and ``LICENSE`` unchanged in its ``.dist-info/extra_metadata/flower-app/``
(``[tool.hatch.build.targets.wheel.extra-metadata]``), and :func:`write_app` puts them beside
a copy of the installed ``dpfl`` package: the same folder, so the same FAB. ``dpfl flower``
runs such a written folder in a checkout too (:func:`app_folder`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent
# the files of the app folder besides the package, as the wheel's extra metadata holds them
APP_FILES = ("pyproject.toml", "README.md", "LICENSE")
PACKAGED = "extra_metadata/flower-app"


def checkout() -> Path | None:
    """The source checkout dpfl runs from (an editable install), or None for an installed
    wheel."""
    return CHECKOUT if (CHECKOUT / "pyproject.toml").is_file() else None


def packaged_file(name: str) -> bytes:
    """One of :data:`APP_FILES` as the installed wheel carries it."""
    try:
        text = distribution("dpfl").read_text(f"{PACKAGED}/{name}")
    except PackageNotFoundError:
        text = None
    if text is None:
        raise FileNotFoundError(f"the installed dpfl carries no {PACKAGED}/{name}: reinstall "
                                "it from a wheel, or run from a source checkout")
    return text.encode()


def write_app(folder: Path) -> Path:
    """Write the Flower app folder to ``folder`` (which must not exist, or be empty): the
    app files, from the checkout or the installed wheel, and the ``dpfl`` package's sources."""
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty")
    root = checkout()
    for name in APP_FILES:
        (folder / name).write_bytes((root / name).read_bytes() if root else packaged_file(name))
    shutil.copytree(PACKAGE, folder / "dpfl", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


@contextmanager
def app_folder() -> Iterator[Path]:
    """The app folder for ``flwr run``, written to a temporary folder removed on exit (from
    the checkout or the installed wheel: :func:`write_app`). In a checkout too: the FAB is the
    same, and Flower's FAB builder visits every file under the folder it is given before it
    filters them, a virtual environment's tens of thousands included (about 4 s of a run's
    start with ``.venv`` in the checkout; a written folder takes about 0.1 s)."""
    with tempfile.TemporaryDirectory(prefix="dpfl-app-") as tmp:
        yield write_app(Path(tmp) / "dpfl")
