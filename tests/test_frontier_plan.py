"""Frontier models plan on one rank of a 2048-rank job as ``plan_model`` says.

torchtitan 0.3.0's own configs (Llama-3 405B, Qwen3-235B-A22B, DeepSeek-V3 671B: 630, 36,284 and
45,032 matrices, experts counted one by one), full size, on the meta device. Rank 3 of a
2048-rank job under torch's in-process fake process group calls ``fully_shard`` on each block and
the root and builds ``OwnerRoutedOptimizer(matrix="muon", tail="adamw")``, which fixes the plan.
The plan it fixes must be ``plan_model``'s for the same units (every owner and split of every
tensor, so also its balance), every parameter must carry its record, and the optimizer must route
every tensor by the role the plan gives it. How long that takes is measured by
``benchmarks/frontier_plan.py``, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")

from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from matrix_owner_optim import OwnerRoutedOptimizer, Role, fully_shard, get_matrix_shard, plan_model  # noqa: E402
from matrix_owner_optim.sharding.state import state_of  # noqa: E402

W, RANK = 2048, 3


def _llama() -> Any:
    import torchtitan.models.llama3 as llama3

    return llama3.llama3_configs["405B"](attn_backend="flex")


def _qwen3() -> Any:
    import torchtitan.models.qwen3 as qwen3

    return qwen3.qwen3_configs["235B-A22B"](attn_backend="flex")


def _deepseek() -> Any:
    import torchtitan.models.deepseek_v3 as deepseek_v3

    return deepseek_v3.deepseekv3_configs["671B"](attn_backend="flex", moe_comm_backend="standard")


CONFIGS: dict[str, tuple[Callable[[], Any], int]] = {  # config, matrices (experts one by one)
    "llama3_405b": (_llama, 630),
    "qwen3_235b_a22b": (_qwen3, 36_284),
    "deepseek_v3_671b": (_deepseek, 45_032),
}


def _build(name: str) -> Any:
    with torch.device("meta"):
        return CONFIGS[name][0]().build()


@pytest.fixture
def fake_job() -> Iterator[None]:
    """Rank 3 of a 2048-rank job, in this process (torch's fake process group: collectives
    return at once, nothing is sent)."""
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=W)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frontier_model_plans_on_a_rank_as_plan_model_says(name: str, fake_job: None) -> None:
    model = _build(name)
    blocks = list(model.layers.values())
    prefixes = [f"layers.{key}" for key in model.layers] + [""]
    expected = plan_model(_build(name), W, unit_prefixes=prefixes)
    matrices = sum(int(s.shape[0]) if len(s.shape) == 3 else 1 for s in expected if s.role is Role.MATRIX)
    assert matrices == CONFIGS[name][1]

    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    opt = OwnerRoutedOptimizer(model, matrix="muon", tail="adamw")
    state = state_of(model)
    assert state is not None
    plan = state.fix_plan().plan

    # the same plan: every tensor's owner (or its experts' split), role and unit
    assert plan.first_difference(expected) is None
    assert plan.digest() == expected.digest()
    assert plan.imbalance() == expected.imbalance()
    assert [load.owned_matrices for load in plan.loads] == [load.owned_matrices for load in expected.loads]

    # every parameter carries its record, and is routed by its role
    routed: dict[int, tuple[str, str]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            routed[id(p)] = (group["optimizer"], group["role"])
    for fqn, param in model.named_parameters():
        shard = get_matrix_shard(param)
        assert shard is not None, fqn
        want = expected[fqn]
        assert (shard.owner, shard.row_owners, shard.role) == (want.owner, want.row_owners, want.role), fqn
        kind = "matrix" if want.role is Role.MATRIX else "tail"
        assert routed[id(param)] == (kind, want.role.value), fqn
    assert len(routed) == len(expected)
