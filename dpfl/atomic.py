"""Files written whole or not at all: a temporary file in the same folder, then a rename."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, save: Callable[[Path], None]) -> None:
    """Write ``path`` through ``save`` into a temporary file beside it, then rename it into
    place: a reader (or a process killed mid-write) sees the old file or the new one, never
    half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    try:
        save(Path(temporary))
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)
