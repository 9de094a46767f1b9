"""Blocked Shampoo's blocks as ownable units (issue 20): a matrix cut into bands of whole blocks
between owners steps exactly as one process, with no collective in the step.

Shampoo with ``max_preconditioner_dim=B`` keeps factors, roots and the graft norm per block and
everything else per element, so rows cut at multiples of ``B`` are independent. The planner
(``shampoo_cost`` is a ``BlockedCostModel`` with ``row_block = B``) cuts a heavy 2D matrix into
such bands when that lowers the busiest rank; the runtime gathers and reduces the bands as row
segments (as split expert stacks), and each owner's Shampoo steps its band under the whole
matrix's block indices (``L_3_0`` is block row 3 at every world size).

Without processes: plans (bands to different owners, cuts on multiples of ``B``, no cut where
whole matrices balance, no cut for Muon), the optimizer's options reaching the plan, and one
process stepping bands bitwise as the whole matrix. With gloo at W=2 and W=3: parameters after
several steps against a single-process ``Shampoo`` on the unsharded model, zero collectives in
``optimizer.step()`` (CommCounter and profiler), and DCP state round trips across world sizes.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from _ranks import spawn_ranks
from _ref import computed_once, rel_err_native
from _tolerances import LOCKSTEP_RTOL
from _tolerances import SHAMPOO_BLOCKS_RTOL as RTOL
from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.comm import CommCounter, comm_phase
from matrix_owner_optim.optim.routing import OptimizerKind
from matrix_owner_optim.planning import get_matrix_shard, plan_model, resolve_cost
from matrix_owner_optim.planning.bands import declare_row_band
from matrix_owner_optim.planning.cost import MUON_COST, row_block_of, shampoo_cost, soap_cost
from matrix_owner_optim.preconditioners import Muon, Shampoo
from matrix_owner_optim.sharding import fully_shard
from matrix_owner_optim.toolbox.profiling import backend_ops

B = 32  # max_preconditioner_dim
DIM, WIDE, BATCH = 64, 256, 8  # per rank
STEPS = 4
CPU = [torch.profiler.ProfilerActivity.CPU]
SHAMPOO = {
    "lr": 0.05,
    "max_preconditioner_dim": B,
    "eps": 1e-4,
    "grafting": "adam",
    "momentum": 0.5,
    "weight_decay": 0.01,
    "max_aspect_ratio": 2.0,
}
# the tolerances and the measured noise floor behind them: tests/_tolerances.py


class Wide(torch.nn.Module):
    """x -> tanh(up x) -> down -> mix: ``up`` [256, 64] and ``down`` [64, 256] carry most of
    Shampoo's cost, so at W=2 and W=3 the planner cuts them into bands of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(DIM, WIDE, bias=False)
        self.down = torch.nn.Linear(WIDE, DIM, bias=False)
        self.mix = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.down(torch.tanh(self.up(x))))


def _model() -> Wide:
    torch.manual_seed(0)
    return Wide()


def _cuts(plan, fqn: str) -> list[tuple[int, int, int]]:
    return [r for r in plan[fqn].row_owners if r[1] > r[0]]


# -- planning, no processes --------------------------------------------------------------------
@pytest.mark.parametrize("W", [2, 3])
def test_blocked_shampoo_gives_the_blocks_of_one_matrix_to_different_owners(W: int) -> None:
    cost = shampoo_cost(max_preconditioner_dim=B)
    plan = plan_model(_model(), W, preconditioner=cost)
    whole = plan_model(_model(), W, preconditioner=shampoo_cost(max_preconditioner_dim=1024))
    print(f"W={W}: banded {plan.imbalance()}, whole-matrix {whole.imbalance()}")
    assert plan["up.weight"].is_split and len({r for *_, r in _cuts(plan, "up.weight")}) >= 2
    for shard in plan:
        for start, stop, _ in shard.row_owners:
            assert start % B == 0 and (stop % B == 0 or stop == shard.shape[0]), shard.row_owners
        if shard.is_split:
            assert sum(b - a for a, b, _ in shard.row_owners) == shard.shape[0]
    assert plan.imbalance()["bytes_max_over_mean"] < whole.imbalance()["bytes_max_over_mean"]
    assert plan.imbalance()["flops_max_over_mean"] < whole.imbalance()["flops_max_over_mean"]
    assert plan.imbalance()["bytes_max_over_mean"] < 1.01


