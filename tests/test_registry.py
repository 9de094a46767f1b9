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
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)  # a hang guard only


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
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)  # a hang guard only

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


def test_an_entry_point_whose_module_raises_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception while a plug-in is imported comes back as ImportError naming the entry
    point, its distribution and target, with the plug-in's own error chained."""
    (tmp_path / "moo_broken_plugin.py").write_text("raise RuntimeError('CUDA kernels not built')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "moo_broken_plugin", raising=False)
    _write_dist(tmp_path, "moo-broken-plugin", "moo_broken_plugin", {"moo_broken": "Broken"})
    with pytest.raises(ImportError) as info:
        OwnerRoutedOptimizer(torch.nn.Linear(3, 3), matrix="moo_broken")
    msg = str(info.value)
    assert msg.startswith(
        "matrix optimizer 'moo_broken' comes from entry point of 'moo-broken-plugin' ('moo_broken_plugin:Broken', "
        "entry-point group 'matrix_owner_optim.preconditioners'), whose import raised RuntimeError: CUDA kernels not built."
    ), msg
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == "CUDA kernels not built"
    # a missing attribute is still worded by the registry, as before
    (tmp_path / "moo_fine_plugin.py").write_text("X = 1\n")
    _write_dist(tmp_path, "moo-fine-plugin", "moo_fine_plugin", {"moo_missing": "Nothing"})
    with pytest.raises(ValueError, match=r"comes from entry point of 'moo-fine-plugin' 'moo_fine_plugin:Nothing'"):
        resolve_optimizer("moo_missing")


# -- third-party optimizers whose groups need flags -------------------------------------------------
# The W=2 run sums each gradient in another order (two half-batch means averaged); the bound is
# this factor times the noise floor that order change alone makes in one process, measured per
# optimizer in the test (the same run with the batch's two halves backpropagated separately).
FLOOR_FACTOR = 4.0
MUON_FAMILY = ("Muon", "AdaMuon", "NorMuon")  # pytorch-optimizer 4.1.0: each group needs use_muon
STEPS = 4


def _gpt():
    from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, n_layers=2, d_model=16, n_heads=2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)


def _one_process(name: str, halves: bool = False) -> dict[str, torch.Tensor]:
    """The optimizer as its documentation says to use it: the matrices in a use_muon=True group
    (the ones OwnerRoutedOptimizer routes to the matrix role), the rest to torch's AdamW."""
    import pytorch_optimizer

    model = _gpt()
    matrices = {r["name"] for r in OwnerRoutedOptimizer(_gpt()).routes() if r["role"] == "matrix"}
    named = dict(model.named_parameters())
    opts = [
        getattr(pytorch_optimizer, name)(
            [{"params": [p for n, p in named.items() if n in matrices], "use_muon": True}]
        ),
        torch.optim.AdamW([p for n, p in named.items() if n not in matrices], lr=1e-3),
    ]
    for step in range(STEPS):
        idx, tgt = _batch(step)
        if halves:  # the summation order the two ranks make: each half's mean, then their mean
            for i in range(2):
                (0.5 * model(idx[i : i + 1], tgt[i : i + 1])).backward()
        else:
            model(idx, tgt).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded_job(rank: int, W: int, name: str) -> dict[str, torch.Tensor]:
    import pytorch_optimizer

    from matrix_owner_optim import fully_shard

    model = _gpt()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = OwnerRoutedOptimizer(model, matrix=getattr(pytorch_optimizer, name), tail_options={"lr": 1e-3})
    assert all(g["use_muon"] is True for g in opt.param_groups if g["optimizer"] == "matrix")
    for step in range(STEPS):
        idx, tgt = _batch(step)
        model(idx[rank : rank + 1], tgt[rank : rank + 1]).backward()  # each rank half the batch
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


@pytest.mark.multirank
@pytest.mark.parametrize("name", MUON_FAMILY)
def test_pytorch_optimizer_muon_family_trains_like_one_process(name: str) -> None:
    """``matrix=pytorch_optimizer.<name>``: every matrix group gets ``use_muon=True`` (what the
    optimizer documents for hidden matrices) and W=2 owner-sharded training matches one process
    with the documented groups."""
    from _ranks import spawn_ranks

    ref, reordered = _one_process(name), _one_process(name, halves=True)
    floor = max((reordered[n] - p).abs().max().item() for n, p in ref.items())
    assert floor > 0  # the order change is visible, so the bound below is measured, not zero
    for rank, got in enumerate(spawn_ranks(_sharded_job, 2, name)):
        worst = max((p - ref[n]).abs().max().item() for n, p in got.items())
        print(f"\n{name} rank {rank}: max |diff| {worst:.2e}, noise floor {floor:.2e} ({worst / floor:.2f}x)")
        assert worst <= FLOOR_FACTOR * floor, (name, rank, worst, floor)
