"""torch.optim's contract where frameworks rely on it (one process, fast).

* ``param_names``: recorded in the groups and ``state_dict()`` exactly where torch.optim records
  them (from ``named_parameters()``), and accepted in given groups (torchtitan's form).
* Parameters swapped into ``param_groups`` after construction are trained (re-routed at the next
  step), and refused with an error once optimizer state exists.
* ``plan_model`` names a non-module argument.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from matrix_owner_optim import OwnerRoutedOptimizer, plan_model


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_param_names_recorded_as_torch_optim_records_them() -> None:
    model = _model()
    ours = OwnerRoutedOptimizer(model.named_parameters())
    theirs = torch.optim.AdamW(model.named_parameters())
    names = {n for g in ours.param_groups for n in g["param_names"]}
    assert names == set(theirs.param_groups[0]["param_names"])
    for g in ours.param_groups:  # names aligned with params, as torch's
        assert [dict(model.named_parameters())[n] for n in g["param_names"]] == g["params"]
    _step(model, ours)
    sd = ours.state_dict()
    ref = theirs.state_dict()
    # saved as torch saves them: the names beside the integer ids, in every group
    assert ref["param_groups"][0]["param_names"] == theirs.param_groups[0]["param_names"]
    for g, live in zip(sd["param_groups"], ours.param_groups, strict=True):
        assert g["param_names"] == live["param_names"] and len(g["params"]) == len(g["param_names"])
    # plain tensors: no names, as torch
    assert "param_names" not in OwnerRoutedOptimizer(list(_model().parameters()), roles=None).param_groups[0]


def test_torchtitan_group_form_is_accepted() -> None:
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    group = {"params": list(model.parameters()), "param_names": names, "fused": False, "foreach": False, "lr": 1e-3}
    opt = OwnerRoutedOptimizer([group])
    assert sorted(n for g in opt.param_groups for n in g["param_names"]) == sorted(names)
    assert {g["role"] for g in opt.param_groups} == {"matrix", "tail"}  # names give the roles
    with pytest.raises(ValueError, match="'param_names' has 1 names for 4 parameters"):
        OwnerRoutedOptimizer([{"params": list(model.parameters()), "param_names": ["x"]}])
    with pytest.raises(ValueError, match="with param_names"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_swapped_parameters_are_followed_and_refused_after_state() -> None:
    model, ref = _model(), _model()
    opt = OwnerRoutedOptimizer(model, matrix_options={"ns_dtype": torch.float32})
    ref_opt = OwnerRoutedOptimizer(ref, matrix_options={"ns_dtype": torch.float32})
    # a framework replaces every parameter object (as Accelerate's FSDP2 prepare does)
    swapped = copy.deepcopy(model)
    new = dict(swapped.named_parameters())
    name_of = {id(p): n for n, p in model.named_parameters()}
    for g in opt.param_groups:
        g["params"] = [new[name_of[id(p)]] for p in g["params"]]
    before = {n: p.detach().clone() for n, p in swapped.named_parameters()}
    _step(swapped, opt)
    _step(ref, ref_opt)
    for n, p in swapped.named_parameters():
        assert not torch.equal(p, before[n]), f"{n} was not trained after the swap"
        assert torch.equal(p, dict(ref.named_parameters())[n]), n
    # once state exists the old tensors' state cannot follow: a clear error
    for g in opt.param_groups:
        g["params"] = [p.detach().clone().requires_grad_() for p in g["params"]]
    with pytest.raises(RuntimeError, match="after optimizer state exists"):
        opt.step()


def test_plan_model_names_a_non_module() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got list"):
        plan_model([torch.zeros(4, 4)], 2)  # type: ignore[arg-type]
