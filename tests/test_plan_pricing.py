"""The lazy plan is priced by the matrix optimizer the user chose.

Under ``fully_shard`` the plan is fixed lazily; the ``OwnerRoutedOptimizer`` that fixes it passes
its matrix optimizer's cost model, so a Shampoo run is balanced for Shampoo's cost (resident
factors, eigendecompositions), not Muon's. ``fully_shard(preconditioner=...)`` names the cost
model explicitly and wins; a plan fixed by a forward before any optimizer exists is priced as
Muon. At W=3 on the test GPT the Shampoo and Muon plans place 18 tensors differently, so the
check below can tell them apart.
"""

from __future__ import annotations

import pytest
import torch

from _ranks import spawn_ranks
from _ref import CFG, fully_shard_model
from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.planning import plan_model
from matrix_owner_optim.sharding import fully_shard
from matrix_owner_optim.toolbox.models.gpt import GPT

pytestmark = pytest.mark.multirank


def _sharded(**kw) -> GPT:
    torch.manual_seed(0)
    return fully_shard_model(GPT(CFG), **kw)


def _owners(plan) -> dict[str, int | None]:
    return {s.fqn: s.owner for s in plan}


def _job(rank: int, W: int) -> dict:
    expect = {
        kind: _owners(plan_model(GPT(CFG), W, preconditioner=kind, unit_prefixes=GPT(CFG).unit_prefixes()))
        for kind in ("muon", "shampoo", "soap")
    }
    out: dict = {"differ": expect["muon"] != expect["shampoo"]}
    model = _sharded()
    OwnerRoutedOptimizer(model, matrix="shampoo", tail="adamw")  # fixes the plan
    out["by_optimizer"] = (model.sharding_plan.preconditioner, _owners(model.sharding_plan) == expect["shampoo"])
    model = _sharded(preconditioner="soap")
    OwnerRoutedOptimizer(model, matrix="muon", tail="adamw")
    out["named"] = (model.sharding_plan.preconditioner, _owners(model.sharding_plan) == expect["soap"])
    model = _sharded()
    idx = torch.zeros((1, CFG.seq_len), dtype=torch.long)
    model(idx)  # the first forward fixes the plan before any optimizer exists
    OwnerRoutedOptimizer(model, matrix="shampoo", tail="adamw")
    out["by_forward"] = (model.sharding_plan.preconditioner, _owners(model.sharding_plan) == expect["muon"])
    try:
        fully_shard(GPT(CFG), preconditioner="no-such-optimizer")
    except ValueError as exc:
        out["unknown"] = str(exc)
    return out


def test_plan_priced_by_the_chosen_optimizer() -> None:
    for r in spawn_ranks(_job, 3):
        assert r["differ"], "the test model must plan differently for Muon and Shampoo"
        assert r["by_optimizer"] == ("shampoo", True), r["by_optimizer"]
        assert r["named"] == ("soap", True), r["named"]
        assert r["by_forward"] == ("muon", True), r["by_forward"]
        assert "no cost model for preconditioner 'no-such-optimizer'" in r["unknown"], r.get("unknown")
