"""One home for each fact where the optimizer meets the planner.

* The cost that prices a plan is resolved by one function (``planning.catalog.resolve_cost``):
  every entry point given a name, an optimizer class or a cost model gets the same cost model
  and the same plan; ``DEFAULT_COST`` is the one default.
* A tree's facts live in one ``ShardTree`` every state points to: adoption re-points the states,
  a call inside the tree naming another plan or cost is refused naming both, and fixing the plan
  logs which cost priced it. The optimizer fixes pending plans as its own step, with the cost it
  was built with, also for parameters a framework swaps into ``param_groups``.
* A param group's ``"role"`` is its tensors' role and ``"optimizer"`` the optimizer that steps
  them, so ``OwnerRoutedOptimizer(opt.param_groups)`` routes every tensor as ``opt`` did.
* The optimizer registry keeps its first names (``register_preconditioner``, the entry-point
  group ``matrix_owner_optim.preconditioners``) as aliases.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from _ranks import spawn_ranks
from _ref import CFG, fully_shard_model
from matrix_owner_optim import OwnerRoutedOptimizer, register_optimizer, register_preconditioner
from matrix_owner_optim.optim import registry as optim_registry
from matrix_owner_optim.optim.routing import OptimizerKind
from matrix_owner_optim.planning import plan_mesh, plan_model, plan_tensors
from matrix_owner_optim.planning.catalog import (
    DEFAULT_COST,
    ENTRY_POINT_GROUP,
    PRECONDITIONER_ENTRY_POINT_GROUP,
    available_optimizers,
    resolve_cost,
)
from matrix_owner_optim.planning.cost import MUON_COST, SHAMPOO_COST
from matrix_owner_optim.preconditioners import Shampoo
from matrix_owner_optim.sharding import fully_shard
from matrix_owner_optim.sharding.state import state_of
from matrix_owner_optim.toolbox.models.gpt import GPT

SPECS = ("shampoo", Shampoo, SHAMPOO_COST)  # a name, an optimizer class, a cost model


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _roles(opt: OwnerRoutedOptimizer) -> dict[int, str]:
    """Each parameter's role as the optimizer routed it (by identity: names may differ)."""
    return {id(rp.param): rp.role.value for rp in opt._routed}


# -- one resolution of a cost, in one process ---------------------------------------------------
def test_every_pure_entry_point_resolves_a_name_a_class_and_a_cost_model_alike() -> None:
    assert resolve_cost(None) is DEFAULT_COST is MUON_COST
    prefixes = _gpt().unit_prefixes()
    plans, advised = set(), set()
    for spec in SPECS:
        assert resolve_cost(spec) is SHAMPOO_COST, spec
        plan = plan_model(_gpt(), 3, preconditioner=spec, unit_prefixes=prefixes)
        advice = plan_mesh(_gpt(), 3, preconditioner=spec, unit_prefixes=prefixes)
        assert plan.preconditioner == advice.plan.preconditioner == "shampoo"
        plans.add(plan.digest())
        advised.add((advice.mesh_shape, advice.plan.digest()))
    assert len(plans) == 1 and len(advised) == 1, "one cost, one plan"
    assert Shampoo([nn.Parameter(torch.zeros(2, 2))]).cost_model is SHAMPOO_COST  # one object per configuration
    assert plan_model(_gpt(), 3, unit_prefixes=prefixes).preconditioner == DEFAULT_COST.name
    # the optimizer takes an optimizer (a name or a class): its cost is the same rule's answer
    for spec in SPECS[:2]:
        opt = OwnerRoutedOptimizer(_gpt(), matrix=spec)
        assert opt._kinds[OptimizerKind.MATRIX].cost is SHAMPOO_COST, spec
    with pytest.raises(TypeError, match="takes a CostModel"):
        plan_tensors([], 2, cost="shampoo")  # type: ignore[arg-type]  # below the edges: resolved costs only
    with pytest.raises(TypeError, match="preconditioner= must be"):
        resolve_cost(3)  # type: ignore[arg-type]


