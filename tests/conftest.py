"""Shared fixtures: deterministic seeds for every test; the ``multirank`` marker kept true."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from _multirank import spawn_path

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _spawns(item: pytest.Item) -> list[str] | None:
    """How ``item`` spawns ranks (a chain of names, see _multirank.py), through its own function
    or any fixture it uses that is defined in tests/; None if it does not."""
    roots = [getattr(item, "function", None)]
    for defs in item._fixtureinfo.name2fixturedefs.values():  # type: ignore[attr-defined]
        roots += [d.func for d in defs]
    for fn in roots:
        if fn is None:
            continue
        try:
            path = Path(inspect.getsourcefile(fn) or "").resolve()
        except TypeError:  # a builtin
            continue
        if path.parent != TESTS:
            continue  # pytest's own fixtures (tmp_path, ...)
        chain = spawn_path(path, fn.__qualname__.split(".")[0])
        if chain is not None:
            return chain
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every test that spawns ranks carries ``@pytest.mark.multirank`` (on itself, its class or
    its module's ``pytestmark``), so that ``-m "not multirank"`` really starts no rank process.
    Checked before any fixture is set up, so an unmarked test fails (naming the chain from the
    test to the spawning call) before it spawns anything; it fails in every run that selects it,
    with or without xdist (a collection-time error would abort xdist workers instead)."""
    if item.get_closest_marker("multirank") is None:
        chain = _spawns(item)
        if chain is not None:
            pytest.fail(
                f"{item.nodeid} spawns ranks ({' -> '.join(chain)}) but is not marked "
                "@pytest.mark.multirank (or pytestmark = pytest.mark.multirank for its module)",
                pytrace=False,
            )
