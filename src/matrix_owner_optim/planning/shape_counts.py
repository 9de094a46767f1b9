"""Even out how many matrices of each shape every rank owns, at no cost to balance.

Two matrices of one unit with equal bytes and FLOPs but different shapes (an MLP's tall ``fc``
and wide ``proj``, an expert stack's ``w1`` and ``w2``) trade owners while that lowers the sum
over ranks and shapes of the squared counts. Their ranks' loads and the unit's per-rank bytes
(its gather and reduce segments) stay as they are.

Why: the matrix optimizer batches same-shape matrices (one stacked Newton-Schulz per shape)
and kernels' speed differs by shape beyond FLOPs. Placed model-order, a GPT's ``fc`` /
``proj`` pairs put all four tall MLP matrices on one rank at W=2, which then took 22.3 ms per
optimizer step against the other rank's 19.6 ms (a tall stack's Newton-Schulz iterates through
transposed operands, as torch.optim.Muon's does: 12% slower on CPU).

The search is a fixed greedy: for each matrix ``a`` of a group in item order, the matrices
``b`` after it are tried in order and ``a`` trades with every ``b`` that lowers the sum (``a``
then sits on ``b``'s old rank and the scan goes on from there). Tried pair by pair that is
quadratic in the group (36,096 experts of one unit for Qwen3-235B planned as one unit), so the
next ``b`` that trades is found directly: ``b`` of shape ``t`` on rank ``r`` trades with ``a``
(shape ``s``, rank ``q``) exactly when ``g(r) < g(q) - 2`` for ``g = count(., s) - count(., t)``,
so ranks are kept in buckets of ``g`` per shape pair, each rank's positions of each shape in a
sorted list, and the first trading ``b`` is the least next position over the ranks whose ``g``
qualifies. The result is the pair-by-pair greedy's, trade for trade.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from typing import Protocol

__all__ = ["even_shapes"]


class ShapedItem(Protocol):
    """What the search reads of a placed item (``planner._Item``)."""

    index: int
    bytes: float
    flops: float
    is_matrix: bool
    unit: int
    shape: tuple[int, ...]


class HoldingRank(Protocol):
    """What the search changes of a rank (``planner._Rank``): the items it holds."""

    items: list[int]


Shape = tuple[int, ...]


def even_shapes(ranks: Sequence[HoldingRank], items: Sequence[ShapedItem]) -> None:
    """Trade owners of equal-cost, different-shape matrices of one unit (see the module's
    docstring), in place on ``ranks``' item lists; loads are unchanged by construction."""
    owner: dict[int, int] = {}
    slot: dict[int, int] = {}  # item index -> its position in its rank's list
    for r, rk in enumerate(ranks):
        for k, i in enumerate(rk.items):
            owner[i] = r
            slot[i] = k
    count: dict[tuple[int, Shape], int] = {}
    groups: dict[tuple[int, float, float], list[ShapedItem]] = {}
    for it in items:
        if it.is_matrix and it.shape and it.index in owner:
            key = (owner[it.index], it.shape)
            count[key] = count.get(key, 0) + 1
            groups.setdefault((it.unit, it.bytes, it.flops), []).append(it)
    for group in groups.values():
        if len({it.shape for it in group}) >= 2:
            _GroupSearch(group, owner, slot, count, ranks).run()


