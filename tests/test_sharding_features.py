"""fully_shard features beyond the plain trajectory (gloo, grouped into one job per world size).

* mixed precision (bf16 params, fp32 reduce) equals a bf16-forward reference (measured: bitwise),
  gathers half the bytes; a bf16 reduction (the mutation to catch) is shown to fail the tolerance;
* 4 micro-batches with ``set_requires_gradient_sync(False)`` on the first 3 equal one 4x batch,
  without any reduce-scatter in the unsynced backwards; a synced backward without zero_grad
  accumulates into the existing sharded gradients;
* ``clip_grad_norm_`` returns the reference norm (2-, 1- and inf-norm) and clips identically;
* plan disagreement between ranks and a plan for another world size fail clearly, no hang;
* a 1D ``DeviceMesh``, a root-only call, and blocks without a root call (lazy sharding).

Each test prints the errors it measured (``-s``); the tolerances are set from them.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _ranks import spawn_ranks
from _ref import (
    assert_close,
    full_grad_rows,
    fully_shard_model,
    global_batch,
    local_batch,
    make_models,
    no_gradient_here,
    owner_optimizers,
    reference_optimizers,
    rel_err,
    roles_by_fqn,
)
from _tolerances import FEATURES_GRAD_RTOL as GRAD_RTOL
from _tolerances import FEATURES_NORM_RTOL as NORM_RTOL
from _tolerances import MIXED_PRECISION_RTOL as MP_RTOL
from matrix_owner_optim.comm import CommCounter
from matrix_owner_optim.planning import Role, get_matrix_shard, plan_model
from matrix_owner_optim.sharding import (
    MixedPrecisionPolicy,
    OwnerShardedModule,
    clip_grad_norm_,
    fully_shard,
)
from matrix_owner_optim.sharding.module import states_of, units_of
from matrix_owner_optim.tensors import local_tensor
from matrix_owner_optim.toolbox.profiling import backend_ops


def _compare_grads(model, ref, rank: int, rtol: float, what: str) -> float:
    """Every gradient this rank holds against the reference's rows; returns the worst error."""
    ref_params = dict(ref.named_parameters())
    worst = -1.0
    for name, p in model.named_parameters():
        shard = get_matrix_shard(p)
        if shard.role is not Role.ROWS and not shard.is_owned_by(rank):
            assert no_gradient_here(p), f"{what}: non-owner gradient on {name}"
            continue
        assert p.grad is not None and p.grad.dtype == p.dtype, f"{what}: {name}"
        want = full_grad_rows(shard, rank, ref_params[name].grad)
        assert_close(p.grad, want, rtol, f"{what} {name}")
        worst = max(worst, rel_err(p.grad, want))
    assert worst >= 0, f"{what}: rank {rank} holds no gradient"
    return worst


# -- mixed precision ---------------------------------------------------------------------------
# The reference below reproduces the runtime's order exactly (bf16 micro-batch gradients cast to
# fp32, summed from zero in rank order, divided by W); MP_RTOL's measured floor: tests/_tolerances.py.
def _grad_errors(model, ref, rank: int) -> dict[str, float]:
    """Relative error of every gradient this rank holds against the reference's rows."""
    ref_params = dict(ref.named_parameters())
    errs = {}
    for name, p in model.named_parameters():
        shard = get_matrix_shard(p)
        if shard.role is not Role.ROWS and not shard.is_owned_by(rank):
            assert no_gradient_here(p), f"non-owner gradient on {name}"
            continue
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        errs[name] = rel_err(p.grad, full_grad_rows(shard, rank, ref_params[name].grad))
    return errs


