"""Per-parameter overrides by fqn glob (``roles=``, ``matrix_views=``): one rule for both.

``{"glob": value}``: the last glob matching any of a parameter's names (fqn and aliases) wins,
and a glob that matched nothing is an error when the caller checks (a typo must not pass
silently). Values are parsed once, when the overrides are built, naming the glob on error.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

__all__ = ["GlobOverrides"]

T = TypeVar("T")


class GlobOverrides(Generic[T]):
    """``{"fqn-glob": value}`` with validation; unmatched globs are reported, not ignored."""

    what: str = "overrides"  # the argument's name in messages
    scope: str = "parameter"  # what a glob must match
    example: str = "layers.0.attn.qkv.weight"  # an fqn to show what globs match

    def __init__(self, mapping: Mapping[str, object] | None, parse: Callable[[object, str], T]) -> None:
        self.rules: list[tuple[str, T]] = []
        for glob, value in (mapping or {}).items():
            if not isinstance(glob, str) or not glob:
                raise ValueError(f"{self.what}: every key must be a non-empty fqn glob, got {glob!r}")
            self.rules.append((glob, parse(value, f"{self.what}[{glob!r}]")))
        self._used: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.rules)

    def lookup(self, names: Iterable[str]) -> T | None:
        """The value of the last glob matching any of ``names`` (fqn and aliases)."""
        names = tuple(names)
        found: T | None = None
        for glob, value in self.rules:
            if any(fnmatch.fnmatchcase(n, glob) for n in names):
                found = value
                self._used.add(glob)
        return found

    def check_all_used(self) -> None:
        """Fail on a glob that matched no parameter."""
        unused = [g for g, _ in self.rules if g not in self._used]
        if unused:
            raise ValueError(
                f"{self.what}: glob {unused[0]!r} matches no {self.scope}; check the name (globs match "
                f"fully qualified names such as {self.example!r})"
            )
