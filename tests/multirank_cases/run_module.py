"""Copied as a test module into a scratch directory by tests/test_multirank_guard.py, beside
copies of conftest.py and _multirank.py, and run by pytest there: the unmarked test that names
the launcher must fail at setup, before its body (which would spawn one rank) runs."""

import pytest

from matrix_owner_optim.toolbox.launch import spawn_ranks


def _job(rank: int, world_size: int) -> int:
    return rank


def test_unmarked_spawner():
    spawn_ranks(_job, 1)


@pytest.mark.multirank
def test_marked_spawner():
    assert callable(spawn_ranks)  # names the launcher, spawns nothing


def test_plain():
    assert _job(0, 1) == 0
