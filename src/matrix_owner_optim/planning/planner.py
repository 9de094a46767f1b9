"""The global owner planner: every matrix whole on one rank, ranks balanced model-wide.

Items (the matrices, one packed tail per unit) go largest first onto the rank whose resulting
level (the larger of normalised bytes and FLOPs) is lowest, then :mod:`.refine`'s bounded moves
and swaps, then :mod:`.shape_counts`' even shares of every shape; ``rows`` tensors load every
rank alike. Heavy stacks go expert by expert, heavy blocked-Shampoo matrices band by band where
that helps (DESIGN.md, "Planning" and "Experts as ownable units"). Ties break on item index
and rank, so every process computes the same plan.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from .catalog import DEFAULT_COST, CostSpec, resolve_cost
from .cost import (
    ADAMW_COST,
    CostModel,
    block_sizes,
    itemsize,
    matrix_flops,
    matrix_state_bytes,
    numel,
    row_block_of,
)
from .metadata import MatrixShard, RankLoad, Role, ShardingPlan, chunk_row_sizes, recorded_unit_prefixes
from .refine import refine
from .roles import TensorSpec, specs_from_module
from .shape_counts import even_shapes
from .views import MatrixView, default_matrix_view

__all__ = ["plan_tensors", "plan_model", "tensor_resident_bytes", "tensor_flops"]


def tensor_resident_bytes(spec: TensorSpec, cost: CostModel, rows_fraction: float = 1.0) -> int:
    """Parameter + gradient + optimizer state of ``spec`` on the rank that updates it; a matrix
    priced per matrix it is stepped as (its :class:`~.views.MatrixView`: experts, fused blocks)."""
    param = numel(spec.shape) * itemsize(spec.dtype)
    if not spec.requires_grad:
        return int(param * rows_fraction)
    if spec.role is Role.MATRIX:
        state = matrix_state_bytes(cost, spec.shape, spec.dtype, spec.view)
    else:
        state = cost.state_bytes(spec.shape, spec.dtype)
    return int((2 * param + state) * rows_fraction)


def tensor_flops(spec: TensorSpec, cost: CostModel) -> float:
    """One optimizer step's FLOPs of ``spec`` (a matrix: summed over its matrices)."""
    if not spec.requires_grad:
        return 0.0
    return matrix_flops(cost, spec.shape, spec.view) if spec.role is Role.MATRIX else cost.flops(spec.shape)


@dataclass
class _Item:
    index: int
    fqns: list[str]
    bytes: float
    flops: float
    is_matrix: bool
    members: int = 1
    score: float = 0.0
    unit: int = -1  # a matrix's fully_shard unit (its shape evens out within one: even_shapes)
    shape: tuple[int, ...] = ()  # a matrix's (a band's, an expert's) shape


@dataclass
class _Rank:
    bytes: float = 0.0
    flops: float = 0.0
    items: list[int] = field(default_factory=list)


