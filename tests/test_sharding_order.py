"""An optimizer built between the block calls and the root call would hold parameters that
sharding then replaces: it must fail loudly, naming the parameter, not train a stale copy."""

from __future__ import annotations

import pytest

from matrix_owner_optim import OwnerRoutedOptimizer, fully_shard, get_matrix_shard
from matrix_owner_optim.launch import spawn_ranks
from matrix_owner_optim.models import GPT, GPTConfig


def _job(rank: int, world_size: int) -> dict:
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=4))
    for block in model.layers:
        fully_shard(block)
    try:
        OwnerRoutedOptimizer(model)
        early = "no error"
    except ValueError as exc:
        early = str(exc)
    fully_shard(model)
    opt = OwnerRoutedOptimizer(model)  # after the root call: fine
    return {"early": early, "all_sharded": all(get_matrix_shard(p) is not None for p in model.parameters()),
            "local": sum(1 for r in opt.routes() if r["local"])}


@pytest.mark.multirank
def test_optimizer_before_root_call_is_a_clear_error() -> None:
    results = spawn_ranks(_job, 2)
    for res in results:
        assert "layers.0." in res["early"] and "fully_shard on the root" in res["early"]
        assert res["all_sharded"]
    # each rank updates only what it owns, plus its rows of the sharded embeddings
    assert all(0 < res["local"] for res in results)
