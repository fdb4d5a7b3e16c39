"""dpfl's per-user cache folder, where downloads, nodes' records and optimised noise
strategies are kept between runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

CACHE_DIR_ENV = "DPFL_CACHE_DIR"


def user_cache() -> Path:
    """dpfl's per-user cache folder: ``$DPFL_CACHE_DIR``, else ``dpfl`` in the platform's user
    cache directory (``$XDG_CACHE_HOME`` or ``~/.cache`` on Linux, ``~/Library/Caches`` on
    macOS, ``%LOCALAPPDATA%`` on Windows)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser().absolute()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or "~/AppData/Local"
    elif sys.platform == "darwin":
        base = "~/Library/Caches"
    else:  # the XDG base directory spec: a relative $XDG_CACHE_HOME is ignored
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if Path(xdg).is_absolute() else "~/.cache"
    return Path(base).expanduser() / "dpfl"
