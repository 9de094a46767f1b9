"""fully_shard options and optimizer calls no other test exercises, each against the reference.

One spawned gloo job per world size (2 and 3) runs every scenario on every rank; each compares
with the single-process reference (same optimizer on the unsharded model; the global batch, or
the rank-order sum of bf16 micro-batch gradients for mixed precision):

* ``reshard_after_forward=False`` on the blocks: kept between forward and backward (storage
  allocated, no all-gather in backward); ``set_reshard_after_forward(True)`` on the root turns
  the backward re-gather back on for every block, ``(False)`` on one block for that block only;
  the plan comes from ``fully_shard(plan=plan_model(model, W, roles=...))`` and its roles reach
  the parameters and the optimizers;
* ``MixedPrecisionPolicy``: ``cast_forward_inputs`` True / False (what the forward receives)
  and ``output_dtype`` (what a unit returns), gradients equal to the bf16 reference;
* a float16 ``reduce_dtype`` with gradients scaled so that a plain float16 sum over ranks would
  overflow: the division is split around the sum as FSDP2 splits it (W=2: 2 before; W=3: 2
  before, 1.5 after), the owners' gradients are finite and bitwise that computation, and within
  1e-3 of the float32 average (measured 2.4e-4 / 3.7e-4); ``set_gradient_divide_factor(1.0)``
  on every unit gives the plain sum over ranks, bitwise;
* ``OwnerRoutedOptimizer`` with ``add_param_group`` (a second group at half the learning rate)
  and ``step(closure)`` (the closure clips with ``clip_grad_norm_``, 2-, 1- and inf-norm), on
  the owner layout sharded over ``mesh=`` a ``ProcessGroup`` and on stock FSDP2; on the owner
  layout the profiler shows no backend op in ``step`` outside the closure.

Each test prints the worst errors it measured; the tolerances below are set from them.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from _ranks import spawn_ranks
from _ref import (
    ADAMW_OPTS,
    MUON_OPTS,
    assert_close,
    full_grad_rows,
    fully_shard_model,
    global_batch,
    local_batch,
    make_models,
    mean_over_ranks,
    no_gradient_here,
    owner_optimizers,
    reference_optimizers,
    rel_err,
    roles_by_fqn,
)
from _tolerances import MIXED_PRECISION_RTOL as BF16_RTOL
from _tolerances import OPTIONS_FP16_RTOL as FP16_RTOL
from _tolerances import OPTIONS_GRAD_RTOL as GRAD_RTOL
from _tolerances import OPTIONS_LOSS_RTOL as LOSS_RTOL
from _tolerances import OPTIONS_NORM_RTOL as NORM_RTOL
from _tolerances import OPTIONS_PARAM_RTOL as PARAM_RTOL
from matrix_owner_optim.comm import CommCounter
from matrix_owner_optim.optim import OwnerRoutedOptimizer
from matrix_owner_optim.planning import (
    Role,
    get_matrix_shard,
    get_shard_rank,
    plan_model,
)
from matrix_owner_optim.preconditioners import Muon
from matrix_owner_optim.sharding import (
    MixedPrecisionPolicy,
    clip_grad_norm_,
)
from matrix_owner_optim.sharding.module import context_of, units_of
from matrix_owner_optim.tensors import local_tensor
from matrix_owner_optim.toolbox.profiling import backend_ops, phase_windows

pytestmark = pytest.mark.multirank

HALF_LR = ADAMW_OPTS["lr"] / 2
ROLES = {"layers.0.attn.qkv.weight": "tail", "layers.*.mlp.fc.weight": "rows", "wpe.weight": "matrix"}


def _worst(errs: dict[str, float], key: str, value: float) -> None:
    errs[key] = max(errs.get(key, 0.0), value)


def _owner_grads(
    model: nn.Module, ref: nn.Module, errs: dict[str, float], what: str, rtol: float = GRAD_RTOL, key: str = "grad"
) -> None:
    """Every gradient this rank holds on the owner layout against the reference's rows."""
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        shard, rank = get_matrix_shard(p), get_shard_rank(p)
        want = ref_params[name].grad
        if shard.role is not Role.ROWS and not shard.is_owned_by(rank):
            assert no_gradient_here(p), f"{what}: non-owner gradient on {name}"
            continue
        assert p.grad is not None and want is not None, f"{what}: {name}"
        want = full_grad_rows(shard, rank, want)
        assert_close(p.grad, want, rtol, f"{what}: gradient {name}")
        _worst(errs, key, rel_err(p.grad, want))
        checked += 1
    assert checked, f"{what}: this rank holds no gradient"


