"""The environment torchtune's test runs in: its own venv, because torchtune 0.6.1 needs torchao
0.14.x and PEFT 0.21 (in the test extra) refuses any torchao older than 0.16 at import.

``<repo>/.venv-torchtune`` is created with ``--system-site-packages`` (it sees the installed
torch, this package and pytest) and gets only the pins below, against the repository's
constraints file (which pins torch, so pip never pulls another torch build). ``.ci/run`` creates
it before the tests (``python tests/_torchtune_env.py``); the test creates it if it is missing.
About 15 s with PyPI reachable; afterwards it is reused as long as the pins import.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-torchtune"
PINS = ("torchtune==0.6.1", "torchao==0.14.1")  # pyproject's `torchtune` extra names the same
CHECK = "import torchtune, torchao; assert torchtune.__version__.startswith('0.6.1'), torchtune.__version__"


def python() -> Path:
    return VENV / "bin" / "python"


def ready() -> bool:
    if not python().exists():
        return False
    return subprocess.run([str(python()), "-c", CHECK], capture_output=True).returncode == 0


def ensure() -> Path:
    """The venv's python, created and installed first if needed (raises with pip's output)."""
    if ready():
        return python()
    venv.EnvBuilder(system_site_packages=True, clear=True, with_pip=True).create(VENV)
    cmd = [str(python()), "-m", "pip", "install", "--quiet", "-c", str(ROOT / ".ci" / "constraints.txt"), *PINS]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not ready():
        raise RuntimeError(
            f"could not install {' '.join(PINS)} into {VENV} (PyPI must be reachable):\n{done.stdout}\n{done.stderr}"
        )
    return python()


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
