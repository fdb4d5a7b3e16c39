"""One registry per kind of choice (algorithm, dataset, model, partitioner, ...).

A registry maps the name a user writes in the run config to the object that
implements it, so that adding a choice is one new entry, never an if-chain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from dpfl.errors import ConfigError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to implementations for the run-config key ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register ``obj`` under ``name``."""

        def add(obj: T) -> T:
            self.add(name, obj)
            return obj

        return add

    def register_class(self, cls: T) -> T:
        """Decorator: register a class under its ``name`` attribute."""
        self.add(cls.name, cls)  # type: ignore[attr-defined]
        return cls

    def add(self, name: str, obj: T) -> None:
        if name in self._entries:
            raise ValueError(f"{self.key} {name!r} is registered twice")
        self._entries[name] = obj

    def remove(self, name: str) -> None:
        """Unregister ``name`` (a plugin, or a test's probe, that is done)."""
        del self._entries[name]

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(self.key, f"unknown value {name!r}{did_you_mean(name, self)}",
                              allowed=self.names()) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