def _owner_params(model: nn.Module, ref: nn.Module, errs: dict[str, float], what: str) -> None:
    """Full parameters (``unshard()``) on this rank against the reference."""
    ref_params = dict(ref.named_parameters())
    model.unshard()
    try:
        for name, p in model.named_parameters():
            assert_close(p, ref_params[name], PARAM_RTOL, f"{what}: {name}")
            _worst(errs, "param", rel_err(p, ref_params[name]))
    finally:
        model.reshard()


def _check_loss(loss: torch.Tensor, ref_loss: float, errs: dict[str, float], what: str) -> None:
    mean = mean_over_ranks(loss.item())
    assert abs(mean - ref_loss) <= LOSS_RTOL * abs(ref_loss), f"{what}: loss {mean} vs {ref_loss}"
    _worst(errs, "loss", abs(mean - ref_loss) / abs(ref_loss))


# -- reshard_after_forward, set_reshard_after_forward, roles through plan= ----------------------
def _kept(unit) -> bool:
    """True when every non-aliased unsharded tensor of ``unit`` holds storage."""
    held = [h.unsharded.untyped_storage().size() > 0 for h in unit.handles if not h.aliases_resident]
    assert held, f"unit {unit.index} has no non-owned tensor to check"
    return all(held)


def _reshard_and_roles(rank: int, W: int, errs: dict[str, float]) -> None:
    model, ref = make_models(seed=11)
    fresh, _ = make_models(seed=11)
    plan = plan_model(fresh, W, roles=ROLES)
    fully_shard_model(model, block_options={"reshard_after_forward": False}, root_options={"plan": plan})
    roles = roles_by_fqn(model)
    assert roles["layers.0.attn.qkv.weight"] is Role.TAIL and roles["wpe.weight"] is Role.MATRIX
    assert all(roles[f"layers.{i}.mlp.fc.weight"] is Role.ROWS for i in range(len(model.layers)))
    assert roles["layers.1.attn.qkv.weight"] is Role.MATRIX  # untouched by the overrides
    opts = owner_optimizers(model, "muon")  # routes by the roles the plan gave
    ref_opts = reference_optimizers(ref, roles, "muon")
    blocks = units_of(model)[:-1]
    # (setting before the step, backward all-gathers expected, which blocks stay gathered)
    schedule = [
        (lambda: None, 0, [True, True]),
        (lambda: None, 0, [True, True]),
        (lambda: model.set_reshard_after_forward(True), len(blocks), [False, False]),
        (lambda: model.layers[1].set_reshard_after_forward(False), 1, [False, True]),
    ]
    for step, (setting, backward_gathers, kept) in enumerate(schedule):
        setting()
        what = f"reshard step {step}"
        with CommCounter() as cc:
            loss = model(*local_batch(step, rank, W))
            assert [_kept(u) for u in blocks] == kept, (what, [_kept(u) for u in blocks])
            loss.backward()
        assert cc.by_op("forward") == {"all_gather_v": len(blocks) + 1}, (what, cc.by_op("forward"))
        gathers = cc.by_op("backward").get("all_gather_v", 0)
        assert gathers == backward_gathers, (what, cc.by_op("backward"))
        assert not any(_kept(u) for u in blocks), f"{what}: gathered data left after backward"
        ref_loss = ref(*global_batch(step, W))
        ref_loss.backward()
        _check_loss(loss, ref_loss.item(), errs, what)
        _owner_grads(model, ref, errs, what)
        for o in opts + ref_opts:
            o.step()
            o.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)  # non-owners' empty gradient pieces too
    _owner_params(model, ref, errs, "reshard")


