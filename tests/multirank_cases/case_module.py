"""Cases for tests/test_multirank_guard.py: each test's expected chain to a spawning primitive
(tests/_multirank.py) is the comment above it, "none" where it spawns nothing. Never collected
or run (the name does not start with test_); only read."""

import functools
import subprocess
import sys

import pytest
import torch.multiprocessing as mp
from _case_helper import helper_that_spawns, plain_helper

from matrix_owner_optim.toolbox.launch import spawn_ranks

SCRIPT = "import torch.multiprocessing as mp\nmp.spawn(print, nprocs=2)\n"
CMD = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "script.py"]


def _job(rank: int, world_size: int) -> int:
    return rank


@functools.cache
def results() -> list:
    return spawn_ranks(_job, 2)


@pytest.fixture(scope="module")
def spawned() -> list:
    return results()


@pytest.fixture
def quiet() -> int:
    return 0


def _recursive(n: int) -> int:
    """Mentions spawn_ranks in prose only, and calls itself."""
    return 0 if n == 0 else _recursive(n - 1)


# expect: test_direct -> spawn_ranks
def test_direct():
    spawn_ranks(_job, 2)


# expect: test_through_a_cached_function -> results -> spawn_ranks
def test_through_a_cached_function():
    assert results()


# expect: test_through_a_fixture -> spawned -> results -> spawn_ranks
def test_through_a_fixture(spawned):
    assert spawned


# expect: test_mp_spawn -> mp.spawn
def test_mp_spawn():
    mp.spawn(_job, args=(2,), nprocs=2)


# expect: test_a_script_that_spawns -> SCRIPT -> the string 'torch.multiprocessing'
def test_a_script_that_spawns(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    subprocess.run([sys.executable, str(tmp_path / "s.py")], check=True)


# expect: test_torchrun -> CMD -> the string 'torch.distributed.run'
def test_torchrun():
    subprocess.run(CMD, check=True)


# expect: test_the_train_command -> the CLI command 'train'
def test_the_train_command():
    subprocess.run([sys.executable, "-m", "matrix_owner_optim", *["train", "--steps", "1"]], check=True)


# expect: test_a_helper_module -> _case_helper.helper_that_spawns -> spawn_ranks
def test_a_helper_module():
    helper_that_spawns()


# expect: none
def test_plain(quiet):
    assert plain_helper() == quiet


# expect: none
def test_prose_and_recursion():
    """Calls a function whose docstring names the launcher: prose is not a call."""
    assert _recursive(3) == 0


# expect: none
def test_a_plan_command():
    subprocess.run([sys.executable, "-m", "matrix_owner_optim", "plan", "--help"], check=True)