def _bf16_grads(model, step: int, W: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's bf16 gradients: the forward on bf16 copies of ``model``'s fp32 weights."""
    out = []
    for r in range(W):
        low = copy.deepcopy(model).to(torch.bfloat16)
        low(*local_batch(step, r, W)).backward()
        out.append({n: p.grad for n, p in low.named_parameters()})
    return out


def _mixed_precision(rank: int, W: int) -> dict:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, ref = make_models(seed=3)
    fully_shard_model(model, mp_policy=mp)
    opts = owner_optimizers(model, "muon")
    roles = roles_by_fqn(model)
    ref_opts = reference_optimizers(ref, roles, "muon")
    # the mutation the tolerances must reject: the same training with a bf16 reduction
    mutant = copy.deepcopy(ref)
    mutant_opts = reference_optimizers(mutant, roles, "muon")
    plan = model.sharding_plan
    expected_recv = sum((s.numel - s.local_numel(rank)) * 2 for s in plan)  # bf16 on the wire
    grad_worst, mutant_grad_best = 0.0, math.inf
    for step in range(5):
        with CommCounter() as cc:
            loss = model(*local_batch(step, rank, W))
            assert loss.dtype == torch.bfloat16
            loss.backward()
        assert cc.bytes("forward", "received") == expected_recv
        for p in model.parameters():  # sharded params and their grads stay fp32
            assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
        for unit in units_of(model):  # owner low-precision buffers are released after backward
            for h in unit.handles:
                assert h.unsharded.dtype == torch.bfloat16
                assert h.aliases_resident or h.unsharded.untyped_storage().size() == 0
        # reference: bf16 gradients cast to fp32, summed in rank order, averaged (reduce fp32)
        low = _bf16_grads(ref, step, W)
        for n, p in ref.named_parameters():
            total = torch.zeros_like(p)
            for g in low:
                total += g[n].float()
            p.grad = total / W
        errs = _grad_errors(model, ref, rank)
        worst_name = max(errs, key=errs.__getitem__)
        assert errs[worst_name] <= MP_RTOL, (step, worst_name, errs[worst_name])
        grad_worst = max(grad_worst, *errs.values())
        # a bf16 reduction of the same gradients: far outside the tolerance at every step
        bf16_sum = _bf16_sum(low)
        mutant_err = max(rel_err((bf16_sum[n] / W).float(), p.grad) for n, p in ref.named_parameters())
        assert mutant_err > 100 * MP_RTOL, (step, mutant_err)
        mutant_grad_best = min(mutant_grad_best, mutant_err)
        for n, g in _bf16_sum(_bf16_grads(mutant, step, W)).items():  # the mutant's own run
            mutant.get_parameter(n).grad = (g / W).float()
        for o in opts + ref_opts + mutant_opts:
            o.step()
            o.zero_grad()
        model.zero_grad(set_to_none=True)  # non-owners' empty gradient pieces too
    ref_params = dict(ref.named_parameters())
    mutant_params = dict(mutant.named_parameters())
    master_worst = mutant_master = 0.0
    for name, p in model.named_parameters():  # the fp32 master tensors this rank holds
        if local_tensor(p).numel():
            shard = get_matrix_shard(p)
            want = full_grad_rows(shard, rank, ref_params[name].detach())
            master_worst = max(master_worst, rel_err(p, want))
    for name, p in ref_params.items():
        mutant_master = max(mutant_master, rel_err(mutant_params[name], p))
    assert master_worst <= MP_RTOL, master_worst
    assert mutant_master > 10 * MP_RTOL, mutant_master  # the bf16-reduction run is rejected
    model.unshard()
    compute_worst = 0.0
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16  # the unsharded compute tensors
        compute_worst = max(compute_worst, rel_err(p, ref_params[name].to(torch.bfloat16)))
    assert compute_worst <= MP_RTOL, compute_worst
    model.reshard()
    return {
        "mp_grad_worst": grad_worst,
        "mp_master_worst": master_worst,
        "mp_compute_worst": compute_worst,
        "mp_mutant_grad": mutant_grad_best,
        "mp_mutant_master": mutant_master,
    }


def _bf16_sum(grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mutation: bf16 gradients summed in bf16, in rank order."""
    out = {}
    for n in grads[0]:
        total = torch.zeros_like(grads[0][n])
        for g in grads:
            total += g[n]
        out[n] = total
    return out


# -- gradient accumulation and clipping --------------------------------------------------------
def _accumulation_and_clip(rank: int, W: int) -> dict:
    mesh = init_device_mesh("cpu", (W,))
    model, ref = make_models(seed=5)
    fully_shard_model(model, mesh=mesh)
    n_units = len(model.layers) + 1
    errs = {}
    for k in range(4):
        model.set_requires_gradient_sync(k == 3)  # on the root: propagates to every block unit
        states = states_of(model, recurse=True)  # a setter records options, it needs no plan
        assert len(states) == n_units and all(st.options.requires_gradient_sync == (k == 3) for st in states)
        with CommCounter() as cc:
            (model(*local_batch(100 + k, rank, W)) / 4).backward()
        reduces = cc.by_op("backward").get("reduce_scatter_v", 0)
        assert reduces == (n_units if k == 3 else 0), (k, cc.by_op("backward"))
        if k < 3:
            assert all(p.grad is None for p in model.parameters())
        (ref(*global_batch(100 + k, W)) / 4).backward()
    errs["accumulated"] = _compare_grads(model, ref, rank, GRAD_RTOL, "accumulated")

    # a synced backward without zero_grad adds to the sharded gradients already there
    model(*local_batch(200, rank, W)).backward()
    ref(*global_batch(200, W)).backward()
    errs["accumulated_into_grad"] = _compare_grads(model, ref, rank, GRAD_RTOL, "into .grad")

    # inf-norm (no clipping), the 1-norm with clipping, then the 2-norm with clipping
    inf_norm = clip_grad_norm_(model.parameters(), max_norm=1e9, norm_type=math.inf)
    ref_inf = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1e9, norm_type=math.inf)
    errs["inf_norm"] = rel_err(inf_norm, ref_inf)
    ref_one = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], 1.0))
    one_norm = clip_grad_norm_(model.parameters(), max_norm=ref_one / 2, norm_type=1)
    ref_one_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), ref_one / 2, norm_type=1)
    errs["one_norm"] = rel_err(one_norm, ref_one_norm)
    errs["clipped_1"] = _compare_grads(model, ref, rank, GRAD_RTOL, "clipped (1-norm)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        norm = clip_grad_norm_(model.parameters(), max_norm=0.05)
    ops = [op.name for op in backend_ops(prof)]
    # torch's clip on the owner-layout DTensors: one all-reduce of the stacked partial norms
    assert len(ops) == 1 and "allreduce" in ops[0].replace("_", "").lower(), ops
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.05)
    assert float(ref_norm) > 0.05  # the clip really scales
    errs["two_norm"] = rel_err(norm, ref_norm)
    errs["clipped_2"] = _compare_grads(model, ref, rank, GRAD_RTOL, "clipped (2-norm)")
    for key in ("inf_norm", "one_norm", "two_norm"):
        assert errs[key] <= NORM_RTOL, (key, errs[key])
    return {"norm": float(norm), "ref_norm": float(ref_norm), "accumulation_errors": errs}