def plan_tensors(
    specs: Sequence[TensorSpec],
    world_size: int,
    *,
    cost: CostModel = DEFAULT_COST,
    tail_cost: CostModel = ADAMW_COST,
    refine_iterations: int = 200,
    split_stacks: bool = True,
) -> ShardingPlan:
    """Place ``specs`` (in model order) on ``world_size`` ranks and return the plan.

    ``cost`` prices the matrices (resolved by the caller: ``planning.catalog.resolve_cost``;
    the plan records its ``name``), ``tail_cost`` the tail and ``rows`` tensors.

    ``split_stacks``: a heavy stack of matrices (fused experts) may be split over owners at
    expert boundaries (``MatrixShard.row_owners``); False keeps every matrix whole on one owner
    (what a layout that updates whole tensors on owners needs: DDP's owner placement)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    seen: set[str] = set()
    for s in specs:
        for name in (s.fqn, *s.aliases):
            if name in seen:
                raise ValueError(f"parameter name {name!r} appears twice in the plan input")
            seen.add(name)
    if not isinstance(cost, CostModel):
        raise TypeError(
            f"plan_tensors(cost=...) takes a CostModel, got {type(cost).__name__}; resolve a name or an "
            "optimizer class with planning.catalog.resolve_cost first"
        )
    matrix_cost = cost
    cost_name = cost.name
    W = world_size

    # -- fixed per-rank load from evenly sharded tensors -----------------------------------
    base_bytes = [0.0] * W
    base_flops = [0.0] * W
    for s in specs:
        if s.role is Role.ROWS:
            rows = chunk_row_sizes(s.shape[0], W)
            total_rows = max(1, s.shape[0])
            for r in range(W):
                frac = rows[r] / total_rows
                base_bytes[r] += tensor_resident_bytes(s, tail_cost, frac)
                base_flops[r] += tensor_flops(s, tail_cost) * frac

    # -- items: matrices and one packed tail per unit ------------------------------------------
    items: list[_Item] = []
    item_of: dict[str, int] = {}
    tail_item_of_unit: dict[int, int] = {}
    for s in specs:
        if s.role is Role.MATRIX:
            item_of[s.fqn] = len(items)
            items.append(
                _Item(
                    len(items),
                    [s.fqn],
                    tensor_resident_bytes(s, matrix_cost),
                    tensor_flops(s, matrix_cost),
                    True,
                    unit=s.unit,
                    shape=tuple(int(d) for d in s.shape),
                )
            )
        elif s.role is Role.TAIL:
            if s.unit not in tail_item_of_unit:
                tail_item_of_unit[s.unit] = len(items)
                items.append(_Item(len(items), [], 0.0, 0.0, False, members=0))
            it = items[tail_item_of_unit[s.unit]]
            it.fqns.append(s.fqn)
            it.members += 1
            it.bytes += tensor_resident_bytes(s, tail_cost)
            it.flops += tensor_flops(s, tail_cost)
            item_of[s.fqn] = it.index

    total_bytes = sum(base_bytes) + sum(i.bytes for i in items)
    total_flops = sum(base_flops) + sum(i.flops for i in items)
    bt = total_bytes / W if total_bytes > 0 else 1.0
    ft = total_flops / W if total_flops > 0 else 1.0
    for it in items:
        it.score = it.bytes / bt + it.flops / ft

    # -- experts as ownable units: a stack of matrices of about half a fair share or more is
    # placed expert by expert (whole experts only), so balance holds when experts outnumber ranks
    split_of: dict[int, tuple[str, int]] = {}  # item index -> (fqn of the stack, experts in it)
    stacks: set[str] = set()
    if W > 1 and split_stacks:
        for s in specs:
            if s.role is not Role.MATRIX or s.fqn not in item_of or not _splits_by_expert(s):
                continue
            it = items[item_of[s.fqn]]
            if it.score <= 1.0:  # about half a fair share of bytes and of FLOPs, or more
                continue
            experts = int(s.shape[0])
            it.bytes, it.flops, it.score = it.bytes / experts, it.flops / experts, it.score / experts
            split_of[it.index] = (s.fqn, 1)
            stacks.add(s.fqn)
            for _ in range(experts - 1):
                extra = _Item(len(items), [s.fqn], it.bytes, it.flops, True, unit=it.unit, shape=it.shape)
                extra.score = it.score
                split_of[extra.index] = (s.fqn, 1)
                items.append(extra)

    def level(b: float, f: float) -> tuple[float, float]:
        nb, nf = b / bt, f / ft
        return (max(nb, nf), nb + nf)

    ranks = _place(items, base_bytes, base_flops, level, refine_iterations)

    # -- blocks as ownable units: a heavy matrix whose optimizer steps bands of whole blocks
    # independently (blocked Shampoo) may be cut into bands between owners, when that lowers the
    # busiest rank's level (the stacks above are split whenever heavy; bands only where it helps)
    row_block = row_block_of(matrix_cost) if W > 1 and split_stacks else None
    band_candidates = [s for s in specs if row_block is not None and s.fqn in item_of and _splits_by_band(s, row_block)]
    band_candidates = [s for s in band_candidates if items[item_of[s.fqn]].score > 1.0]
    if band_candidates:
        assert row_block is not None
        banded = list(items)
        band_of: dict[int, tuple[str, int]] = {}
        for s in band_candidates:
            first = item_of[s.fqn]
            for k, band_rows in enumerate(block_sizes(int(s.shape[0]), row_block)):
                band = dataclasses.replace(s, shape=(band_rows, int(s.shape[1])))
                it = _Item(
                    first if k == 0 else len(banded),
                    [s.fqn],
                    tensor_resident_bytes(band, matrix_cost),
                    tensor_flops(band, matrix_cost),
                    True,
                    unit=s.unit,
                    shape=(band_rows, int(s.shape[1])),
                )
                it.score = it.bytes / bt + it.flops / ft
                band_of[it.index] = (s.fqn, band_rows)
                if k == 0:
                    banded[first] = it
                else:
                    banded.append(it)
        banded_ranks = _place(banded, base_bytes, base_flops, level, refine_iterations)

        def busiest(rs: list[_Rank]) -> float:
            return max(level(r.bytes, r.flops)[0] for r in rs)

        if busiest(banded_ranks) < busiest(ranks) * (1 - 1e-9):
            items, ranks = banded, banded_ranks
            _align_bands(ranks, items, band_of, row_block)
            split_of.update(band_of)

    owner_of_item = {i: r for r, rk in enumerate(ranks) for i in rk.items}
    # a split stack: each rank's experts as one contiguous row range, ranks in order (experts of
    # one stack cost the same, so only how many each rank holds matters); a banded matrix the
    # same, in rows (its short last band on the last rank holding bands, see _align_bands)
    row_owners: dict[str, tuple[tuple[int, int, int], ...]] = {}
    counts: dict[str, list[int]] = {}
    for i, (fqn, n) in split_of.items():
        counts.setdefault(fqn, [0] * W)[owner_of_item[i]] += n
    for fqn, per_rank in counts.items():
        if fqn not in stacks and sum(1 for n in per_rank if n) == 1:
            continue  # every band on one rank: the matrix stays whole, owned by that rank
        start, ranges = 0, []
        for r in range(W):
            ranges.append((start, start + per_rank[r], r))
            start += per_rank[r]
        row_owners[fqn] = tuple(ranges)

    # (where each tensor sits in its unit's flat buffers is the runtime's SegmentLayout)
    shards: dict[str, MatrixShard] = {}
    for s in specs:
        held_whole = not (s.role is Role.ROWS or s.fqn in row_owners)
        owner = owner_of_item[item_of[s.fqn]] if held_whole else None
        shards[s.fqn] = MatrixShard(
            fqn=s.fqn,
            shape=tuple(s.shape),
            dtype=s.dtype,
            role=s.role,
            owner=owner,
            unit=s.unit,
            aliases=tuple(s.aliases),
            requires_grad=s.requires_grad,
            world_size=W,
            row_owners=row_owners.get(s.fqn, ()),
        )

    loads = []
    for r, rk in enumerate(ranks):
        owned = [items[i] for i in rk.items]
        loads.append(
            RankLoad(
                rank=r,
                resident_bytes=int(round(rk.bytes)),
                optimizer_flops=float(rk.flops),
                owned_matrices=sum(1 for i in owned if i.is_matrix),
                owned_tensors=sum(i.members for i in owned),
            )
        )
    return ShardingPlan(world_size=W, shards=shards, loads=loads, preconditioner=cost_name)


def _splits_by_expert(s: TensorSpec) -> bool:
    """A 3D stack of matrices (fused experts ``[E, out, in]``): its dim 0 indexes whole matrices
    (not one to be placed whole: ``TensorSpec.whole``)."""
    if s.whole or len(s.shape) != 3 or int(s.shape[0]) < 2:
        return False
    view = s.view if s.view is not None else default_matrix_view(s.shape, name=s.fqn)
    return view is not None and view.kind == "stack"


def _place(
    items: list[_Item],
    base_bytes: list[float],
    base_flops: list[float],
    level: Callable[[float, float], tuple[float, float]],
    refine_iterations: int,
) -> list[_Rank]:
    """LPT (largest first onto the rank whose resulting level is lowest), then :func:`.refine.refine`.

    A heap keyed by the rank's current level finds candidates fast at W=1024; the exact choice
    checks the few lowest ranks, since the level after adding depends on the item."""
    W = len(base_bytes)
    ranks = [_Rank(base_bytes[r], base_flops[r]) for r in range(W)]
    order = sorted(items, key=lambda i: (-i.score, i.index))
    heap = [(level(r.bytes, r.flops), idx) for idx, r in enumerate(ranks)]
    heapq.heapify(heap)
    probe = min(W, 8)
    for it in order:
        popped = [heapq.heappop(heap) for _ in range(probe)]
        best = min(
            popped,
            key=lambda e: (level(ranks[e[1]].bytes + it.bytes, ranks[e[1]].flops + it.flops), e[1]),
        )
        r = best[1]
        ranks[r].bytes += it.bytes
        ranks[r].flops += it.flops
        ranks[r].items.append(it.index)
        for e in popped:
            if e[1] == r:
                heapq.heappush(heap, (level(ranks[r].bytes, ranks[r].flops), r))
            else:
                heapq.heappush(heap, e)
    refine(ranks, items, level, refine_iterations)  # refine.py: moves and swaps off the busiest
    even_shapes(ranks, items)  # shape_counts.py: each rank an even share of every shape
    return ranks


def _splits_by_band(s: TensorSpec, row_block: int) -> bool:
    """A trainable plain 2D matrix of more than one band of ``row_block`` rows (a fused
    ``wqkv`` read as several matrices, a conv kernel or a stack is not cut into bands; nor
    one to be placed whole: ``TensorSpec.whole``)."""
    if s.whole or not s.requires_grad or len(s.shape) != 2 or int(s.shape[0]) <= row_block:
        return False
    view = s.view if s.view is not None else default_matrix_view(s.shape, name=s.fqn)
    return view is not None and view.kind == "matrix" and view.resolve(s.shape, s.fqn).single


def _align_bands(ranks: list[_Rank], items: list[_Item], band_of: dict[int, tuple[str, int]], row_block: int) -> None:
    """Rows are handed out per rank in rank order, so every cut falls on a multiple of
    ``row_block`` only if a matrix's short last band sits on the last rank holding its bands:
    swap it there with a whole band (and the loads with it) when the placement put it elsewhere."""
    owner = {i: r for r, rk in enumerate(ranks) for i in rk.items}
    by_fqn: dict[str, list[int]] = {}
    for i, (fqn, _) in band_of.items():
        by_fqn.setdefault(fqn, []).append(i)
    for indices in by_fqn.values():
        short = [i for i in indices if band_of[i][1] < row_block]
        if not short:
            continue
        last = max(owner[i] for i in indices)
        s = short[0]
        if owner[s] == last:
            continue
        full = min(i for i in indices if owner[i] == last)
        a, b = items[s], items[full]
        here, there = ranks[owner[s]], ranks[last]
        here.items[here.items.index(s)] = full
        there.items[there.items.index(full)] = s
        here.bytes += b.bytes - a.bytes
        here.flops += b.flops - a.flops
        there.bytes += a.bytes - b.bytes
        there.flops += a.flops - b.flops
        owner[s], owner[full] = last, owner[s]


def plan_model(
    model: nn.Module,
    world_size: int,
    *,
    roles: Mapping[str, str] | None = None,
    preconditioner: CostSpec | None = None,
    unit_prefixes: Sequence[str] | None = None,
    matrix_views: Mapping[str, str | MatrixView] | None = None,
) -> ShardingPlan:
    """The :class:`ShardingPlan` that ``fully_shard`` would apply, computed in one process.

    Args:
        model: any module; meta-device parameters are fine (only shapes and dtypes are read).
        world_size: data-parallel size to plan for (1 to thousands).
        roles: ``{"fqn-glob": "matrix" | "tail" | "rows"}`` overriding the defaults.
        preconditioner: registered name, :class:`CostModel`, or optimizer class whose
            ``cost_model`` prices the matrices (``resolve_cost``; None: ``DEFAULT_COST``).
        unit_prefixes: module fqns in ``fully_shard`` call order (blocks first, ``""`` for the
            root). When omitted, the units recorded by an earlier ``fully_shard`` call are used,
            or the whole model is one unit.
        matrix_views: ``{"fqn-glob": "stack" | "conv" | MatrixView(...)}`` overriding how a
            matrix is read (see :mod:`.views`); the cost is summed over its matrices.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"plan_model(model, world_size): model must be a torch.nn.Module, got "
            f"{type(model).__name__}; to plan loose tensors, wrap them in a module "
            "(torch.nn.ParameterDict) or call plan_tensors with TensorSpec entries"
        )
    if unit_prefixes is None:
        unit_prefixes = recorded_unit_prefixes(model)
    specs = specs_from_module(model, roles=roles, unit_prefixes=unit_prefixes, matrix_views=matrix_views)
    cost = resolve_cost(preconditioner)  # an unknown name fails before anything is planned
    return plan_tensors(specs, world_size, cost=cost)
