"""An example README's ``dpfl`` commands, read as a user copies them, and run on a slice of the
example's data (tests/test_examples.py, tests/test_example_sms_spam_lora.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from dpfl.config import parse_overrides
from tests.conftest import bash_blocks

Command = tuple[dict[str, str], list[str], dict[str, object]]


def dpfl_commands(readme: Path, program: str) -> list[Command]:
    """``readme``'s ``... dpfl PROGRAM`` commands (continued lines joined): their environment
    assignments, their arguments and their run config."""
    found = []
    for block in bash_blocks(readme):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
            rest = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
            if rest[:2] == ["dpfl", program]:
                items = [rest[i + 1] for i, w in enumerate(rest) if w == "--run-config"]
                found.append((env, rest[1:], parse_overrides(items)))
    return found


def on_a_slice(argv: list[str], sizes: dict[str, str], options: str, results: Path,
               name: str) -> list[str]:
    """``argv`` with each ``sizes`` pattern replaced by its value (the slice's sizes), the
    dataset options ``options`` and a results folder ``results``/``name``."""
    for pattern, value in sizes.items():
        argv = [re.sub(pattern, value, word) for word in argv]
    return [*argv, "--run-config",
            f'dataset-options="{options}" results-dir="{results}" run-name="{name}"']
