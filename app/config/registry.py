"""Name → implementation tables tied to the allowed names that `app.config.schema` declares.

The schema's tuples are the one list of names: validation checks a config against them, and
the code that acts on a name looks it up in a `Registry` built from the same tuple. A name the
schema allows without an implementation (or the reverse) fails when the acting module is
imported, not at a run's first use of it. Dependency-free, like the schema: the ClientApp
imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from app.config.schema import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """The implementations of config key `key`'s allowed names, exactly those."""

    def __init__(self, key: str, allowed: tuple[str, ...], table: Mapping[str, T]) -> None:
        if set(table) != set(allowed):
            raise TypeError(f"{key}: the schema allows {sorted(allowed)}, the implementations are {sorted(table)}")
        self.key, self.allowed, self._table = key, allowed, dict(table)

    def __getitem__(self, name: str) -> T:
        """The implementation of `name`; a ConfigError naming the key for any other (the ClientApp
        receives its settings in a message, which app.config.validate has not seen)."""
        if name not in self._table:
            raise ConfigError(f"{self.key}={name!r} is invalid: allowed: {', '.join(self.allowed)}")
        return self._table[name]
