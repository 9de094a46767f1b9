"""FSDP2 parity of the owner-shaped runtime (gloo; one spawned job per world size).

Every scenario trains a tiny GPT for a few steps against the single-process reference (same
optimizer, unsharded model, global batch) within 1e-5 relative, and checks:

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
* HSDP on a (2, 2) mesh at W=4: owner-shaped in the shard dim, gradients all-reduced across
  replicas and averaged over all 4 ranks; ``optimizer.step()`` moves nothing.
"""

from __future__ import annotations

import torch
from _ref import (
    assert_close,
    global_batch,
    local_batch,
    make_models,
    mean_over_ranks,
    owner_optimizers,
    reference_optimizers,
    roles_by_fqn,
)
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from matrix_owner_optim.comm import CommCounter, comm_phase
from matrix_owner_optim.launch import spawn_ranks
from matrix_owner_optim.models.gpt import GPT, Block, GPTConfig
from matrix_owner_optim.planning import Role, get_matrix_shard
from matrix_owner_optim.sharding import fully_shard

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=4)
RTOL = 1e-5
STEPS = 4
F32 = 4
_WRAPPED = "._checkpoint_wrapped_module"


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


def _shard(model, **kw):
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _train(rank: int, model, ref, *, kind: str = "muon", steps: int = STEPS, dp=None,
           before_step=None, after_backward=None) -> dict:
    """``steps`` steps of ``model`` (sharded) and ``ref``; losses and final parameters must agree.

    ``dp`` = (data-parallel rank, size) of this rank (default: global rank and world size).
    Returns per step the collective op sequence and bytes by phase."""
    dp_rank, dp_size = dp if dp is not None else (rank, torch.distributed.get_world_size())
    roles = {n.replace(_WRAPPED, ""): r for n, r in roles_by_fqn(model).items()}
    opts = owner_optimizers(model, kind)
    ref_opts = reference_optimizers(ref, roles, kind)
    steps_out = []
    for step in range(steps):
        if before_step is not None:
            before_step(step, model, ref)
        with CommCounter() as cc:
            with comm_phase("forward"):
                loss = model(*local_batch(step, dp_rank, dp_size))
            loss.backward()
            if after_backward is not None:
                after_backward(step, model)
            with comm_phase("optimizer"):
                for o in opts:
                    o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        assert cc.calls("optimizer") == 0 and cc.bytes("optimizer") == 0
        steps_out.append({
            "ops": [(r.phase, r.op) for r in cc.records],
            "phase": cc.by_phase(),
            "loss": mean_over_ranks(loss.item()),
        })
        ref_loss = ref(*global_batch(step, dp_size, cfg=CFG))
        ref_loss.backward()
        for o in ref_opts:
            o.step()
            o.zero_grad(set_to_none=True)
        a, b = steps_out[-1]["loss"], ref_loss.item()
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: loss {a} vs reference {b}"
    ref_params = dict(ref.named_parameters())
    model.unshard()
    try:
        for name, p in model.named_parameters():
            assert_close(p, ref_params[name.replace(_WRAPPED, "")], RTOL, f"rank {rank} {name}")
    finally:
        model.reshard()
    return {"steps": steps_out}


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
    _shard(model)
    params = dict(model.named_parameters())
    for n in frozen_after:  # frozen after fully_shard, on the sharded parameters
        params[n].requires_grad_(False)
        dict(ref.named_parameters())[n].requires_grad_(False)
    frozen = set(frozen_before) | set(frozen_after)
    plan = model.sharding_plan
    reduce_recv = []

    def check(step, m):
        for n, p in m.named_parameters():
            shard = get_matrix_shard(p)
            owned = shard.role is Role.SHARDED or shard.is_owned_by(rank)
            if n in frozen:
                assert p.grad is None, f"frozen {n} has a gradient"
            else:
                assert (p.grad is not None) == owned, n
        for unit in m._moo_units():
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
        assert st["phase"]["backward"]["bytes_received"] == gathered_back + (W - 1) * trainable_local
    return out