# -- MixedPrecisionPolicy: output_dtype, cast_forward_inputs ------------------------------------
class FloatBlock(nn.Module):
    """Records the dtype its forward receives; computes in its weight's dtype."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return torch.tanh(self.lin(x.to(self.lin.weight.dtype)))


class FloatNet(nn.Module):
    """A float-input model (token ids would not show ``cast_forward_inputs``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.layers = nn.ModuleList([FloatBlock(16), FloatBlock(16)])
        self.out = nn.Linear(16, 3)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        h = torch.tanh(self.inp(x.to(self.inp.weight.dtype)))
        for block in self.layers:
            h = block(h)
        return F.mse_loss(self.out(h.to(self.out.weight.dtype)).float(), y)


def _float_batch(step: int, rank: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(2 * W, 4, 6, generator=g), torch.randn(2 * W, 4, 3, generator=g)
    return x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]


def _mixed_precision_options(rank: int, W: int, errs: dict[str, float]) -> None:
    bf16, f32 = torch.bfloat16, torch.float32
    cases = [  # (policy, dtype the blocks receive, the root receives, a block returns)
        (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32, output_dtype=f32), bf16, bf16, f32),
        (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32, cast_forward_inputs=False), bf16, f32, bf16),
    ]
    for case, (policy, block_in, root_in, block_out) in enumerate(cases):
        torch.manual_seed(21)
        model = FloatNet()
        ref = copy.deepcopy(model)
        fully_shard_model(model, mp_policy=policy)
        outs: list[torch.dtype] = []
        for block in model.layers:  # after fully_shard's hook: sees what the unit returns
            block.register_forward_hook(lambda m, a, out, outs=outs: outs.append(out.dtype))
        opts = [torch.optim.AdamW(model.parameters(), **ADAMW_OPTS)]
        ref_opts = [torch.optim.AdamW(ref.parameters(), **ADAMW_OPTS)]
        for step in range(2):
            what = f"mixed precision case {case} step {step}"
            loss = model(*_float_batch(step, rank, W))
            assert loss.dtype == f32, what
            loss.backward()
            assert model.seen[-1] == root_in, (what, model.seen)
            seen = [b.seen[-1] for b in model.layers]
            assert seen == [block_in] * len(seen), (what, seen)
            assert outs[-2:] == [block_out, block_out], (what, outs)
            # reference: bf16 copies on each rank's batch (inputs and targets cast as the root
            # casts them), gradients summed in fp32 in rank order
            total = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
            for r in range(W):
                low = copy.deepcopy(ref).to(bf16)
                low(*(t.to(root_in) for t in _float_batch(step, r, W))).backward()
                for n, p in low.named_parameters():
                    total[n] += p.grad.float()
            for n, p in ref.named_parameters():
                p.grad = total[n] / W
            _owner_grads(model, ref, errs, what, rtol=BF16_RTOL, key="bf16_grad")
            for o in opts + ref_opts:
                o.step()
                o.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)  # non-owners' empty gradient pieces too


# -- float16 reduction: the division split around the sum; set_gradient_divide_factor ----------
def _expected_reduction(
    grads: list[dict[str, torch.Tensor]], name: str, dtype: torch.dtype, pre: float, post: float
) -> torch.Tensor:
    """What the reduction computes from every rank's gradient: cast to ``dtype``, divided by
    ``pre``, summed in rank order, divided by ``post``, back to float32."""
    total = None
    for g in grads:
        part = g[name].to(dtype).div_(pre)
        total = part.clone() if total is None else total.add_(part)
    assert total is not None
    return total.div_(post).float()