# -- bad input ---------------------------------------------------------------------------------
def _plan_errors(rank: int, W: int) -> dict:
    fresh, _ = make_models()
    # a plan for another world size: clear error before anything moves
    model, _ = make_models()
    with pytest.raises(ValueError, match=rf"world size {W + 1}.*{W} ranks"):
        fully_shard(model, plan=plan_model(fresh, W + 1))
    # ranks holding different plans: every rank raises, naming the first differing parameter
    roles = {"wte.weight": "tail"} if rank == 1 else None  # wte is the first parameter
    plan = plan_model(fresh, W, roles=roles)
    model, _ = make_models()
    fully_shard_model(model, root_options={"plan": plan})  # sharding is lazy: the plan is checked when it is fixed
    want = r"disagree.*parameter 'wte\.weight' differs \(role: 'rows' vs 'tail'"
    with pytest.raises(ValueError, match=want) as info:
        model(*local_batch(0, rank, W))  # before any data moves
    with pytest.raises(RuntimeError, match="failed earlier"):
        model.fix_plan()
    # a plan that does not describe the model
    other = plan_model(torch.nn.Linear(4, 4), W)
    model, _ = make_models()
    fully_shard(model, plan=other)
    with pytest.raises(ValueError, match="does not cover parameter 'wte.weight'"):
        model.fix_plan()
    # the same valid plan on every rank is accepted (units follow the fully_shard calls)
    model, ref = make_models()
    fully_shard_model(model, plan=plan_model(fresh, W))
    assert {s.unit for s in model.fix_plan()} == {0}  # the given plan, kept as given...
    units = {get_matrix_shard(p).unit for p in model.parameters()}
    assert units == set(range(len(model.layers) + 1))  # ...attached with this model's units
    model(*local_batch(0, rank, W)).backward()
    ref(*global_batch(0, W)).backward()
    _compare_grads(model, ref, rank, GRAD_RTOL, "given plan")
    return {"mismatch_error": str(info.value)}


