"""Owner-segment layouts and the gradient divide factors, at simulated world sizes (no processes).

The collectives themselves run in the multi-rank tests; here: every rank's segment partitions a
unit exactly (sizes, offsets, row blocks) for W up to 1024, the reduce buffer's others-first
offsets, and the split of the gradient division around the sum (FSDP2's rule: float16 divides
by a power of two near sqrt(W) before the sum, everything else after it).
"""

from __future__ import annotations

import math

import pytest
import torch

from matrix_owner_optim.planning import Role, plan_tensors
from matrix_owner_optim.planning.roles import TensorSpec
from matrix_owner_optim.sharding.collectives import (
    SegmentLayout,
    gradient_divide_factors,
    others_first_offsets,
)


def _specs() -> list[TensorSpec]:
    specs = [TensorSpec(fqn="embed.weight", shape=(1000, 64), dtype=torch.float32, role=Role.ROWS, unit=0)]
    for b in range(6):
        specs += [
            TensorSpec(fqn=f"b{b}.w1", shape=(256, 64), dtype=torch.float32, role=Role.MATRIX, unit=0),
            TensorSpec(fqn=f"b{b}.w2", shape=(64, 256), dtype=torch.float32, role=Role.MATRIX, unit=0),
            TensorSpec(fqn=f"b{b}.bias", shape=(64,), dtype=torch.float32, role=Role.TAIL, unit=0),
        ]
    return specs


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 64, 1024])
def test_segments_partition_the_unit(world_size: int) -> None:
    plan = plan_tensors(_specs(), world_size)
    shards = list(plan)
    layout = SegmentLayout.build(shards, world_size)
    assert layout.total == sum(s.numel for s in shards)
    covered: dict[int, int] = {}
    for r in range(world_size):
        cursor = 0
        for e in layout.entries[r]:
            assert e.offset == cursor, (r, e)  # each segment is packed without gaps
            cursor += e.length
            s = shards[e.index]
            if e.rows is None:
                assert s.owner == r and e.length == s.numel
            else:
                assert e.rows == s.row_range(r) and e.length == s.local_numel(r)
            covered[e.index] = covered.get(e.index, 0) + e.length
        assert cursor == layout.sizes[r]
    assert covered == {i: s.numel for i, s in enumerate(shards)}  # every element exactly once


@pytest.mark.parametrize("world_size", [1, 2, 5, 1024])
def test_others_first_offsets(world_size: int) -> None:
    sizes = [(7 * r + 3) % 11 for r in range(world_size)]
    for rank in {0, world_size // 2, world_size - 1}:
        off = others_first_offsets(sizes, rank)
        assert off[rank] == sum(sizes) - sizes[rank]  # this rank's own segment comes last
        others = [r for r in range(world_size) if r != rank]
        cursor = 0
        for r in others:
            assert off[r] == cursor
            cursor += sizes[r]


@pytest.mark.parametrize(
    ("world_size", "pre", "post"),
    [
        (1, 1, 1),
        (2, 2, 1),
        (3, 2, 1.5),
        (4, 2, 2),
        (6, 4, 1.5),
        (8, 4, 2),
        (16, 4, 4),
        (1024, 32, 32),
    ],
)
def test_float16_divides_around_the_sum(world_size: int, pre: float, post: float) -> None:
    assert gradient_divide_factors(torch.float16, world_size) == (pre, post)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_wide_dtypes_divide_after_the_sum(dtype: torch.dtype) -> None:
    for world_size in range(1, 1025):
        assert gradient_divide_factors(dtype, world_size) == (1.0, world_size)


def test_float16_factors_keep_both_sides_in_range() -> None:
    for world_size in range(1, 1025):
        pre, post = gradient_divide_factors(torch.float16, world_size)
        assert math.isclose(pre * post, world_size)
        n = int(pre)
        assert n == pre and n & (n - 1) == 0  # a power of two: dividing by it is exact
        assert pre <= 2 * math.sqrt(world_size)  # never much more than sqrt(W) before the sum


def test_custom_factor() -> None:
    assert gradient_divide_factors(torch.float32, 8, 1.0) == (1.0, 1.0)  # the plain sum
    assert gradient_divide_factors(torch.float16, 8, 16.0) == (4.0, 4.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="divide factor"):
            gradient_divide_factors(torch.float32, 4, bad)