def _gradient_division(rank: int, W: int, errs: dict[str, float]) -> None:
    f16 = torch.float16
    fp16_max = torch.finfo(f16).max
    # (policy, divide factor set on every unit, float16?)
    cases = [(MixedPrecisionPolicy(reduce_dtype=f16), None, True), (MixedPrecisionPolicy(), 1.0, False)]
    for case, (policy, factor, half) in enumerate(cases):
        what = f"gradient division case {case}"
        torch.manual_seed(23)
        model = FloatNet()
        ref = copy.deepcopy(model)

        # every rank on the same batch: aligned gradients, whose sum is the one that overflows
        # (on different batches the largest coordinates can cancel, and nothing is shown)
        batch = _float_batch(0, 0, W)

        def rank_grads(scale: float, ref: torch.nn.Module = ref, batch: tuple = batch) -> list[dict[str, torch.Tensor]]:
            out = []
            for _ in range(W):
                local = copy.deepcopy(ref)
                (local(*batch) * scale).backward()
                out.append({n: p.grad for n, p in local.named_parameters()})
            return out

        # float16: scale the loss as far as the split division allows (every rank's gradient
        # and every partial sum divided by ``pre`` within float16's range, 5% margin); the sum
        # without the division before it overflows (checked below)
        pre, post = {2: (2.0, 1.0), 3: (2.0, 1.5)}[W] if half else (1.0, 1.0)
        unscaled = rank_grads(1.0)
        bound = 0.0
        for n in unscaled[0]:
            partial = torch.zeros_like(unscaled[0][n])
            for g in unscaled:
                partial = partial + g[n]
                bound = max(bound, float(g[n].abs().max()), float(partial.abs().max()) / pre)
        scale = 0.95 * fp16_max / bound if half else 1.0
        grads = rank_grads(scale)
        fully_shard_model(model, mp_policy=policy)
        if factor is not None:
            for m in [*model.layers, model]:
                m.set_gradient_divide_factor(factor)
        (model(*batch) * scale).backward()
        if half:  # (pre, post) above: FSDP2's factors for W=2, 3; factor 1: the plain sum
            naive = [_expected_reduction(grads, n, f16, 1.0, float(W)) for n in grads[0]]
            assert not all(torch.isfinite(t).all() for t in naive), f"{what}: no overflow to avoid"
        checked = 0
        for name, p in model.named_parameters():
            shard = get_matrix_shard(p)
            if not shard.is_owned_by(get_shard_rank(p)):
                assert no_gradient_here(p), f"{what}: non-owner gradient on {name}"
                continue
            want = _expected_reduction(grads, name, f16 if half else torch.float32, pre, post)
            # the owner reads its own piece (the whole gradient): a value read of the DTensor is a
            # collective every rank takes part in, and only the owner is here
            grad = local_tensor(p.grad)
            assert torch.isfinite(grad).all(), f"{what}: {name} overflowed"
            assert torch.equal(grad, want), f"{what}: {name} is not the expected reduction"
            mean = sum(g[name] for g in grads) / (W if half else 1)
            _worst(errs, "fp16_grad" if half else "sum_grad", rel_err(grad, mean))
            if half:
                assert rel_err(grad, mean) <= FP16_RTOL, (what, name, rel_err(grad, mean))
            checked += 1
        assert checked or rank == W - 1, f"{what}: rank {rank} owns nothing"


# -- add_param_group, step(closure), mesh=ProcessGroup, and stock FSDP2 -------------------------
def _groups(named: list[tuple[str, torch.Tensor]]) -> tuple[list, list]:
    """Group A: the blocks; group B (added later, half the learning rate): the rest."""
    a = [(n, p) for n, p in named if n.startswith("layers.")]
    b = [(n, p) for n, p in named if not n.startswith("layers.")]
    assert a and b
    return a, b


def _reference_for(opt: OwnerRoutedOptimizer, ref: nn.Module) -> list[torch.optim.Optimizer]:
    """Plain Muon / AdamW on the unsharded model with the routed optimizer's roles and groups:
    group A at each optimizer's own lr, group B at ``HALF_LR`` for both."""
    params = dict(ref.named_parameters())
    role = {r["name"]: r["role"] for r in opt.routes()}
    assert role.keys() == params.keys()
    a, b = _groups(list(params.items()))
    mats, rest = [], []
    for names, lr in ((a, None), (b, HALF_LR)):
        for role_is_matrix, out in ((True, mats), (False, rest)):
            group = [p for n, p in names if (role[n] == "matrix") == role_is_matrix]
            if group:
                out.append({"params": group} if lr is None else {"params": group, "lr": lr})
    return [Muon(mats, **MUON_OPTS), torch.optim.AdamW(rest, **ADAMW_OPTS)]


