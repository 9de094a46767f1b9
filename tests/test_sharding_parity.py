"""FSDP2 parity of the owner-shaped runtime (gloo; one spawned job per world size).

Every scenario trains a tiny GPT for a few steps against the single-process reference (same
optimizer, unsharded model, global batch). On every rank (every replica with HSDP) each step's
loss (1e-6), every gradient the rank holds (1e-5) and the final parameters (1e-5) must agree;
every optimizer step runs under ``torch.profiler`` and must show no backend collective. It checks:

* frozen parameters (a frozen block before ``fully_shard``, a LayerNorm frozen after it): no
  gradient anywhere, never reduced (reduce-scatter bytes shrink by exactly their size), every
  rank issues the same collectives;
* unused parameters (a block skipped on odd steps, a Linear never used): no hang, ``grad``
  None on every rank, as in the reference (AdamW skips them there too);
* activation checkpointing (``torch.utils.checkpoint`` inside the block forward, and
  ``checkpoint_wrapper``): the recomputation sees the gathered parameters, same collectives
  and bytes as without checkpointing;
* prefetch: the next unit's all-gather-v is issued by the previous unit's hook (forward and
  backward; explicit ``set_modules_to_forward_prefetch`` too), with the same calls and bytes
  per phase as without prefetch;
* HSDP on a (2, 2) mesh at W=4: owner-shaped in the shard dim, one global owner per matrix
  (its gradient reduced across replicas to it alone, the rest all-reduced; averaged over all 4
  ranks: averaging over the shard group only is shown to fail the gradient check);
  ``clip_grad_norm_`` (2- and 1-norm) equals the reference's; ``optimizer.step()`` of plain torch
  optimizers moves nothing, the updated matrices cross the replicas at the next forward;
* HSDP with ``OwnerRoutedOptimizer`` at (2, 2) and (2, 3) (W=4, W=6): parameters equal one
  process after every step, every matrix's optimizer state on exactly one rank, the
  Newton-Schulz calls and FLOPs summed over the ranks equal one process's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from _ranks import spawn_ranks
from _ref import (
    ADAMW_OPTS,
    CFG4,
    MUON_OPTS,
    assert_close,
    full_grad_rows,
    fully_shard_model,
    global_batch,
    local_batch,
    mean_over_ranks,
    no_gradient_here,
    optimizer_in_backward,
    owner_optimizers,
    reference_optimizers,
    rel_err,
    roles_by_fqn,
    state_bytes,
)
from _tolerances import HSDP_FP16_PARAM_RTOL, HSDP_W6_PARAM_RTOL
from _tolerances import PARITY_GRAD_RTOL as GRAD_RTOL
from _tolerances import PARITY_LOSS_RTOL as LOSS_RTOL
from _tolerances import PARITY_NORM_RTOL as NORM_RTOL
from _tolerances import PARITY_PARAM_RTOL as PARAM_RTOL
from matrix_owner_optim.comm import CommCounter, comm_phase
from matrix_owner_optim.optim import OwnerRoutedOptimizer
from matrix_owner_optim.planning import MUON_COST, Role, get_matrix_shard, get_shard_rank, plan_model
from matrix_owner_optim.preconditioners import Muon
from matrix_owner_optim.replica_sync import replicas_of, steps_here
from matrix_owner_optim.sharding import MixedPrecisionPolicy, clip_grad_norm_
from matrix_owner_optim.sharding.module import context_of, units_of
from matrix_owner_optim.tensors import local_tensor
from matrix_owner_optim.toolbox.models.gpt import GPT, Block, GPTConfig
from matrix_owner_optim.toolbox.profiling import backend_ops

pytestmark = pytest.mark.multirank

CFG = CFG4
STEPS = 4
F32 = 4
_WRAPPED = "._checkpoint_wrapped_module"
_MEASURED: dict[str, float] = {}  # worst relative error of each kind in this process


class BranchGPT(GPT):
    """GPT with an unused Linear and blocks that can be skipped (the same on every rank)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.unused = nn.Linear(cfg.d_model, cfg.d_model)
        self.skip: set[int] = set()

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for i, block in enumerate(self.layers):
            if i not in self.skip:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class CkptBlock(Block):
    """A block that checkpoints its own forward (non-reentrant)."""

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


