"""The optimizer registry: built-ins in code, collisions raise naming both sides, lazy loading.

Throwaway distributions are ``*.dist-info`` directories written into a temporary directory put
on ``sys.path``: ``importlib.metadata`` finds them as installed distributions.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.optim.registry import (
    BUILTINS,
    available_optimizers,
    register_preconditioner,
    resolve_optimizer,
)
from matrix_owner_optim.preconditioners import Muon


def _write_dist(root: Path, dist: str, module: str, entries: dict[str, str]) -> None:
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {module}:{attr}\n" for name, attr in entries.items())
    (info / "entry_points.txt").write_text(f"[matrix_owner_optim.preconditioners]\n{lines}")


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The plugin's module records that it was imported (lazy loading is observable).
    (tmp_path / "moo_throwaway_plugin.py").write_text(
        "import torch\nIMPORTED = True\nclass HalfSGD(torch.optim.SGD):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "moo_throwaway_plugin", raising=False)
    return tmp_path


def test_entry_point_colliding_with_a_builtin_raises_and_its_new_name_works(
    plugin_dir: Path,
) -> None:
    _write_dist(
        plugin_dir, "moo-throwaway-plugin", "moo_throwaway_plugin", {"muon": "HalfSGD", "moo_half_sgd": "HalfSGD"}
    )
    assert "moo_half_sgd" in available_optimizers()
    assert "moo_throwaway_plugin" not in sys.modules  # listing names imports nothing
    with pytest.raises(ValueError) as info:
        resolve_optimizer("muon")
    msg = str(info.value)
    assert "built-in" in msg and BUILTINS["muon"] in msg
    assert "moo-throwaway-plugin" in msg and "moo_throwaway_plugin:HalfSGD" in msg
    with pytest.raises(ValueError, match="moo-throwaway-plugin"):
        OwnerRoutedOptimizer(torch.nn.Linear(3, 3))  # matrix="muon" by default
    factory = resolve_optimizer("moo_half_sgd")
    assert factory.__name__ == "HalfSGD" and "moo_throwaway_plugin" in sys.modules
    opt = OwnerRoutedOptimizer(torch.nn.Linear(3, 3), matrix="moo_half_sgd", matrix_options={"lr": 0.1})
    assert type(opt.matrix_optimizer).__name__ == "HalfSGD"


def test_two_distributions_declaring_one_name_raise_naming_both(plugin_dir: Path) -> None:
    _write_dist(plugin_dir, "moo-first-plugin", "moo_throwaway_plugin", {"moo_twice": "HalfSGD"})
    _write_dist(plugin_dir, "moo-second-plugin", "moo_throwaway_plugin", {"moo_twice": "Other"})
    with pytest.raises(ValueError) as info:
        resolve_optimizer("moo_twice")
    msg = str(info.value)
    assert "moo-first-plugin" in msg and "moo-second-plugin" in msg
    assert "moo_throwaway_plugin" not in sys.modules


def test_builtins_are_registered_in_code() -> None:
    assert set(BUILTINS) >= {"muon", "shampoo", "soap", "adamw", "adam", "sgd", "torch_muon", "torch_optimizer_shampoo"}
    assert resolve_optimizer("MUON") is Muon
    assert resolve_optimizer("adamw") is torch.optim.AdamW
    with pytest.raises(ValueError, match="'muon' is a built-in"):
        register_preconditioner("muon", torch.optim.SGD)
    register_preconditioner("muon", Muon)  # the same object: not a collision
    with pytest.raises(ValueError, match="unknown matrix optimizer 'lion'.*muon"):
        resolve_optimizer("lion")


def test_builtins_load_lazily() -> None:
    code = (
        "import sys\n"
        "from matrix_owner_optim.optim.registry import available_optimizers, "
        "resolve_optimizer\n"
        "assert 'torch_optimizer_shampoo' in available_optimizers()\n"
        "resolve_optimizer('muon')\n"
        "assert 'torch_optimizer' not in sys.modules\n"
        "resolve_optimizer('torch_optimizer_shampoo')\n"
        "assert 'torch_optimizer' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_one_entry_holds_the_factory_and_its_cost() -> None:
    from matrix_owner_optim.planning import ADAMW_COST, FunctionCostModel, resolve_cost
    from matrix_owner_optim.planning.catalog import lookup
    from matrix_owner_optim.planning.cost import TORCH_OPTIMIZER_SHAMPOO_COST

    assert (
        resolve_cost("adamw") is ADAMW_COST and resolve_cost("torch_optimizer_shampoo") is TORCH_OPTIMIZER_SHAMPOO_COST
    )  # whole-matrix
    code = (  # pricing a built-in by name imports no optimizer
        "import sys\n"
        "from matrix_owner_optim.planning import resolve_cost\n"
        "assert resolve_cost('torch_optimizer_shampoo').name == 'torch_optimizer_shampoo'\n"
        "assert 'torch_optimizer' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    class Half(torch.optim.SGD):
        pass

    cost = FunctionCostModel("moo_priced", lambda shape, dtype: 1, lambda shape: 1.0)
    register_preconditioner("moo_priced", Half, cost_model=cost, overwrite=True)
    entry = lookup("MOO_PRICED")
    assert entry is not None and entry.factory is Half and entry.cost is cost
    assert resolve_optimizer("moo_priced") is Half
    assert resolve_cost("moo_priced") is cost and resolve_cost(Half) is cost  # by name or by class
    with pytest.raises(TypeError, match="cost_model must have"):
        register_preconditioner("moo_priced", Half, cost_model=object(), overwrite=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no cost model for preconditioner 'moo_nowhere'"):
        resolve_cost("moo_nowhere")
