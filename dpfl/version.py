"""dpfl's version, as ``pyproject.toml`` states it."""

__version__ = "0.1.0"
