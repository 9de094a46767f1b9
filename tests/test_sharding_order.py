"""The plan is fixed lazily, by the first forward or the first reader of the metadata (the
optimizer). A root ``fully_shard`` call after that point cannot re-plan its blocks: it must
fail loudly, naming the block, and an optimizer built after all calls must see every parameter
sharded."""

from __future__ import annotations

import pytest

from _ranks import spawn_ranks
from _ref import CFG4, fully_shard_model
from matrix_owner_optim import OwnerRoutedOptimizer, fully_shard, get_matrix_shard
from matrix_owner_optim.sharding.module import units_of
from matrix_owner_optim.toolbox.models import GPT

CFG = CFG4


def _job(rank: int, world_size: int) -> dict:
    model = fully_shard_model(GPT(CFG), root=False)
    OwnerRoutedOptimizer(model.layers)  # reads the blocks' metadata: their plan is fixed now
    try:
        fully_shard(model)
        late = "no error"
    except ValueError as exc:
        late = str(exc)

    model = fully_shard_model(GPT(CFG))
    opt = OwnerRoutedOptimizer(model)  # after every call: the whole model in one plan
    return {
        "late": late,
        "all_sharded": all(get_matrix_shard(p) is not None for p in model.parameters()),
        "units": len(units_of(model)),
        "local": sum(1 for r in opt.routes() if r["local"]),
    }


@pytest.mark.multirank
def test_root_call_after_the_plan_is_fixed_is_a_clear_error() -> None:
    results = spawn_ranks(_job, 2)
    for res in results:
        assert "'layers.0'" in res["late"] and "already sharded" in res["late"], res["late"]
        assert res["all_sharded"] and res["units"] == 3
    # each rank updates only what it owns, plus its rows of the sharded embeddings
    assert all(0 < res["local"] for res in results)
