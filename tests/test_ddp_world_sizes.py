"""OwnerRoutedOptimizer on DistributedDataParallel at W=3, with Muon and with Shampoo.

``tests/test_ddp.py`` covers W=2 with Muon; this file covers an odd world size, where the owners
of the matrices are uneven, with both matrix optimizers and both replicated modes, in one
spawned gloo job. Each run trains a tiny GPT for 8 steps on every rank and checks:

* against a lockstep single-process reference (plain Muon / Shampoo + AdamW on an unsharded
  copy, routed by the optimizer's roles, fed each step the gradients DDP averaged): every rank's
  parameters, bitwise as measured (tolerance 1e-6);
* Muon also against the whole-batch single-process reference (its own gradients): losses and
  parameters, tolerances from the measured errors;
* replicas identical on every rank (bitwise);
* collectives per step, counted by ``torch.profiler``: ``replicated="owner"`` issues exactly one
  ``all_to_all``; ``replicated="redundant"`` issues none.

Shampoo runs at eps 1e-6 (the shared default is 1e-4): against the whole-batch reference its
inverse roots amplify the summation-order round-off of the all-reduce (3e-4 in 20 steps on the
owner layout), so only the lockstep reference is meaningful for it.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from _ranks import spawn_ranks
from _ref import ADAMW_OPTS, MUON_OPTS, SHAMPOO_SMALL_EPS, global_batch, local_batch, make_models, rel_err
from _tolerances import DDP_W3_LOSS_RTOL as LOSS_RTOL
from _tolerances import DDP_W3_PARAM_RTOL as PARAM_RTOL
from _tolerances import LOCKSTEP_RTOL
from matrix_owner_optim.comm import CommCounter
from matrix_owner_optim.optim import OwnerRoutedOptimizer
from matrix_owner_optim.preconditioners import Muon, Shampoo
from matrix_owner_optim.toolbox.profiling import backend_ops

pytestmark = pytest.mark.multirank

W = 3
STEPS = 8
KINDS = {"muon": (Muon, MUON_OPTS), "shampoo": (Shampoo, SHAMPOO_SMALL_EPS)}


def _reference_optimizers(model: torch.nn.Module, roles: dict[str, str], kind: str) -> list:
    cls, opts = KINDS[kind]
    params = dict(model.named_parameters())
    mats = [p for n, p in params.items() if roles[n] == "matrix"]
    rest = [p for n, p in params.items() if roles[n] != "matrix"]
    assert mats and rest
    return [cls(mats, **opts), torch.optim.AdamW(rest, **ADAMW_OPTS)]


def _run(rank: int, world_size: int, kind: str, mode: str) -> dict[str, Any]:
    model, whole = make_models(seed=17)
    lockstep = copy.deepcopy(model)
    ddp = DDP(model)
    _, opts = KINDS[kind]
    opt = OwnerRoutedOptimizer(
        ddp, matrix=kind, matrix_options=opts, tail="adamw", tail_options=ADAMW_OPTS, replicated=mode
    )
    roles = {r["name"].removeprefix("module."): r["role"] for r in opt.routes()}
    assert sorted(roles) == sorted(n for n, _ in lockstep.named_parameters())
    assert {r["layout"] for r in opt.routes()} == {"replicated"}
    lock_opts = _reference_optimizers(lockstep, roles, kind)
    whole_opts = _reference_optimizers(whole, roles, kind) if kind == "muon" else []
    params = dict(model.named_parameters())
    errs = {"param_lockstep": 0.0, **({"loss": 0.0, "param_whole": 0.0} if whole_opts else {})}
    ops_per_step = []
    for step in range(STEPS):
        loss = ddp(*local_batch(step, rank, world_size))
        loss.backward()
        for n, p in lockstep.named_parameters():  # the gradients DDP averaged, as they are
            p.grad = params[n].grad.detach().clone()
        with CommCounter() as cc, profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
        ops_per_step.append([op.name for op in backend_ops(prof)])
        want = {"owner": {"replicated_owner_all_to_all": 1}, "redundant": {}}[mode]
        assert cc.by_op("optimizer") == want, (kind, mode, step, cc.by_op("optimizer"))
        opt.zero_grad()
        for o in lock_opts:
            o.step()
            o.zero_grad()
        if whole_opts:
            ref_loss = whole(*global_batch(step, world_size))
            ref_loss.backward()
            for o in whole_opts:
                o.step()
                o.zero_grad()
            t = torch.tensor([loss.item()], dtype=torch.float64)
            torch.distributed.all_reduce(t)  # test bookkeeping, outside the counted step
            mean = float(t.item()) / world_size
            errs["loss"] = max(errs["loss"], abs(mean - ref_loss.item()) / abs(ref_loss.item()))
            assert abs(mean - ref_loss.item()) <= LOSS_RTOL * abs(ref_loss.item()), (kind, step)
    for name, p in lockstep.named_parameters():
        err = rel_err(params[name], p)
        errs["param_lockstep"] = max(errs["param_lockstep"], err)
        assert err <= LOCKSTEP_RTOL, (kind, mode, name, err)
    for name, p in whole.named_parameters() if whole_opts else []:
        err = rel_err(params[name], p)
        errs["param_whole"] = max(errs["param_whole"], err)
        assert err <= PARAM_RTOL, (kind, mode, name, err)
    return {"errors": errs, "ops": ops_per_step, "params": {n: p.detach().clone() for n, p in params.items()}}


def _job(rank: int, world_size: int) -> dict[str, Any]:
    return {(kind, mode): _run(rank, world_size, kind, mode) for kind in KINDS for mode in ("owner", "redundant")}


@functools.cache
def _results() -> list[dict[str, Any]]:
    return spawn_ranks(_job, W, threads_per_rank=1)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", ["owner", "redundant"])
def test_ddp_w3_matches_reference(kind: str, mode: str) -> None:
    results = [r[(kind, mode)] for r in _results()]
    first = results[0]["params"]
    for rank, res in enumerate(results):  # replicas bitwise identical
        assert all(torch.equal(res["params"][n], first[n]) for n in first), (kind, mode, rank)
        # the profiler sees every backend op of the step: one all_to_all per step, or none
        want = ["gloo:all_to_all"] if mode == "owner" else []
        assert res["ops"] == [want] * STEPS, (kind, mode, rank, res["ops"])
    worst = {k: max(r["errors"][k] for r in results) for k in results[0]["errors"]}
    print(f"\nDDP W={W} {kind} {mode}: worst relative errors over ranks", {k: f"{v:.3g}" for k, v in worst.items()})