# -- param groups: "role" is the tensors' role, "optimizer" the optimizer's kind ---------------------
def test_param_groups_round_trip_keeps_every_role() -> None:
    opt = OwnerRoutedOptimizer(_gpt())  # roles by module type: the embeddings are rows
    again = OwnerRoutedOptimizer(opt.param_groups)  # no names: the groups' roles must carry them
    assert [(g["role"], g["optimizer"]) for g in opt.param_groups] == [
        ("matrix", "matrix"),
        ("tail", "tail"),
        ("rows", "tail"),
    ]
    assert _roles(again) == _roles(opt)
    assert sum(1 for r in again.routes() if r["role"] == "rows") == len(opt.param_groups[2]["params"]) > 0
    assert [g["optimizer"] for g in again.param_groups] == ["matrix", "tail", "tail"]
    wrong = [{"params": opt.param_groups[0]["params"], "role": "matrix", "optimizer": "tail"}]
    with pytest.raises(ValueError, match="'optimizer' is recorded by OwnerRoutedOptimizer"):
        OwnerRoutedOptimizer(wrong)
    with pytest.raises(ValueError, match="param group 'optimizer' is 'adamw'"):
        OwnerRoutedOptimizer([{"params": opt.param_groups[0]["params"], "optimizer": "adamw"}])