def _models(seed: int = 0, cls=GPT):
    torch.manual_seed(seed)
    model = cls(CFG)
    ref = cls(CFG)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _profiled_step(opts: list[torch.optim.Optimizer]) -> list[str]:
    """Run the optimizer step under ``torch.profiler``; the backend collectives it issued."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof, comm_phase("optimizer"):
        for o in opts:
            o.step()
    return [op.name for op in backend_ops(prof)]


def _train(
    rank: int,
    model,
    ref,
    *,
    kind: str = "muon",
    steps: int = STEPS,
    dp=None,
    before_step=None,
    after_backward=None,
    clip=None,
) -> dict:
    """``steps`` steps of ``model`` (sharded) and ``ref``; losses, gradients and final parameters
    must agree on this rank.

    ``dp`` = (data-parallel rank, size) of this rank (default: global rank and world size).
    ``clip`` = [(norm_type, fraction), ...]: at step ``i`` clip both to ``fraction`` of the
    reference norm with entry ``i % len(clip)``.
    Every optimizer step runs under ``torch.profiler``: no backend collective may appear there.
    Returns per step the collective op sequence and bytes by phase, and the worst errors."""
    dp_rank, dp_size = dp if dp is not None else (rank, torch.distributed.get_world_size())
    roles = {n.replace(_WRAPPED, ""): r for n, r in roles_by_fqn(model).items()}
    opts = owner_optimizers(model, kind)
    ref_opts = reference_optimizers(ref, roles, kind)
    ref_params = {n: p for n, p in ref.named_parameters()}
    steps_out = []
    errs = {"loss": 0.0, "local_loss": 0.0, "grad": 0.0, "param": 0.0, "norm": 0.0}
    for step in range(steps):
        if before_step is not None:
            before_step(step, model, ref)
        with CommCounter() as cc:
            with comm_phase("forward"):
                loss = model(*local_batch(step, dp_rank, dp_size))
            loss.backward()
            if after_backward is not None:
                after_backward(step, model)
        # the reference: this rank's own micro-batch (its loss), then the global batch
        with torch.no_grad():
            local_ref = ref(*local_batch(step, dp_rank, dp_size)).item()
        ref_loss = ref(*global_batch(step, dp_size, cfg=CFG))
        ref_loss.backward()
        errs["local_loss"] = max(errs["local_loss"], abs(loss.item() - local_ref) / abs(local_ref))
        assert abs(loss.item() - local_ref) <= LOSS_RTOL * abs(local_ref), (step, local_ref)
        errs["grad"] = max(errs["grad"], _check_grads(model, ref_params, rank))
        if clip is not None:
            norm_type, fraction = clip[step % len(clip)]
            grads = [p.grad for p in ref.parameters() if p.grad is not None]
            max_norm = fraction * float(torch.nn.utils.get_total_norm(grads, norm_type))
            with cc:
                norm = clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
            errs["norm"] = max(errs["norm"], rel_err(norm, ref_norm))
            assert rel_err(norm, ref_norm) <= NORM_RTOL, (step, float(norm), float(ref_norm))
            errs["grad"] = max(errs["grad"], _check_grads(model, ref_params, rank))
        with cc:
            gloo = _profiled_step(opts)
        assert gloo == [], f"step {step}: the optimizer step issued {gloo}"
        for o in opts:
            o.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)  # non-owners' empty gradient pieces too
        assert cc.calls("optimizer") == 0 and cc.bytes("optimizer") == 0
        recv: dict[tuple[str, str], int] = {}
        for r in cc.records:
            recv[(r.phase, r.op)] = recv.get((r.phase, r.op), 0) + r.bytes_received
        steps_out.append(
            {
                "ops": [(r.phase, r.op) for r in cc.records if r.op != "clip_grad_norm"],
                "phase": cc.by_phase(),
                "recv_by_op": recv,
                "loss": mean_over_ranks(loss.item()),
            }
        )
        for o in ref_opts:
            o.step()
            o.zero_grad(set_to_none=True)
        a, b = steps_out[-1]["loss"], ref_loss.item()
        errs["loss"] = max(errs["loss"], abs(a - b) / abs(b))
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: loss {a} vs reference {b}"
    model.unshard()
    try:
        for name, p in model.named_parameters():
            want = ref_params[name.replace(_WRAPPED, "")]
            assert_close(p, want, PARAM_RTOL, f"rank {rank} {name}")
            errs["param"] = max(errs["param"], rel_err(p, want))
    finally:
        model.reshard()
    for key, value in errs.items():
        _MEASURED[key] = max(_MEASURED.get(key, 0.0), value)
    return {"steps": steps_out, "errors": errs}


def _check_grads(model, ref_params: dict[str, torch.Tensor], rank: int) -> float:
    """Every gradient this rank holds (owned tensors, its row blocks) against the reference;
    ``None`` exactly where the reference has none. Returns the worst relative error."""
    worst = 0.0
    for name, p in model.named_parameters():
        want = ref_params[name.replace(_WRAPPED, "")].grad
        shard, shard_rank = get_matrix_shard(p), get_shard_rank(p)  # HSDP: rank in the shard group
        if shard.role is not Role.ROWS and not shard.is_owned_by(shard_rank) or not steps_here(shard, replicas_of(p)):
            # HSDP: only the matrix's global owner (its holder in its step replica) gets one
            assert no_gradient_here(p), f"{name}: non-owner holds a gradient"
            continue
        assert (p.grad is None) == (want is None), f"{name}: gradient presence differs"
        if want is not None:
            want = full_grad_rows(shard, shard_rank, want)
            assert_close(p.grad, want, GRAD_RTOL, f"rank {rank} gradient {name}")
            worst = max(worst, rel_err(p.grad, want))
    return worst


def _fwd_bwd_bytes(res: dict, step: int) -> dict:
    ph = res["steps"][step]["phase"]
    return {p: ph[p]["bytes_received"] + ph[p]["bytes_sent"] for p in ("forward", "backward")}


# -- 1. frozen and unused parameters -------------------------------------------------------------
def _frozen(rank: int, W: int) -> dict:
    model, ref = _models(seed=1)
    frozen_before = [n for n, _ in model.named_parameters() if n.startswith("layers.0.")]
    frozen_after = ["layers.1.ln1.weight", "layers.1.ln1.bias"]
    for m in (model, ref):
        for n, p in m.named_parameters():
            if n in frozen_before:
                p.requires_grad_(False)
    fully_shard_model(model)
    params = dict(model.named_parameters())
    for n in frozen_after:  # frozen after fully_shard, on the sharded parameters
        params[n].requires_grad_(False)
        dict(ref.named_parameters())[n].requires_grad_(False)
    frozen = set(frozen_before) | set(frozen_after)
    plan = model.fix_plan()
    reduce_recv = []

    def check(step, m):
        for n, p in m.named_parameters():
            shard = get_matrix_shard(p)
            owned = shard.role is Role.ROWS or shard.is_owned_by(rank)
            if n in frozen:
                assert p.grad is None, f"frozen {n} has a gradient"
            else:
                assert (not no_gradient_here(p)) == owned, n
        for unit in units_of(m):
            assert all(h.unsharded.grad is None for h in unit.handles)

    out = _train(rank, model, ref, after_backward=check)
    # reduce-scatter: this rank receives (W-1) x what it holds of the trainable parameters only
    trainable_local = sum(s.local_numel(rank) for s in plan if s.fqn not in frozen) * F32
    for st in out["steps"]:
        ops = st["ops"]
        assert sum(1 for o in ops if o == ("forward", "all_gather_v")) == 3  # frozen block gathered
        reduce_recv.append(st["phase"]["backward"]["bytes_received"])
    # the (fully frozen) block 0 is re-gathered for backward: the gradient flows through it
    assert all(st["ops"].count(("backward", "all_gather_v")) == 2 for st in out["steps"])
    assert all(st["ops"].count(("backward", "reduce_scatter_v")) == 2 for st in out["steps"])
    gathered_back = sum((s.numel - s.local_numel(rank)) * F32 for s in plan if s.unit < 2)
    for st in out["steps"]:
        want = gathered_back + (W - 1) * trainable_local
        assert st["phase"]["backward"]["bytes_received"] == want
    return out


def _unused(rank: int, W: int) -> dict:
    model, ref = _models(seed=2, cls=BranchGPT)
    fully_shard_model(model)
    unused = {n for n, _ in model.named_parameters() if n.startswith("unused.")}

    def before(step, m, r):
        m.skip = r.skip = {1} if step % 2 else set()

    def check(step, m):
        for n, p in m.named_parameters():
            if n in unused or (step % 2 and n.startswith("layers.1.")):
                assert p.grad is None, f"step {step}: unused {n} has a gradient"

    return _train(rank, model, ref, kind="adamw", before_step=before, after_backward=check)


# -- 2. activation checkpointing -----------------------------------------------------------------
def _checkpointing(rank: int, W: int) -> dict:
    out = {}
    model, ref = _models(seed=3)
    fully_shard_model(model)
    out["plain"] = _train(rank, model, ref, steps=2)

    model, ref = _models(seed=3)
    for block in model.layers:
        block.__class__ = CkptBlock
    fully_shard_model(model)
    out["ckpt_fn"] = _train(rank, model, ref, steps=2)

    model, ref = _models(seed=3)
    model.layers = nn.ModuleList(checkpoint_wrapper(b) for b in model.layers)
    fully_shard_model(model)
    out["ckpt_wrapper"] = _train(rank, model, ref, steps=2)
    for k in ("ckpt_fn", "ckpt_wrapper"):  # same collectives and bytes as without checkpointing
        for a, b in zip(out[k]["steps"], out["plain"]["steps"], strict=True):
            assert a["ops"] == b["ops"], (k, a["ops"], b["ops"])
            assert a["phase"] == b["phase"], (k, a["phase"], b["phase"])
    return {k: _fwd_bwd_bytes(v, 1) for k, v in out.items()}


# -- 3. prefetch ---------------------------------------------------------------------------------
def _prefetch(rank: int, W: int) -> dict:
    logs = {}

    def run(setup, ckpt=False):
        model, ref = _models(seed=4)
        if ckpt:
            for block in model.layers:
                block.__class__ = CkptBlock
        fully_shard_model(model)
        setup(model)
        model.fix_plan()
        ctx = context_of(model)
        per_step = []

        def grab(step, m):
            per_step.append(list(ctx.prefetch_log))
            ctx.prefetch_log.clear()

        res = _train(rank, model, ref, steps=3, after_backward=grab)
        return res, per_step

    off, off_log = run(lambda m: m.set_auto_prefetch(False))
    auto, auto_log = run(lambda m: None)
    auto_ck, auto_ck_log = run(lambda m: None, ckpt=True)
    explicit, explicit_log = run(
        lambda m: (
            m.set_auto_prefetch(False),
            m.set_modules_to_forward_prefetch(list(m.layers)),
            m.layers[1].set_modules_to_backward_prefetch([m.layers[0]]),
        )
    )
    root, l0, l1 = 2, 0, 1  # unit indices: blocks first, the root last
    assert off_log == [[], [], []]
    # step 0 records the order; from step 1 on, every block's gather is issued one unit early
    want = [("forward", root, l0), ("forward", l0, l1), ("backward", root, l1), ("backward", l1, l0)]
    assert auto_log[0] == [] and auto_log[1] == want and auto_log[2] == want, auto_log
    assert auto_ck_log[1] == want, auto_ck_log
    want_explicit = [("forward", root, l0), ("forward", root, l1), ("backward", l1, l0)]
    assert all(log == want_explicit for log in explicit_log), explicit_log
    for res in (auto, auto_ck, explicit):  # one all-gather-v per unit per pass, same bytes
        for a, b in zip(res["steps"], off["steps"], strict=True):
            assert sorted(a["ops"]) == sorted(b["ops"])
            assert a["phase"] == b["phase"]
    logs["bytes_prefetch"] = _fwd_bwd_bytes(auto, 2)
    logs["bytes_no_prefetch"] = _fwd_bwd_bytes(off, 2)
    logs["bytes_prefetch_ckpt"] = _fwd_bwd_bytes(auto_ck, 2)
    return logs


def _job2(rank: int, W: int) -> dict:
    out = {"frozen": _frozen(rank, W), "unused": _unused(rank, W)}
    out["ckpt_bytes"] = _checkpointing(rank, W)
    out["prefetch"] = _prefetch(rank, W)
    out["measured"] = dict(_MEASURED)
    return out


# -- 4. HSDP -------------------------------------------------------------------------------------
def _hsdp(rank: int, W: int) -> dict:
    mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("replicate", "shard"))
    model, ref = _models(seed=5)
    fully_shard_model(model, mesh=mesh)
    plan = model.fix_plan()
    assert plan.world_size == W // 2 and plan.replicate_size == 2
    # every rank of both replicas checks its own gradients (a matrix's on its global owner only),
    # losses and full parameters; the gradients are clipped (2-norm, then 1-norm) below the
    # reference norm every step. Plain torch optimizers step the local pieces here, so the updated
    # matrices reach the other replica at the next forward pass (ShardingContext.sync_replicas).
    out = _train(rank, model, ref, steps=4, dp=(rank, W), clip=[(2.0, 0.5), (1.0, 0.5)])
    shard_rank = mesh.get_local_rank(1)
    # the previous step's matrices cross the replicas unit by unit: one broadcast per unit and
    # replica that stepped some of this rank's pieces of it
    per_unit = {(s.unit, s.step_replica) for s in plan if s.step_replica is not None and s.local_numel(shard_rank)}
    for i, st in enumerate(out["steps"]):
        by = {}
        for phase, op in st["ops"]:
            by[(phase, op)] = by.get((phase, op), 0) + 1
        # gathers and reductions stay in the shard group; per unit holding a gradient segment
        # here, one reduce-scatter-v of the matrices across replicas and one all-reduce of the rest
        assert by[("forward", "all_gather_v")] == 3
        assert by[("backward", "reduce_scatter_v")] == 3
        assert 1 <= by.get(("backward", "replicate_reduce_scatter_v"), 0) <= 3
        assert 1 <= by.get(("backward", "replicate_all_reduce"), 0) <= 3
        # the previous step's matrices cross the replicas before each unit's gather
        assert by.get(("forward", "replicate_broadcast"), 0) == (len(per_unit) if i else 0)
        assert st["phase"]["optimizer"]["calls"] == 0
    fwd_recv = sum((s.numel - s.local_numel(shard_rank)) * F32 for s in plan)
    assert all(st["recv_by_op"][("forward", "all_gather_v")] == fwd_recv for st in out["steps"])
    # the matrices' pieces this rank's replica did not step arrive once per step
    other = sum(s.local_numel(shard_rank) for s in plan if s.step_replica not in (None, mesh.get_local_rank(0)))
    # (and each broadcast from another replica carries its sender's step count: 8 bytes)
    received = sum(r != mesh.get_local_rank(0) for _, r in per_unit)
    want = other * F32 + 8 * received
    assert all(st["recv_by_op"].get(("forward", "replicate_broadcast"), 0) == want for st in out["steps"][1:])
    # The mutation the gradient check must reject: averaging over the shard group only (W/2)
    # instead of all W data-parallel ranks scales every gradient by the replicate size, a
    # relative error of replicate_size - 1 = 1. (Losses alone cannot see it: Muon's update is
    # scale-free and AdamW's nearly so, eps 1e-5; the loss drifts far below LOSS_RTOL.)
    replicate = mesh.size(0)
    ref(*global_batch(0, W, cfg=CFG)).backward()
    mutant_err = min(rel_err(p.grad * replicate, p.grad) for p in ref.parameters())
    assert mutant_err > 1e4 * GRAD_RTOL, mutant_err
    return {
        "hsdp_bytes": _fwd_bwd_bytes(out, 1),
        "measured": dict(_MEASURED),
        "mutant_grad": mutant_err,
        "global_owner": _global_owner(rank, W),
        "every_replica": _global_owner(rank, W, every_replica=True),
        "deferred": _deferred_broadcast(rank, W),
        "grad_scaler": _grad_scaler(rank, W),
        "optimizer_in_backward": _optimizer_in_backward(rank, W),
    }


class _CountingMuon(Muon):
    """The package's Muon, counting the matrices each step orthogonalises (every parameter with
    a gradient: one Newton-Schulz iteration each) and their FLOPs under Muon's cost model."""

    def __init__(self, params, **kw) -> None:
        super().__init__(params, **kw)
        self.ns_calls = 0
        self.ns_flops = 0.0

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.ns_calls += 1
                    self.ns_flops += MUON_COST.flops(tuple(p.shape))
        return super().step(closure)