def _unused(rank: int, W: int) -> dict:
    model, ref = _models(seed=2, cls=BranchGPT)
    _shard(model)
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
    _shard(model)
    out["plain"] = _train(rank, model, ref, steps=2)

    model, ref = _models(seed=3)
    for block in model.layers:
        block.__class__ = CkptBlock
    _shard(model)
    out["ckpt_fn"] = _train(rank, model, ref, steps=2)

    model, ref = _models(seed=3)
    model.layers = nn.ModuleList(checkpoint_wrapper(b) for b in model.layers)
    _shard(model)
    out["ckpt_wrapper"] = _train(rank, model, ref, steps=2)
    for k in ("ckpt_fn", "ckpt_wrapper"):  # same collectives and bytes as without checkpointing
        for a, b in zip(out[k]["steps"], out["plain"]["steps"]):
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
        _shard(model)
        setup(model)
        ctx = model._moo_units()[0].ctx
        per_step = []

        def grab(step, m):
            per_step.append(list(ctx.prefetch_log))
            ctx.prefetch_log.clear()

        res = _train(rank, model, ref, steps=3, after_backward=grab)
        return res, per_step

    off, off_log = run(lambda m: m.set_auto_prefetch(False))
    auto, auto_log = run(lambda m: None)
    auto_ck, auto_ck_log = run(lambda m: None, ckpt=True)
    explicit, explicit_log = run(lambda m: (m.set_auto_prefetch(False),
                                            m.set_modules_to_forward_prefetch(list(m.layers)),
                                            m.layers[1].set_modules_to_backward_prefetch([m.layers[0]])))
    root, l0, l1 = 2, 0, 1  # unit indices: blocks first, the root last
    assert off_log == [[], [], []]
    # step 0 records the order; from step 1 on, every block's gather is issued one unit early
    want = [("forward", root, l0), ("forward", l0, l1), ("backward", root, l1), ("backward", l1, l0)]
    assert auto_log[0] == [] and auto_log[1] == want and auto_log[2] == want, auto_log
    assert auto_ck_log[1] == want, auto_ck_log
    want_explicit = [("forward", root, l0), ("forward", root, l1), ("backward", l1, l0)]
    assert all(log == want_explicit for log in explicit_log), explicit_log
    for res in (auto, auto_ck, explicit):  # one all-gather-v per unit per pass, same bytes
        for a, b in zip(res["steps"], off["steps"]):
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
    return out


# -- 4. HSDP -------------------------------------------------------------------------------------
def _hsdp(rank: int, W: int) -> dict:
    mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("replicate", "shard"))
    model, ref = _models(seed=5)
    _shard(model, mesh=mesh)
    plan = model.sharding_plan
    assert plan.world_size == W // 2
    out = _train(rank, model, ref, steps=3, dp=(rank, W))
    shard_rank = mesh.get_local_rank(1)
    for st in out["steps"]:
        by = {}
        for phase, op in st["ops"]:
            by[(phase, op)] = by.get((phase, op), 0) + 1
        # gathers and reductions stay in the shard group; one replica all-reduce per unit that
        # holds a gradient segment here
        assert by[("forward", "all_gather_v")] == 3
        assert by[("backward", "reduce_scatter_v")] == 3
        assert 1 <= by.get(("backward", "replicate_all_reduce"), 0) <= 3
        assert st["phase"]["optimizer"]["calls"] == 0
    fwd_recv = sum((s.numel - s.local_numel(shard_rank)) * F32 for s in plan)
    assert all(st["phase"]["forward"]["bytes_received"] == fwd_recv for st in out["steps"])
    return {"hsdp_bytes": _fwd_bwd_bytes(out, 1)}


def test_parity_w2() -> None:
    results = spawn_ranks(_job2, 2, threads_per_rank=1)
    for key in ("frozen", "unused"):  # every rank issued the same collectives, in order
        for s in range(STEPS):
            assert results[0][key]["steps"][s]["ops"] == results[1][key]["steps"][s]["ops"]
    for rank, res in enumerate(results):
        print(f"rank {rank} bytes (forward/backward, sent+received):",
              {**res["ckpt_bytes"], **res["prefetch"]})


def test_hsdp_w4() -> None:
    results = spawn_ranks(_hsdp, 4, threads_per_rank=1)
    for rank, res in enumerate(results):
        print(f"rank {rank} HSDP bytes:", res["hsdp_bytes"])
