"""The planner's two searches find, move for move, what their item-by-item forms find.

``refine.refine`` tries each class of interchangeable items once and ``shape_counts.even_shapes``
finds the next trading matrix from buckets, so that both stay near-linear at frontier scale; the
plans they give must be those of the plain searches (below, as the planner ran them before), on
random placements with many equal items (experts), a few odd ones, and every tie the plain
searches break by order.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import pytest

from matrix_owner_optim.planning.refine import refine
from matrix_owner_optim.planning.shape_counts import even_shapes


@dataclass
class Item:
    index: int
    bytes: float
    flops: float
    is_matrix: bool = True
    score: float = 0.0
    unit: int = 0
    shape: tuple[int, ...] = ()


@dataclass
class Rank:
    bytes: float = 0.0
    flops: float = 0.0
    items: list[int] = field(default_factory=list)


def plain_refine(ranks: list[Rank], items: list[Item], level, iterations: int) -> None:
    """Every item on the busiest rank, every lower rank, a move or a swap with every smaller item."""
    for _ in range(iterations):
        levels = [level(r.bytes, r.flops) for r in ranks]
        hi = max(range(len(ranks)), key=lambda r: (levels[r], -r))
        best = None
        current = levels[hi]
        for i in ranks[hi].items:
            a = items[i]
            for lo in range(len(ranks)):
                if lo == hi or levels[lo] >= current:
                    continue
                cand = max(
                    level(ranks[hi].bytes - a.bytes, ranks[hi].flops - a.flops),
                    level(ranks[lo].bytes + a.bytes, ranks[lo].flops + a.flops),
                )
                if cand < current and (best is None or (cand, i, lo) < best[0:3]):
                    best = (cand, i, lo, None)
                for j in ranks[lo].items:
                    b = items[j]
                    if b.score >= a.score:
                        continue
                    cand = max(
                        level(ranks[hi].bytes - a.bytes + b.bytes, ranks[hi].flops - a.flops + b.flops),
                        level(ranks[lo].bytes + a.bytes - b.bytes, ranks[lo].flops + a.flops - b.flops),
                    )
                    if cand < current and (best is None or (cand, i, lo) < best[0:3]):
                        best = (cand, i, lo, j)
        if best is None:
            return
        _, i, lo, swap_with = best
        for src, dst, k in ((hi, lo, i), (lo, hi, swap_with)):
            if k is None:
                continue
            ranks[src].items.remove(k)
            ranks[dst].items.append(k)
            ranks[src].bytes -= items[k].bytes
            ranks[src].flops -= items[k].flops
            ranks[dst].bytes += items[k].bytes
            ranks[dst].flops += items[k].flops


def plain_even_shapes(ranks: list[Rank], items: list[Item]) -> None:
    """Every pair of a group, in order, trading when that lowers the sum of squared counts."""
    owner = {i: r for r, rk in enumerate(ranks) for i in rk.items}
    count: dict = {}
    groups: dict = {}
    for it in items:
        if it.is_matrix and it.shape and it.index in owner:
            count[(owner[it.index], it.shape)] = count.get((owner[it.index], it.shape), 0) + 1
            groups.setdefault((it.unit, it.bytes, it.flops), []).append(it)
    for group in groups.values():
        if len({it.shape for it in group}) < 2:
            continue
        for x, a in enumerate(group):
            for b in group[x + 1 :]:
                ra, rb = owner[a.index], owner[b.index]
                if ra == rb or a.shape == b.shape:
                    continue

                def c(r, shape):
                    return count.get((r, shape), 0)

                delta = 2 * (c(rb, a.shape) - c(ra, a.shape) + c(ra, b.shape) - c(rb, b.shape)) + 4
                if delta >= 0:
                    continue
                for r, shape, d in ((ra, a.shape, -1), (rb, a.shape, 1), (rb, b.shape, -1), (ra, b.shape, 1)):
                    count[(r, shape)] = c(r, shape) + d
                ranks[ra].items[ranks[ra].items.index(a.index)] = b.index
                ranks[rb].items[ranks[rb].items.index(b.index)] = a.index
                owner[a.index], owner[b.index] = rb, ra


def _placement(rng: random.Random, with_shapes: bool) -> tuple[list[Rank], list[Item]]:
    W, n = rng.randint(2, 12), rng.randint(1, 90)
    costs = [(rng.choice([0.5, 1.0, 2.0, 3.0]), rng.choice([1.0, 2.0, 4.0])) for _ in range(rng.randint(1, 4))]
    shapes = [(2, 3), (3, 2), (4, 4), (1, 6)][: rng.randint(1, 4)]
    items = []
    for i in range(n):
        b, f = rng.choice(costs) if rng.random() < 0.85 else (rng.random() * 3, rng.random() * 3)
        items.append(
            Item(
                i,
                b,
                f,
                is_matrix=rng.random() < 0.9,
                score=b / 7.0 + f / 9.0,
                unit=rng.randint(0, 2),
                shape=rng.choice(shapes) if with_shapes else (),
            )
        )
    ranks = [Rank(rng.random() * 2, rng.random() * 2) for _ in range(W)]
    for it in items:
        if with_shapes and rng.random() < 0.1:
            continue  # placed nowhere: skipped by both
        r = rng.randrange(W) if rng.random() < 0.6 else rng.randrange(min(W, 2))
        ranks[r].items.append(it.index)
        ranks[r].bytes += it.bytes
        ranks[r].flops += it.flops
    return ranks, items


def _level(b: float, f: float) -> tuple[float, float]:
    nb, nf = b / 7.0, f / 9.0
    return (max(nb, nf), nb + nf)


@pytest.mark.parametrize("seed", range(2))
def test_refine_moves_as_the_item_by_item_search(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        ranks, items = _placement(rng, with_shapes=False)
        iterations = rng.choice([1, 3, 200])
        fast, plain = copy.deepcopy(ranks), copy.deepcopy(ranks)
        refine(fast, items, _level, iterations)
        plain_refine(plain, items, _level, iterations)
        assert [(r.items, r.bytes, r.flops) for r in fast] == [(r.items, r.bytes, r.flops) for r in plain]


@pytest.mark.parametrize("seed", range(2))
def test_even_shapes_trades_as_the_pair_by_pair_search(seed: int) -> None:
    rng = random.Random(100 + seed)
    traded = 0
    for _ in range(200):
        ranks, items = _placement(rng, with_shapes=True)
        fast, plain = copy.deepcopy(ranks), copy.deepcopy(ranks)
        even_shapes(fast, items)
        plain_even_shapes(plain, items)
        assert [r.items for r in fast] == [r.items for r in plain]
        traded += [r.items for r in fast] != [r.items for r in ranks]
    assert traded > 30  # the instances do exercise trades