# -- the registry's first names keep working ---------------------------------------------------------
def test_registry_aliases_and_both_entry_point_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert register_preconditioner is register_optimizer
    assert optim_registry.register_preconditioner is register_optimizer
    (tmp_path / "moo_one_home_plugin.py").write_text("import torch\nclass NewSGD(torch.optim.SGD):\n    pass\n")
    for dist, group in (("moo-new", ENTRY_POINT_GROUP), ("moo-old", PRECONDITIONER_ENTRY_POINT_GROUP)):
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(
            f"[{group}]\n{dist.replace('-', '_')}_sgd = moo_one_home_plugin:NewSGD\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "moo_one_home_plugin", raising=False)
    for name in ("moo_new_sgd", "moo_old_sgd"):  # the new group and the group's first name
        assert name in available_optimizers()
        opt = OwnerRoutedOptimizer(nn.Linear(3, 3), matrix=name, matrix_options={"lr": 0.1})
        assert type(opt.matrix_optimizer).__name__ == "NewSGD"
        assert resolve_cost(name) is DEFAULT_COST  # states no cost: the one default


# -- the tree, its price, and the optimizer's step that fixes it (2 ranks) -----------------------------
def _sharded(**root_kw: object) -> GPT:
    return fully_shard_model(_gpt(), root_options=root_kw)


def _job(rank: int, world_size: int) -> dict:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("matrix_owner_optim.sharding.tree")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    out: dict = {}
    want = plan_model(_gpt(), world_size, preconditioner="shampoo", unit_prefixes=_gpt().unit_prefixes()).digest()
    # every edge, given a name, a class or a cost model: one cost, one plan
    answers = []
    for spec in SPECS:
        by_call = _sharded(preconditioner=spec)
        tree = state_of(by_call).tree
        by_call.fix_plan()
        by_fix = _sharded()
        by_fix.fix_plan(preconditioner=spec)
        answers.append((tree.cost is SHAMPOO_COST, state_of(by_fix).tree.cost is SHAMPOO_COST))
        answers.append((by_call.sharding_plan.digest() == want, by_fix.sharding_plan.digest() == want))
    for spec in SPECS[:2]:
        model = _sharded()
        OwnerRoutedOptimizer(model, matrix=spec)
        answers.append((state_of(model).tree.cost is SHAMPOO_COST, model.sharding_plan.digest() == want))
    out["answers"] = answers
    out["logged"] = list(records)
    # one tree object: adoption re-points every state, never copies a fact
    model = fully_shard_model(_gpt(), root=False)
    block_trees = [state_of(b).tree for b in model.layers]
    fully_shard(model)
    tree = state_of(model).tree
    out["one_tree"] = (
        all(state_of(m).tree is tree for m in [model, *model.layers])
        and all(t is not tree for t in block_trees)
        and tree.states[-1] is state_of(model)
        and not any(hasattr(state_of(m), a) for m in [model, *model.layers] for a in ("plan", "phase", "context"))
    )
    model.fix_plan()
    out["planned_everywhere"] = all(state_of(m).tree.context is not None for m in [model, *model.layers])
    # a call inside the tree that named another cost, or another plan: refused, naming both
    model = _gpt()
    fully_shard(model.layers[0], preconditioner="shampoo")
    fully_shard(model.layers[1])
    try:
        fully_shard(model, preconditioner="soap")
    except ValueError as exc:
        out["cost_conflict"] = str(exc)
    out["cost_conflict_left_nothing"] = state_of(model) is None
    fully_shard(model, preconditioner="shampoo")  # the same cost again: one price, accepted
    out["same_cost"] = (
        state_of(model).tree.cost is SHAMPOO_COST and state_of(model.layers[0]).tree is state_of(model).tree
    )
    model = _gpt()
    other = plan_model(  # another plan: one matrix more on the tail
        _gpt(), world_size, roles={"layers.0.attn.qkv.weight": "tail"}, unit_prefixes=_gpt().unit_prefixes()
    )
    fully_shard(model.layers[0], plan=plan_model(_gpt(), world_size, unit_prefixes=_gpt().unit_prefixes()))
    fully_shard(model.layers[1])
    try:
        fully_shard(model, plan=other)
    except ValueError as exc:
        out["plan_conflict"] = str(exc)
    # the swap path (a framework puts new tensors into param_groups) fixes their plan with the
    # cost the optimizer was built with
    built_on = _sharded()
    opt = OwnerRoutedOptimizer(built_on, matrix="shampoo")
    swapped = _sharded()
    new = dict(swapped.named_parameters())
    old_names = {id(p): n for n, p in built_on.named_parameters()}
    for g in opt.param_groups:
        g["params"] = [new[old_names[id(p)]] for p in g["params"]]
    opt.routes()  # follows the swap
    out["swap"] = (state_of(swapped).tree.cost is SHAMPOO_COST, swapped.sharding_plan.digest() == want)
    # the param_groups round trip keeps the rows tensors' role under fully_shard
    again = OwnerRoutedOptimizer(opt.param_groups, matrix="shampoo")
    out["round_trip"] = (_roles(again) == _roles(opt), sum(1 for r in again.routes() if r["role"] == "rows"))
    return out


@pytest.mark.multirank
def test_one_tree_one_price_and_the_optimizers_own_step() -> None:
    for r in spawn_ranks(_job, 2):
        assert all(all(a) for a in r["answers"]), r["answers"]
        priced = [m for m in r["logged"] if "priced by shampoo" in m]
        assert len(priced) == 8, r["logged"]  # one line per tree fixed above, each naming its cost
        assert any("named by fully_shard(GPT, preconditioner=...)" in m for m in priced), priced
        assert any("offered when the plan was fixed" in m for m in priced), priced
        assert r["one_tree"] and r["planned_everywhere"]
        msg = r["cost_conflict"]
        assert "'layers.0'" in msg and "'shampoo'" in msg and "'soap'" in msg and "this call" in msg, msg
        assert r["cost_conflict_left_nothing"] and r["same_cost"]
        assert "'layers.0'" in r["plan_conflict"] and "one tree is planned from one plan" in r["plan_conflict"]
        assert r["swap"] == (True, True), r["swap"]
        assert r["round_trip"][0] and r["round_trip"][1] > 0, r["round_trip"]