def test_short_last_band_ends_the_matrix_and_every_cut_is_a_block_boundary() -> None:
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = torch.nn.Linear(DIM, 3 * B + 8, bias=False)  # bands 32, 32, 32, 8
            self.small = torch.nn.Linear(DIM, DIM, bias=False)

    for W in (2, 3):
        plan = plan_model(Odd(), W, preconditioner=shampoo_cost(max_preconditioner_dim=B))
        cuts = _cuts(plan, "big.weight")
        assert len(cuts) >= 2, cuts
        assert all(a % B == 0 for a, _, _ in cuts) and cuts[-1][1] == 3 * B + 8
        assert all(b % B == 0 for _, b, _ in cuts[:-1]), cuts


def test_no_cut_where_whole_matrices_balance() -> None:
    class Twins(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(DIM, WIDE, bias=False)
            self.b = torch.nn.Linear(DIM, WIDE, bias=False)

    plan = plan_model(Twins(), 2, preconditioner=shampoo_cost(max_preconditioner_dim=B))
    assert not any(s.is_split for s in plan), [s.row_owners for s in plan]
    assert {plan["a.weight"].owner, plan["b.weight"].owner} == {0, 1}
    assert plan.imbalance()["bytes_max_over_mean"] == pytest.approx(1.0)


def test_no_cut_for_an_optimizer_that_steps_whole_matrices() -> None:
    whole_shampoo = resolve_cost("torch_optimizer_shampoo")  # torch_optimizer's: one block per matrix
    for cost in (MUON_COST, soap_cost(), shampoo_cost(max_preconditioner_dim=1024), whole_shampoo):
        plan = plan_model(_model(), 2, preconditioner=cost)
        assert not any(s.is_split for s in plan), cost.name
    assert row_block_of(MUON_COST) is None and row_block_of(soap_cost()) is None
    assert row_block_of(whole_shampoo) is None


def test_the_optimizers_block_size_reaches_the_plan() -> None:
    def matrix_cost(**kw: Any) -> Any:  # what prices a plan this optimizer fixes
        return OwnerRoutedOptimizer(_model(), **kw)._kinds[OptimizerKind.MATRIX].cost

    assert row_block_of(matrix_cost(matrix="shampoo", matrix_options={"max_preconditioner_dim": B})) == B
    assert row_block_of(matrix_cost(matrix="shampoo")) == 1024  # Shampoo's default block
    assert row_block_of(Shampoo.cost_model) == 1024
    assert matrix_cost(matrix="muon") is MUON_COST  # the instance's price (Muon's own)


# -- one process: a band steps as those rows of the whole matrix --------------------------------
@pytest.mark.parametrize("cuts", [[(0, 32), (32, 80)], [(0, 64), (64, 80)], [(0, 32), (32, 64), (64, 80)]])
def test_bands_step_bitwise_as_the_whole_matrix(cuts: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    m, n = 80, 48
    w = torch.randn(m, n)
    whole = torch.nn.Parameter(w.clone())
    ref = Shampoo([whole], **SHAMPOO)
    bands = []
    for a, b in cuts:
        band = torch.nn.Parameter(w[a:b].clone())
        declare_row_band(band, a, b, m)
        bands.append(band)
    opt = Shampoo(bands, **SHAMPOO)
    for _ in range(5):
        g = torch.randn(m, n)
        whole.grad = g.clone()
        for band, (a, b) in zip(bands, cuts, strict=True):
            band.grad = g[a:b].clone()
        ref.step()
        opt.step()
    assert torch.equal(torch.cat([b.detach() for b in bands]), whole.detach())
    keys = set(ref.state[whole])
    per_band = [set(opt.state[b]) - {"step", "filtered_grad", "momentum_buffer", "graft_state"} for b in bands]
    assert set().union(*per_band) | {"step", "filtered_grad", "momentum_buffer", "graft_state"} == keys
    assert all(not (x & y) for i, x in enumerate(per_band) for y in per_band[i + 1 :])
    for band, blocks in zip(bands, per_band, strict=True):
        for k in blocks:
            assert torch.equal(opt.state[band][k], ref.state[whole][k]), k


def test_a_band_off_the_block_grid_or_for_muon_is_refused() -> None:
    band = torch.nn.Parameter(torch.zeros(40, 16))
    declare_row_band(band, 16, 56, 80)
    with pytest.raises(ValueError, match="not whole blocks of 32 rows"):
        Shampoo([band], max_preconditioner_dim=32)
    with pytest.raises(ValueError, match="band of a matrix cut between owners"):
        Muon([band])


# -- gloo, W = 2 and 3 --------------------------------------------------------------------------
def _batch(step: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(W * BATCH, DIM, generator=g), torch.randn(W * BATCH, DIM, generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _reference(model: Wide, W: int, order: str) -> dict[str, torch.Tensor]:
    """The single-process Shampoo run on the unsharded model. ``order``: ``"global"`` (one
    backward over the global batch), ``"reversed"`` (the same batch reversed: only the
    gradient's summation order changes, the noise floor), ``"lockstep"`` (one backward per
    rank's micro-batch, accumulated in rank order and divided by W: what the reduce-scatter
    computes)."""
    opt = Shampoo(model.parameters(), **SHAMPOO)
    for step in range(STEPS):
        x, y = _batch(step, W)
        if order == "lockstep":
            for r in range(W):
                _loss(model, x[r * BATCH : (r + 1) * BATCH], y[r * BATCH : (r + 1) * BATCH]).backward()
            for p in model.parameters():
                p.grad.div_(W)
        else:
            if order == "reversed":
                x, y = x.flip(0), y.flip(0)
            _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return rel_err_native(a, b, floor=0.0)  # no floor: every reference here is nonzero


def _sharded(W: int) -> tuple[Wide, OwnerRoutedOptimizer]:
    model = _model()
    fully_shard(model)
    opt = OwnerRoutedOptimizer(model, matrix="shampoo", matrix_options=SHAMPOO, tail="adamw")
    return model, opt


def _train_step(model: Wide, opt: OwnerRoutedOptimizer, step: int, rank: int, W: int) -> None:
    x, y = _batch(step, W)
    _loss(model, x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]).backward()


def _full_state(opt: OwnerRoutedOptimizer) -> dict[int, dict[str, Any]]:
    """The optimizer state as full tensors by parameter index: every piece of ``state_dict()``
    gathered (collective; every rank lists the same keys in the same order). (Not torch's
    ``full_state_dict``: it refuses Shampoo's ``root_dtype``, a ``torch.dtype`` in the group.)"""
    out: dict[int, dict[str, Any]] = {}
    for idx, st in opt.state_dict()["state"].items():
        out[idx] = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in st.items()}
    return out


def _job(rank: int, W: int, ckpt: str, full_path: str) -> dict:
    torch.set_num_threads(1)
    refs = computed_once(
        lambda: {order: _reference(_model(), W, order) for order in ("global", "reversed", "lockstep")}
    )
    model, opt = _sharded(W)
    cuts = {
        n: [r for r in get_matrix_shard(p).row_owners if r[1] > r[0]]
        for n, p in model.named_parameters()
        if get_matrix_shard(p).is_split
    }
    step_calls, step_bytes, step_ops = 0, 0, []
    for step in range(STEPS):
        _train_step(model, opt, step, rank, W)
        with CommCounter() as cc, comm_phase("optimizer"), torch.profiler.profile(activities=CPU) as prof:
            opt.step()
        step_calls += cc.calls()
        step_bytes += cc.bytes()
        step_ops += [op.name for op in backend_ops(prof)]
        opt.zero_grad()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=ckpt)
    state = _full_state(opt)
    if rank == 0:
        torch.save(state, full_path)
    return {
        "cuts": cuts,
        "errs": {n: _rel_err(full[n], refs["global"][n]) for n in full},
        "lockstep": max(_rel_err(full[n], refs["lockstep"][n]) for n in full),
        "floor": max(_rel_err(refs["reversed"][n], refs["global"][n]) for n in full),
        "step_calls": step_calls,
        "step_bytes": step_bytes,
        "step_ops": step_ops,
        "keys": {n: sorted(st) for n, st in state.items()},
    }


def _load_job(rank: int, W: int, ckpt: str, full_path: str) -> dict:
    """A fresh model and optimizer at W (state made by one step, then replaced): DCP loads the
    state saved at another world size, and the full state equals the saved one bitwise."""
    torch.set_num_threads(1)
    model, opt = _sharded(W)
    _train_step(model, opt, 0, rank, W)
    opt.step()
    opt.zero_grad()
    sd = get_optimizer_state_dict(model, opt)
    dcp.load(sd, checkpoint_id=ckpt)
    set_optimizer_state_dict(model, opt, sd)
    loaded, saved = _full_state(opt), torch.load(full_path, weights_only=True)
    differ = [
        f"{n}.{k}"
        for n, st in saved.items()
        for k, v in st.items()
        if k not in loaded.get(n, {}) or (isinstance(v, torch.Tensor) and not torch.equal(v, loaded[n][k]))
    ]
    split = sorted(n for n, p in model.named_parameters() if get_matrix_shard(p).is_split)
    return {
        "same_keys": {n: sorted(st) for n, st in loaded.items()} == {n: sorted(st) for n, st in saved.items()},
        "differ": differ,
        "split": split,
    }


@pytest.mark.multirank
@pytest.mark.parametrize("W", [2, 3])
def test_blocked_shampoo_with_blocks_on_different_owners_is_exact_with_a_silent_step(W: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        ckpt, full_path = os.path.join(root, "ckpt"), os.path.join(root, "full.pt")
        res = spawn_ranks(_job, W, ckpt, full_path)
        worst = max(max(r["errs"].values()) for r in res)
        print(
            f"\nW={W}: bands {res[0]['cuts']}\n  worst rel error vs one process (global batch) {worst:.2e} "
            f"{res[0]['errs']}\n  noise floor (one process, batch reversed) {res[0]['floor']:.2e}; vs the "
            f"lockstep reference {max(r['lockstep'] for r in res):.2e}\n  optimizer step, all ranks, "
            f"{STEPS} steps: {sum(r['step_calls'] for r in res)} collectives, {sum(r['step_bytes'] for r in res)} "
            f"bytes, {sum(len(r['step_ops']) for r in res)} backend ops"
        )
        for r in res:
            assert r["cuts"]["up.weight"] and len({rk for *_, rk in r["cuts"]["up.weight"]}) >= 2, r["cuts"]
            assert r["step_calls"] == 0 and r["step_bytes"] == 0 and r["step_ops"] == [], r
            assert r["floor"] <= RTOL and max(r["errs"].values()) <= RTOL, (r["floor"], r["errs"])
            assert r["lockstep"] <= LOCKSTEP_RTOL, r["lockstep"]
            assert r["keys"] == res[0]["keys"]  # every rank's full state dict: the same keys
        for other in (5 - W, 1):  # W=2 -> 3 and 1; W=3 -> 2 and 1
            loads = spawn_ranks(_load_job, other, ckpt, full_path)
            print(
                f"  DCP state saved at W={W} loaded at W={other}: split {loads[0]['split']}, differ {loads[0]['differ']}"
            )
            for r in loads:
                assert r["same_keys"] and r["differ"] == [], r