def _closure_run(rank: int, W: int, layout: str, errs: dict[str, float]) -> None:
    model, ref = make_models(seed=13)
    if layout == "owner":
        group = dist.new_group(list(range(W)))  # a ProcessGroup as the mesh
        fully_shard_model(model, mesh=group)
        model.fix_plan()
        assert context_of(model).groups.group is group and model.sharding_plan.world_size == W
    else:
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard_model(model, stock=True, mesh=init_device_mesh("cpu", (W,)))
    a, b = _groups(list(model.named_parameters()))
    opt = OwnerRoutedOptimizer(a, matrix="muon", matrix_options=MUON_OPTS, tail="adamw", tail_options=ADAMW_OPTS)
    n_groups = len(opt.param_groups)  # a plain list is split into one group per tensor role
    opt.add_param_group({"params": b, "lr": HALF_LR})  # the lr of group B: its tail and rows tensors
    added = opt.param_groups[n_groups:]
    assert [(g["role"], g["optimizer"]) for g in added] == [("tail", "tail"), ("rows", "tail")]
    assert all(g["lr"] == HALF_LR for g in added)
    ref_opts = _reference_for(opt, ref)
    norm_types = [2.0, 1.0, math.inf]
    for step in range(3):
        what = f"{layout} closure step {step}"
        norm_type = norm_types[step % 3]
        clip: dict[str, torch.Tensor] = {}

        def closure(
            step: int = step, norm_type: float = norm_type, clip: dict[str, torch.Tensor] = clip
        ) -> torch.Tensor:
            with record_function("phase:closure"):
                opt.zero_grad()
                loss = model(*local_batch(step, rank, W))
                loss.backward()
                clip["norm"] = clip_grad_norm_(model.parameters(), 0.02, norm_type=norm_type)
            return loss

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = opt.step(closure)
        ref_loss = ref(*global_batch(step, W))
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.02, norm_type=norm_type)
        assert float(ref_norm) > 0.02, what  # the clip really scales
        assert rel_err(clip["norm"], ref_norm) <= NORM_RTOL, (what, clip["norm"], ref_norm)
        _worst(errs, "norm", rel_err(clip["norm"], ref_norm))
        if layout == "owner":  # every backend op of the step lies inside the closure
            windows = phase_windows(prof)["closure"]
            assert len(windows) == 1, windows
            inside = backend_ops(prof, windows[0])
            outside = [op.name for op in backend_ops(prof) if op not in inside]
            assert outside == [] and inside, (what, outside)
            _owner_grads(model, ref, errs, what)
        else:
            ref_params = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                full = p.grad.full_tensor()
                assert_close(full, ref_params[name].grad, GRAD_RTOL, f"{what}: gradient {name}")
                _worst(errs, "grad", rel_err(full, ref_params[name].grad))
        _check_loss(loss, ref_loss.item(), errs, what)
        for o in ref_opts:
            o.step()
            o.zero_grad(set_to_none=True)
    if layout == "owner":
        _owner_params(model, ref, errs, what)
    else:
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            full = p.full_tensor()
            assert_close(full, ref_params[name], PARAM_RTOL, f"{what}: {name}")
            _worst(errs, "param", rel_err(full, ref_params[name]))


def _job(rank: int, W: int) -> dict[str, Any]:
    errs: dict[str, float] = {}
    _reshard_and_roles(rank, W, errs)
    _mixed_precision_options(rank, W, errs)
    _gradient_division(rank, W, errs)
    _closure_run(rank, W, "owner", errs)
    _closure_run(rank, W, "stock", errs)
    return errs


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharding_options(world_size: int) -> None:
    results = spawn_ranks(_job, world_size, threads_per_rank=1)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print(f"\nW={world_size} worst relative errors over ranks:", {k: f"{v:.3g}" for k, v in worst.items()})
