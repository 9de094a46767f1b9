"""The check that keeps the ``multirank`` marker true (tests/_multirank.py, conftest.py).

Its cases are source files under tests/multirank_cases/, read and never run: each test there is
preceded by the chain the check must find from it to a spawning primitive, or "none".
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from _multirank import spawn_path

TESTS = Path(__file__).resolve().parent
CASES = TESTS / "multirank_cases"


def _expectations(path: Path) -> dict[str, str]:
    """Test name -> the ``# expect:`` line above it."""
    lines = path.read_text().splitlines()
    out = {}
    for node in ast.parse("\n".join(lines)).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            above = lines[node.lineno - 2]
            m = re.fullmatch(r"# expect: (.*)", above)
            assert m, f"{node.name}: no '# expect:' line above it"
            out[node.name] = m.group(1)
    return out


def test_every_case_finds_its_chain() -> None:
    expected = _expectations(CASES / "case_module.py")
    assert len(expected) == 11  # every primitive, each way of reaching it, and three that spawn nothing
    found = {}
    for name in expected:
        chain = spawn_path(CASES / "case_module.py", name)
        found[name] = "none" if chain is None else " -> ".join(chain)
    assert found == expected


def test_an_unmarked_spawning_test_fails_before_it_runs(tmp_path: Path) -> None:
    """The conftest hook in a scratch suite: the unmarked spawner errors at setup with the
    chain, the marked one and the plain one pass."""
    for name in ("conftest.py", "_multirank.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    shutil.copy(CASES / "run_module.py", tmp_path / "test_cases.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    multirank: spawns ranks\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_cases.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: importing torch can take minutes on a loaded machine
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 passed, 1 error" in out, out
    assert "ERROR test_cases.py::test_unmarked_spawner" in out, out
    # the chain ends at the launcher's name (not spelled here: this module would read as spawning)
    assert "test_unmarked_spawner spawns ranks (test_unmarked_spawner -> spawn_" in out, out