def _global_owner(rank: int, W: int, shard: int = 2, rtol: float = PARAM_RTOL, every_replica: bool = False) -> dict:
    """HSDP on a (W // shard, shard) mesh with ``OwnerRoutedOptimizer`` (its step syncs the
    replicas itself): parameters equal one process's after every step, and what each rank
    stepped and keeps, for the parent to add up over ranks. ``every_replica``: a plan without
    step replicas (``plan_model``'s), so every replica's holder steps (HSDP before global owners)."""
    mesh = init_device_mesh("cpu", (W // shard, shard), mesh_dim_names=("replicate", "shard"))
    model, ref = _models(seed=7)
    plan = plan_model(model, shard, unit_prefixes=model.unit_prefixes()) if every_replica else None
    fully_shard_model(model, mesh=mesh, root_options={"plan": plan})
    opt = OwnerRoutedOptimizer(
        model, matrix=_CountingMuon, matrix_options=MUON_OPTS, tail="adamw", tail_options=ADAMW_OPTS
    )
    roles = roles_by_fqn(model)
    ref_mats = [p for n, p in ref.named_parameters() if roles[n] is Role.MATRIX]
    ref_opts = [
        _CountingMuon(ref_mats, **MUON_OPTS),
        torch.optim.AdamW([p for n, p in ref.named_parameters() if roles[n] is not Role.MATRIX], **ADAMW_OPTS),
    ]
    worst = 0.0
    for step in range(3):
        model(*local_batch(step, rank, W)).backward()
        with CommCounter() as cc:
            opt.step()
        opt.zero_grad()
        ref(*global_batch(step, W, cfg=CFG)).backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        ops = cc.by_op("optimizer")  # the broadcasts, after the step check over the replicate group
        assert set(ops) <= {"replicate_broadcast", "step_check"} and ops["step_check"] == 1, ops
        model.unshard()  # every replica's full parameters, right after the step (no forward between)
        try:
            for name, p in model.named_parameters():
                want = dict(ref.named_parameters())[name]
                assert_close(p, want, rtol, f"step {step} rank {rank} {name}")
                worst = max(worst, rel_err(p, want))
        finally:
            model.reshard()
    # a synced micro-batch that no step follows: OwnerRoutedOptimizer syncs at its steps only, so
    # the next forward sends no matrix across the replicas
    model(*local_batch(3, rank, W)).backward()
    with CommCounter() as cc, torch.no_grad():
        model(*local_batch(4, rank, W))
    assert "replicate_broadcast" not in cc.by_op(), cc.by_op()
    opt.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    with_state = sorted(
        names[id(p)] for p, st in opt.state.items() if any(torch.is_tensor(v) and v.dim() for v in st.values())
    )
    child = opt.matrix_optimizer
    return {
        "worst_param": worst,
        "with_state": with_state,
        "matrices": sorted(n for n, r in roles.items() if r is Role.MATRIX),
        "ns_calls": child.ns_calls if child is not None else 0,
        "ns_flops": child.ns_flops if child is not None else 0.0,
        "ref_ns_calls": ref_opts[0].ns_calls,
        "ref_ns_flops": ref_opts[0].ns_flops,
        "state_bytes": state_bytes([opt]),
    }


def _deferred_broadcast(rank: int, W: int) -> dict:
    """The two placements of the global owners' broadcast (``replica_broadcast="step"`` and
    ``"forward"``) on a (2, 2) mesh, one model each, same batches: losses and every parameter
    bitwise equal after every step. With the broadcast deferred the step sends nothing, each
    unit's broadcast travels in the next forward (one per unit and step replica holding pieces
    here), and a parameter read before that forward (``full_tensor()``, ``state_dict()``) lands
    it first."""
    mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("replicate", "shard"))
    models, opts = {}, {}
    for placement in ("step", "forward"):
        model, _ = _models(seed=11)
        fully_shard_model(model, mesh=mesh)
        models[placement] = model
        opts[placement] = OwnerRoutedOptimizer(
            model, matrix="muon", matrix_options=MUON_OPTS, tail_options=ADAMW_OPTS, replica_broadcast=placement
        )
    plan, shard_rank = models["forward"].fix_plan(), mesh.get_local_rank(1)
    # the broadcasts this rank takes part in per step: one per (unit, step replica) with pieces here
    per_unit = {(s.unit, s.step_replica) for s in plan if s.step_replica is not None and s.local_numel(shard_rank)}
    # pieces another replica steps: stale here between the step and the next forward
    stale = [
        n
        for n, p in models["forward"].named_parameters()
        if not steps_here(get_matrix_shard(p), replicas_of(p)) and local_tensor(p).numel()
    ]
    assert stale, "the plan gives this rank no matrix another replica steps"
    for step in range(3):
        losses, ops = {}, {}
        for placement, model in models.items():
            with CommCounter() as cc:
                with comm_phase("forward"):
                    loss = model(*local_batch(step, rank, W))
                loss.backward()
                with comm_phase("optimizer"):
                    opts[placement].step()
            opts[placement].zero_grad()
            losses[placement], ops[placement] = loss.detach(), cc.by_op
        assert torch.equal(losses["step"], losses["forward"]), (step, losses)
        assert ops["step"]("optimizer").get("replicate_broadcast", 0) == len({r for _, r in per_unit})
        assert "replicate_broadcast" not in ops["forward"]("optimizer")
        # step 0's broadcasts travel in step 1's forward; step 1's were landed by a read
        assert ops["forward"]("forward").get("replicate_broadcast", 0) == (len(per_unit) if step == 1 else 0)
        params = {n: p for n, p in models["step"].named_parameters()}
        if step == 1:
            # deferred: a piece another replica stepped still holds the previous values here...
            fwd = dict(models["forward"].named_parameters())
            assert not torch.equal(local_tensor(fwd[stale[0]]), local_tensor(params[stale[0]])), stale[0]
            # ...until a read lands it: full_tensor() of a piece replica 1 stepped (collective: one name)
            n = next(n for n, p in params.items() if get_matrix_shard(p).step_replica == 1)
            got = fwd[n].full_tensor()
            assert torch.equal(got, params[n].full_tensor()), n
        if step == 2:  # so does a state dict (every fully_shard module's pre hook)
            sd = models["forward"].state_dict()
            for n in stale:
                assert torch.equal(local_tensor(sd[n]), local_tensor(params[n])), (step, n)
    with CommCounter() as cc:  # nothing left due: the next forward sends nothing across replicas
        models["forward"].state_dict()
    assert "replicate_broadcast" not in cc.by_op(), cc.by_op()
    for placement in models:  # every replica's full parameters, bitwise the same in both placements
        models[placement].unshard()
    try:
        fwd = dict(models["forward"].named_parameters())
        for n, p in models["step"].named_parameters():
            assert torch.equal(p, fwd[n]), n
    finally:
        for model in models.values():
            model.reshard()
    return {"broadcasts_per_forward": len(per_unit), "stale_matrices": len(stale)}


def _grad_scaler(rank: int, W: int) -> dict:
    """``torch.amp.GradScaler`` on a (2, 2) mesh, float16 compute (``MixedPrecisionPolicy``),
    ``OwnerRoutedOptimizer``: at step 1 an infinity is put in the gradient of a matrix replica 1
    steps, on its global owner only (no rank of replica 0 holds that gradient). ``found_inf`` is
    agreed over the whole mesh, so every rank skips that step, as one process (fp32, the same
    infinity) does: the scales agree with one process's at every step and the skipped step
    changes no parameter (bitwise); the replicas hold bitwise equal parameters at the end."""
    mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("replicate", "shard"))
    model, ref = _models(seed=13)
    fully_shard_model(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    opt = OwnerRoutedOptimizer(model, matrix="muon", matrix_options=MUON_OPTS, tail_options=ADAMW_OPTS)
    # one process: the same one optimizer (GradScaler skips per optimizer: one for both roles)
    ref_opt = OwnerRoutedOptimizer(ref, matrix="muon", matrix_options=MUON_OPTS, tail_options=ADAMW_OPTS)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2))
    plan_names = [n for n, p in model.named_parameters() if get_matrix_shard(p).step_replica == 1]
    target = plan_names[0]  # a matrix replica 1's global owner steps (the same name on every rank)
    scales, ref_scales, unchanged = [], [], None
    for step in range(3):
        scaler.scale(model(*local_batch(step, rank, W))).backward()
        ref_scaler.scale(ref(*global_batch(step, W, cfg=CFG))).backward()
        if step == 1:
            p = dict(model.named_parameters())[target]
            if p.grad is not None and local_tensor(p.grad).numel():  # its global owner only
                local_tensor(p.grad).fill_(float("inf"))
            dict(ref.named_parameters())[target].grad.fill_(float("inf"))
            before = {n: local_tensor(q).clone() for n, q in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        if step == 1:
            unchanged = all(torch.equal(local_tensor(q), before[n]) for n, q in model.named_parameters())
        scales.append(scaler.get_scale())
        ref_scales.append(ref_scaler.get_scale())
    assert scales == ref_scales and scales[1] < scales[0], (scales, ref_scales)
    assert unchanged, "the skipped step changed a parameter"
    model.unshard()
    try:
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        model.reshard()
    # bitwise equal on both replicas: the other replica's copy, from the rank at the same shard rank
    peers = [None] * W
    torch.distributed.all_gather_object(peers, full)
    peer = peers[(rank + W // 2) % W]
    for n, t in full.items():
        assert torch.equal(t, peer[n]), n
    err = max(rel_err(full[n], q) for n, q in ref.named_parameters())
    assert err <= HSDP_FP16_PARAM_RTOL, err
    return {"scales": scales, "param_err_vs_fp32": err}


def _optimizer_in_backward(rank: int, W: int) -> dict:
    """Optimizer in backward on a (2, 2) mesh: each parameter's post-accumulate-grad hook steps
    its own ``torch.optim.AdamW`` and drops the gradient. A matrix's hook runs on its global
    owner only (its gradient lands there), the tail's on every replica; the stepped matrices
    cross the replicas before the next forward's gathers (and before ``full_tensor()``). Equal to
    one process running the same hooks after every step."""
    mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("replicate", "shard"))
    model, ref = _models(seed=17)
    fully_shard_model(model, mesh=mesh)
    model.fix_plan()
    for m in (model, ref):
        optimizer_in_backward(m)  # each hook holds its optimizer
    worst = 0.0
    for step in range(3):
        model(*local_batch(step, rank, W)).backward()
        ref(*global_batch(step, W, cfg=CFG)).backward()
        assert all(p.grad is None for m in (model, ref) for p in m.parameters())  # every hook ran
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            full = p.detach().full_tensor()
            assert_close(full, q, PARAM_RTOL, f"step {step} rank {rank} {n}")
            worst = max(worst, rel_err(full, q))
    return {"worst_param": worst}


def _check_global_owner(results: list[dict], replicas: int, key: str = "global_owner") -> None:
    """Every matrix's optimizer state on exactly one rank, the tail's on every replica; the
    Newton-Schulz calls and FLOPs summed over all ranks equal one process's (not x replicas).
    ``key="every_replica"``: the plan without step replicas, where both are x replicas."""
    got = [r[key] for r in results]
    one = got[0]
    copies = 1 if key == "global_owner" else replicas
    for m in one["matrices"]:
        holders = [rank for rank, g in enumerate(got) if m in g["with_state"]]
        assert len(holders) == copies, (m, holders)
    tails = {n for g in got for n in g["with_state"]} - set(one["matrices"])
    for n in tails:  # tail and rows: AdamW state redundant on every replica (all-reduced gradients)
        assert sum(n in g["with_state"] for g in got) % replicas == 0, n
    assert sum(g["ns_calls"] for g in got) == copies * one["ref_ns_calls"] == copies * 3 * len(one["matrices"])
    assert sum(g["ns_flops"] for g in got) == copies * one["ref_ns_flops"]
    print(
        f"{key}: worst parameter error",
        max(g["worst_param"] for g in got),
        "state bytes per rank",
        [g["state_bytes"] for g in got],
        "Newton-Schulz calls per rank",
        [g["ns_calls"] for g in got],
    )


def test_hsdp_w4() -> None:
    results = spawn_ranks(_hsdp, 4, threads_per_rank=1)
    print(
        "GradScaler (2, 2): scales",
        results[0]["grad_scaler"]["scales"],
        "parameters vs float32 one process",
        max(r["grad_scaler"]["param_err_vs_fp32"] for r in results),
    )
    print(
        "optimizer in backward (2, 2): worst parameter error",
        max(r["optimizer_in_backward"]["worst_param"] for r in results),
    )
    for rank, res in enumerate(results):
        print(f"rank {rank} HSDP bytes:", res["hsdp_bytes"])
        assert res["mutant_grad"] >= 1.0 - 1e-6  # dividing by the shard size doubles gradients
    _print_measured("HSDP W=4", results)
    _check_global_owner(results, replicas=2)
    _check_global_owner(results, replicas=2, key="every_replica")


def _hsdp6(rank: int, W: int) -> dict:
    return {"global_owner": _global_owner(rank, W, shard=3, rtol=HSDP_W6_PARAM_RTOL)}


def test_hsdp_w6() -> None:
    """(2, 3): one global owner per matrix over 6 ranks."""
    _check_global_owner(spawn_ranks(_hsdp6, 6, threads_per_rank=1), replicas=2)


def test_parity_w2() -> None:
    results = spawn_ranks(_job2, 2, threads_per_rank=1)
    for key in ("frozen", "unused"):  # every rank issued the same collectives, in order
        for s in range(STEPS):
            assert results[0][key]["steps"][s]["ops"] == results[1][key]["steps"][s]["ops"]
    for rank, res in enumerate(results):
        print(f"rank {rank} bytes (forward/backward, sent+received):", {**res["ckpt_bytes"], **res["prefetch"]})
    _print_measured("W=2", results)


def _print_measured(what: str, results: list[dict]) -> None:
    worst = {k: max(r["measured"][k] for r in results) for k in results[0]["measured"]}
    print(f"\n{what} worst relative errors over ranks:", {k: f"{v:.3g}" for k, v in worst.items()})