class _GroupSearch:
    """The greedy over one group of equal-cost matrices (positions are the group's order)."""

    def __init__(
        self,
        group: list[ShapedItem],
        owner: dict[int, int],
        slot: dict[int, int],
        count: dict[tuple[int, Shape], int],
        ranks: Sequence[HoldingRank],
    ) -> None:
        self.group, self.owner, self.slot, self.count, self.ranks = group, owner, slot, count, ranks
        self.shapes: list[Shape] = list(dict.fromkeys(it.shape for it in group))
        # positions of each shape on each rank, ascending (positions before the scan are dead)
        self.positions: dict[Shape, dict[int, list[int]]] = {t: {} for t in self.shapes}
        for y, it in enumerate(group):
            self.positions[it.shape].setdefault(owner[it.index], []).append(y)
        # per ordered shape pair (s, t): the ranks holding t in this group, bucketed by
        # g = count(r, s) - count(r, t)
        self.g: dict[tuple[Shape, Shape], dict[int, int]] = {}
        self.buckets: dict[tuple[Shape, Shape], dict[int, set[int]]] = {}
        for s in self.shapes:
            for t in self.shapes:
                if s == t:
                    continue
                values = {r: self._c(r, s) - self._c(r, t) for r in self.positions[t]}
                buckets: dict[int, set[int]] = {}
                for r, v in values.items():
                    buckets.setdefault(v, set()).add(r)
                self.g[(s, t)], self.buckets[(s, t)] = values, buckets

    def _c(self, r: int, shape: Shape) -> int:
        return self.count.get((r, shape), 0)

    def run(self) -> None:
        for x, a in enumerate(self.group):
            start = x + 1
            while True:
                y = self._next_trade(a, start, x + 1)
                if y is None:
                    break
                self._trade(a, self.group[y], y)
                start = y + 1

    def _next_trade(self, a: ShapedItem, start: int, alive: int) -> int | None:
        """The first position ``>= start`` whose matrix trades with ``a`` (None: none does).
        Positions before ``alive`` are behind every later scan: a rank holding none of a shape
        from there on leaves that shape's buckets until a trade gives it one again."""
        q, s = self.owner[a.index], a.shape
        first: int | None = None
        for t in self.shapes:
            if t == s:
                continue
            limit = self._c(q, s) - self._c(q, t) - 2  # b on r trades iff g(r) < limit
            buckets = self.buckets[(s, t)]
            held = self.positions[t]
            spent: list[int] = []
            for v in sorted(buckets):
                if v >= limit:
                    break
                for r in buckets[v]:
                    if r == q:
                        continue
                    pos = held[r]
                    if not pos or pos[-1] < alive:
                        spent.append(r)
                        continue
                    k = bisect_left(pos, start)
                    if k < len(pos) and (first is None or pos[k] < first):
                        first = pos[k]
            for r in spent:
                for other in self.shapes:
                    if other != t:
                        self._drop(other, t, r)
        return first

    def _drop(self, s: Shape, t: Shape, r: int) -> None:
        values, buckets = self.g[(s, t)], self.buckets[(s, t)]
        old = values.pop(r, None)
        if old is not None:
            buckets[old].discard(r)
            if not buckets[old]:
                del buckets[old]

    def _trade(self, a: ShapedItem, b: ShapedItem, y: int) -> None:
        ra, rb = self.owner[a.index], self.owner[b.index]
        for r, shape, d in ((ra, a.shape, -1), (rb, a.shape, 1), (rb, b.shape, -1), (ra, b.shape, 1)):
            self.count[(r, shape)] = self._c(r, shape) + d
        ia, ib = self.slot[a.index], self.slot[b.index]
        self.ranks[ra].items[ia] = b.index
        self.ranks[rb].items[ib] = a.index
        self.slot[a.index], self.slot[b.index] = ib, ia
        self.owner[a.index], self.owner[b.index] = rb, ra
        # b's position moves from rb's list to ra's (a's is behind the scan: dead already)
        self.positions[b.shape][rb].remove(y)
        insort(self.positions[b.shape].setdefault(ra, []), y)
        for s, t in self.g:
            if {s, t} & {a.shape, b.shape}:
                for r in (ra, rb):
                    self._regrade(s, t, r)

    def _regrade(self, s: Shape, t: Shape, r: int) -> None:
        """Re-bucket rank ``r`` for the pair ``(s, t)`` after its counts changed."""
        values, buckets = self.g[(s, t)], self.buckets[(s, t)]
        if r not in self.positions[t]:
            return
        new = self._c(r, s) - self._c(r, t)
        old = values.get(r)
        if old == new:
            return
        if old is not None:
            buckets[old].discard(r)
            if not buckets[old]:
                del buckets[old]
        values[r] = new
        buckets.setdefault(new, set()).add(r)
