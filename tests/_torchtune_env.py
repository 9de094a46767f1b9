"""The environment torchtune's test runs in: its own venv, because torchtune 0.6.1 needs torchao
0.14.x and PEFT 0.21 (in the test extra) refuses any torchao older than 0.16 at import.

``<repo>/.venv-torchtune`` sees the packages of the environment that creates it (torch, this
package, pytest): a ``.pth`` file in its site-packages adds the active environment's
site-packages directories (:func:`site.addsitedir`, so their own ``.pth`` files, editable
installs among them, work too), after its own. It does so whether the active environment is a
virtual environment or the base interpreter; ``--system-site-packages`` would see the base
interpreter's packages only, not a venv's. It gets only the pins below, against the
repository's constraints file (which pins torch, so pip never pulls another torch build).
``.ci/run`` creates it before the tests (``python tests/_torchtune_env.py``); the test creates it
if it is missing, and points an existing one at the active environment again if it lost sight
of it. About 15 s with PyPI reachable; afterwards it is reused as long as the pins import.
"""

from __future__ import annotations

import importlib.util
import site
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-torchtune"
PINS = ("torchtune==0.6.1", "torchao==0.14.1")  # pyproject's `torchtune` extra names the same
CHECK = (
    "import torch, matrix_owner_optim, torchtune, torchao; "
    "assert torchtune.__version__.startswith('0.6.1'), torchtune.__version__; "
    "print(matrix_owner_optim.__file__)"
)
LINK = "_moo_active_environment.pth"


def python() -> Path:
    return VENV / "bin" / "python"


def active_site_dirs() -> list[str]:
    """The site-packages directories of the environment running this (a venv's own, plus the
    base interpreter's where that venv was made with ``--system-site-packages``, plus the user
    site where it is enabled): what the torchtune venv must see."""
    dirs = list(site.getsitepackages())
    user = site.getusersitepackages()
    if site.ENABLE_USER_SITE and Path(user).is_dir():
        dirs.append(user)
    return dirs


def ready() -> bool:
    """Whether the venv imports the pins, and this package from where the active environment
    does (a venv made from another environment would test another copy)."""
    if not python().exists():
        return False
    done = subprocess.run([str(python()), "-c", CHECK], capture_output=True, text=True)
    spec = importlib.util.find_spec("matrix_owner_optim")
    here = spec.origin if spec is not None else None
    seen = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    return done.returncode == 0 and (here is None or seen == [here])


def link_active_environment() -> None:
    """Write the ``.pth`` that adds :func:`active_site_dirs` to the venv's ``sys.path``."""
    where = subprocess.run(
        [str(python()), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # one line, run by site.py with exec (a comprehension there would not see `site`)
    line = f"import site; list(map(site.addsitedir, {active_site_dirs()!r}))\n"
    (Path(where) / LINK).write_text(line)


def ensure() -> Path:
    """The venv's python, created and installed first if needed (raises with pip's output)."""
    if ready():
        return python()
    if python().exists():  # made from another environment (or before the link existed): relink
        link_active_environment()
        if ready():
            return python()
    venv.EnvBuilder(system_site_packages=False, clear=True, with_pip=True).create(VENV)
    link_active_environment()  # before pip runs, so that it sees torch as installed
    cmd = [str(python()), "-m", "pip", "install", "--quiet", "-c", str(ROOT / ".ci" / "constraints.txt"), *PINS]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not ready():
        check = subprocess.run([str(python()), "-c", CHECK], capture_output=True, text=True)
        raise RuntimeError(
            f"could not install {' '.join(PINS)} into {VENV} (PyPI must be reachable), or the venv cannot "
            f"import what it needs:\n{done.stdout}\n{done.stderr}\n{check.stderr[-2000:]}"
        )
    return python()


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
