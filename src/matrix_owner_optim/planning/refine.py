"""The planner's local search: move or swap one item off the most loaded rank while that lowers
the pair's maximum, up to ``iterations`` times.

Each round takes, over every item ``a`` on the busiest rank, every less loaded rank ``lo`` and
either a move of ``a`` to ``lo`` or a swap with a smaller item ``b`` on ``lo``, the option whose
new maximum of the two ranks' levels is lowest (ties: the lowest item index, then the lowest
rank, then a move before a swap, then the first ``b`` in ``lo``'s list). Tried item by item that
is (items on the busiest rank) x W x (items per rank) per round: 8 million at W=256 for
DeepSeek-V3's 45,032 experts. Items of equal bytes, FLOPs and score (an expert stack's experts,
the same matrix of every block) are interchangeable in every comparison, so each class is tried
once: ``a`` as the class's lowest index on the busiest rank, ``b`` as the class's first item in
``lo``'s list, which is the item the item-by-item search would pick. The result is that
search's, move for move.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = ["refine"]

Level = tuple[float, float]


class PricedItem(Protocol):
    """What the search reads of an item (``planner._Item``)."""

    index: int
    bytes: float
    flops: float
    score: float


class LoadedRank(Protocol):
    """What the search changes of a rank (``planner._Rank``)."""

    bytes: float
    flops: float
    items: list[int]


def refine(
    ranks: Sequence[LoadedRank],
    items: Sequence[PricedItem],
    level: Callable[[float, float], Level],
    iterations: int,
) -> None:
    """Improve ``ranks`` in place (see the module's docstring)."""
    key = [(it.bytes, it.flops, it.score) for it in items]
    firsts: dict[int, list[int]] = {}  # rank -> first item of each class in its list, list order

    def classes_of(r: int) -> list[int]:
        found = firsts.get(r)
        if found is None:
            seen: set[tuple[float, float, float]] = set()
            found = []
            for j in ranks[r].items:
                if key[j] not in seen:
                    seen.add(key[j])
                    found.append(j)
            firsts[r] = found
        return found

    for _ in range(iterations):
        levels = [level(r.bytes, r.flops) for r in ranks]
        hi = max(range(len(ranks)), key=lambda r: (levels[r], -r))
        current = levels[hi]
        top = ranks[hi]
        lowest: dict[tuple[float, float, float], int] = {}  # class -> its lowest index on hi
        for i in top.items:
            if i < lowest.get(key[i], len(items)):
                lowest[key[i]] = i
        lows = [lo for lo in range(len(ranks)) if lo != hi and levels[lo] < current]
        best: tuple[Level, int, int, int | None] | None = None
        for i in sorted(lowest.values()):
            a = items[i]
            hb, hf = top.bytes - a.bytes, top.flops - a.flops
            moved = level(hb, hf)
            kept: dict[tuple[float, float, float], Level] = {}  # hi's level after a swap with b's class
            for lo in lows:
                low = ranks[lo]
                lb, lf = low.bytes + a.bytes, low.flops + a.flops
                if best is None or moved <= best[0]:  # a move can still win
                    cand = max(moved, level(lb, lf))
                    if cand < current and (best is None or (cand, i, lo) < best[0:3]):
                        best = (cand, i, lo, None)
                for j in classes_of(lo):
                    b = items[j]
                    if b.score >= a.score:
                        continue
                    there = kept.get(key[j])
                    if there is None:
                        there = kept[key[j]] = level(hb + b.bytes, hf + b.flops)
                    if there >= current or (best is not None and there > best[0]):
                        continue  # the new maximum is at least the busiest rank's: no better
                    cand = max(there, level(lb - b.bytes, lf - b.flops))
                    if cand < current and (best is None or (cand, i, lo) < best[0:3]):
                        best = (cand, i, lo, j)
        if best is None:
            return
        _, i, lo, swap_with = best
        _move(ranks, items, i, hi, lo)
        if swap_with is not None:
            _move(ranks, items, swap_with, lo, hi)
        firsts.pop(hi, None)
        firsts.pop(lo, None)


def _move(ranks: Sequence[LoadedRank], items: Sequence[PricedItem], i: int, src: int, dst: int) -> None:
    """Item ``i`` from rank ``src`` to rank ``dst``, with its bytes and FLOPs."""
    item = items[i]
    ranks[src].items.remove(i)
    ranks[dst].items.append(i)
    ranks[src].bytes -= item.bytes
    ranks[src].flops -= item.flops
    ranks[dst].bytes += item.bytes
    ranks[dst].flops += item.flops