def _layouts(rank: int, W: int) -> dict:
    # root-only call: one unit, sharded when the plan is fixed (reading metadata does not fix it)
    model, ref = make_models(seed=7)
    fully_shard(model, reshard_after_forward=False)
    assert isinstance(model, OwnerShardedModule) and type(model).__name__ == "OwnerShardedGPT"
    assert all(p.numel() == q.numel() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert all(get_matrix_shard(p) is None for p in model.parameters())  # pending
    with pytest.raises(RuntimeError, match="not fixed yet"):
        _ = model.sharding_plan  # a getter: it never fixes the plan
    model.fix_plan()
    assert all(get_matrix_shard(p) is not None for p in model.parameters())
    assert {get_matrix_shard(p).unit for p in model.parameters()} == {0}
    with CommCounter() as cc:
        model(*local_batch(0, rank, W)).backward()
    assert cc.by_op("forward") == {"all_gather_v": 1}
    assert cc.by_op("backward") == {"reduce_scatter_v": 1}
    ref(*global_batch(0, W)).backward()
    _compare_grads(model, ref, rank, GRAD_RTOL, "root only")
    handle = model.unshard(async_op=True)
    handle.wait()
    assert all(p.shape == q.shape for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    model.reshard()

    # blocks without a root call: pending until the first forward; each block is its own
    # tree (FSDP2: a module with no enclosing fully_shard is a root), planned on its own
    model, _ = make_models(seed=7)
    fully_shard_model(model, root=False)
    assert all(get_matrix_shard(p) is None for p in model.parameters())
    model(*local_batch(0, rank, W)).backward()
    for block in model.layers:
        params = list(block.parameters())
        assert all(get_matrix_shard(p) is not None for p in params)
        owners = {get_matrix_shard(p).owner for p in params if get_matrix_shard(p).role is Role.MATRIX}
        assert len(owners) == min(W, 4)  # a block's four matrices balanced over the ranks
    assert len({id(b.sharding_plan) for b in model.layers}) == len(model.layers)  # one plan per tree
    assert get_matrix_shard(model.wte.weight) is None  # outside every unit: untouched
    # a root call adopts the blocks called before it: one tree, one plan over both blocks
    model, _ = make_models(seed=7)
    fully_shard_model(model)
    model.layers[0].fix_plan()  # any module of the tree fixes the whole tree
    assert all(get_matrix_shard(p) is not None for p in model.parameters())
    assert model.layers[1].sharding_plan is model.sharding_plan
    matrices = [p for p in model.parameters() if get_matrix_shard(p).role is Role.MATRIX]
    assert len({get_matrix_shard(p).owner for p in matrices}) == min(W, 8)  # balanced across blocks
    with pytest.raises(ValueError, match="already"):
        fully_shard(model.layers[0])
    return {}


def _job(rank: int, W: int) -> dict:
    out = {}
    out.update(_plan_errors(rank, W))
    out.update(_layouts(rank, W))
    out.update(_accumulation_and_clip(rank, W))
    out.update(_mixed_precision(rank, W))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharding_features(world_size: int) -> None:
    results = spawn_ranks(_job, world_size, threads_per_rank=1)
    for res in results:
        assert "'wte.weight'" in res["mismatch_error"]
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=NORM_RTOL)
    print(f"\nW={world_size} measured relative errors, worst over ranks:")
    for key in ("mp_grad_worst", "mp_master_worst", "mp_compute_worst", "mp_mutant_grad", "mp_mutant_master"):
        fn = min if "mutant" in key else max
        print(f"  {key}: {fn(r[key] for r in results):.3g}")
    for key in results[0]["accumulation_errors"]:
        print(f"  {key}: {max(r['accumulation_errors'][key] for r in results):.3g}")


def test_clip_grad_norm_plain_tensors_matches_torch() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    for norm_type in (2.0, math.inf, 1.0):
        ours = clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(twins, max_norm=0.5, norm_type=norm_type)
        assert torch.equal(ours, theirs)
        for p, q in zip(params, twins, strict=True):
            assert torch.equal(p.grad, q.grad)


def test_fully_shard_needs_a_process_group() -> None:
    model, _ = make_models()
    with pytest.raises(RuntimeError, match="process group"):
        fully_shard(model)
