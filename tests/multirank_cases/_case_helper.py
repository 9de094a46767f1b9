"""A helper module beside case_module.py, as tests/_ref.py is beside the tests."""

from matrix_owner_optim.toolbox.launch import spawn_ranks


def _job(rank: int, world_size: int) -> int:
    return rank


def helper_that_spawns() -> list:
    return spawn_ranks(_job, 2)


def plain_helper() -> int:
    return 0
