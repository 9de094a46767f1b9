"""OwnerRoutedOptimizer on stock FSDP2 x tensor parallel and x expert parallel on 4 gloo ranks.

Each block is cut by torch's ``parallelize_module`` (``ColwiseParallel`` w1, ``RowwiseParallel``
w2) on the tp mesh, then sharded by stock ``torch.distributed.fsdp.fully_shard`` over the dp
mesh, so w1 is ``(_StridedShard(0, sf=2), Shard(0))`` and w2 ``(Shard(0), Shard(1))``. The
hidden sizes (10 and 6) split evenly over tp (torch's TP needs that) and make FSDP's row blocks
of each TP slice uneven (3 and 2 rows, 2 and 1). One spawned job:

* torch.optim.Muon (as ``matrix="torch_muon"``) + AdamW through OwnerRoutedOptimizer, with
  torch's ``clip_grad_norm_`` every step, against one process running ``torch.optim.Muon`` and
  ``torch.optim.AdamW`` on the unsharded model over the whole batch: losses, clip norms and
  full parameters equal at the noise floor, on every rank;
* torchtitan's own ``parallelize_llama`` (data_parallel_shard_degree=2, tensor_parallel_degree=2)
  on a tiny Llama3 from its config builders (CPU adaptations: tests/_titan.py), torch's
  ``clip_grad_norm_`` every step: this package's Muon (float32 Newton-Schulz) + AdamW equal one
  process over the whole batch, the clip norm the one-process norm on every rank; and
  torch.optim.Muon through OwnerRoutedOptimizer equals torch.optim.Muon fed the same gradients
  bitwise;
* torchtitan's own ``parallelize_qwen3`` on a tiny Qwen3-MoE (4 routed experts, float32 expert
  matmuls) with data_parallel_shard_degree=4 and expert_parallel_degree=2: the experts on its
  (efsdp, ep) mesh, stepped expert by expert on their owners with no collective over ep, equal
  one process over the whole batch, and bitwise one process fed the same gradients; the steady
  step's bytes as ``bytes_per_step`` says; the experts' optimizer state is one global tensor in
  torch's full state dict (the one-process momentum, bitwise), and a DCP checkpoint at step 1
  resumes in a fresh model and optimizer bit for bit;
* a single TP matrix (one dp coordinate owns it; the other's TP group skips the tp stage):
  equal one process's torch.optim.Muon;
* the collectives of a steady step: the dp all-to-alls and one all-gather over tp per dtype
  bucket, bytes as ``bytes_per_step`` says;
* placements outside the supported forms (a 2D matrix split by rows twice, experts split
  inside each expert, a conv kernel in the expert parallel form) are refused at construction,
  naming the parameter, its placements and the supported forms;
* state dicts: DCP of torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` at step 2,
  loaded into a fresh model and optimizer with ``set_model_state_dict`` /
  ``set_optimizer_state_dict``: the remaining steps repeat the run bit for bit;
* the same checkpoint resumed on this package's 1D owner layout at W=2 (each tp group one such
  layout, in the same spawn) continues as the (2, 2) run did, at the noise floor;
* torchtitan's Llama3 (separate q/k/v) under parallelize_llama on (2, 2) saved with DCP at step
  1 (tests/_titan_checkpoint.py): loaded bitwise, parameters and full optimizer state, on the
  package's 1D owner layout at W=2 and W=4 and on stock FSDP2 at W=4, and the W=4 owner layout's
  checkpoint back on (2, 2); every continued run equals the uninterrupted one process;
* this package's own ``fully_shard`` refuses a TP block sharded over its own tp mesh at the
  call, naming the parameter and its placements (over the dp dim beside it, the supported form,
  tests/test_tensor_parallel_owner.py).
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import _titan_checkpoint
from _ranks import spawn_ranks
from _ref import dcp_load, full_param_copies, fully_shard_model, sharded_state
from _tolerances import MOE_PARAM_RTOL, TITAN_PARAM_RTOL, TP_LOSS_RTOL, TP_NORM_RTOL, TP_PARAM_RTOL
from _tp import (
    ADAMW,
    BATCH,
    CLIP,
    LLAMA_CHECKPOINT,
    LLAMA_MUON,
    MOE_STEPS,
    MUON,
    STEPS,
    TITAN_BATCH,
    TITAN_STEPS,
    Block,
    D,
    Net,
    batches,
    build,
    clipped_run,
    micro,
    moe_reference,
    moe_step,
    parallelize_block,
    rel,
    titan_optimizers,
    titan_reference,
    tp_sharded,
)
from matrix_owner_optim import CommCounter, OwnerRoutedOptimizer
from matrix_owner_optim.preconditioners import Muon

# one xdist worker runs the module, so its cached gloo job (results()) spawns once per run
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("tensor_parallel")]


def _reference_optimizers(model: Net) -> list[torch.optim.Optimizer]:
    mats = [p for n, p in model.named_parameters() if n.endswith(("w1.weight", "w2.weight"))]
    rest = [p for n, p in model.named_parameters() if not n.endswith(("w1.weight", "w2.weight"))]
    return [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW)]


def reference(order: str = "forward") -> dict[str, Any]:
    """One process, whole batch; ``order="reversed"`` feeds the batch's rows reversed (the same
    loss, another summation order: the noise floor)."""
    model = build()
    opts = _reference_optimizers(model)
    return clipped_run(model, opts, batches(), model, order)


@functools.cache
def reference_run() -> dict[str, Any]:
    return reference()


# -- the spawned job ----------------------------------------------------------------------------
SAVE_AT = 2  # the checkpoint holds the state after this many steps


def _model_and_optimizer(mesh: Any) -> tuple[Net, OwnerRoutedOptimizer]:
    model = tp_sharded(mesh, stock=True)
    return model, OwnerRoutedOptimizer(
        model, matrix="torch_muon", matrix_options=MUON, tail="adamw", tail_options=ADAMW
    )


def _resume(mesh: Any, ckpt: str) -> dict[str, Any]:
    """A fresh model and optimizer load the step-2 DCP checkpoint through torch's
    set_model_state_dict / set_optimizer_state_dict (``_ref.dcp_load``) and train the
    remaining steps."""
    model, opt = _model_and_optimizer(mesh)
    dcp_load(model, opt, ckpt, via=_model_and_optimizer(mesh))
    loaded = full_param_copies(model)
    for step in range(SAVE_AT, STEPS):
        model(*micro(step, mesh)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {"loaded": loaded, "params": full_param_copies(model)}


def _train(rank: int, mesh: Any, ckpt: str) -> dict[str, Any]:
    """4 steps, saving model and optimizer with DCP at step 2."""
    import torch.distributed.checkpoint as dcp

    model, opt = _model_and_optimizer(mesh)
    out: dict[str, Any] = {"losses": [], "norms": [], "placements": {}}
    for n, p in model.named_parameters():
        out["placements"][n] = str(tuple(p.placements))
    for step in range(STEPS):
        if step == SAVE_AT:
            dcp.save(sharded_state(model, opt), checkpoint_id=ckpt)
            out["saved"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        x, y = micro(step, mesh)
        loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        out["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        if step == STEPS - 1:  # a steady step: the owners' copies were built at the first
            with CommCounter() as cc:
                opt.step()
            out["ops"] = cc.by_op("optimizer")
            out["sent"] = cc.bytes("optimizer", "sent")
            out["received"] = cc.bytes("optimizer", "received")
            layout = next(pl for pl in opt.layouts() if pl.name == "dtensor")
            out["bytes_per_step"] = layout.bytes_per_step()
            out["resyncs"] = layout.resyncs
        else:
            opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return out


# -- torchtitan's own parallelize_llama --------------------------------------------------------------
# A tiny Llama3 from torchtitan's config builders, parallelized by torchtitan's parallelize_llama
# with data_parallel_shard_degree=2 and tensor_parallel_degree=2 (its TP plan: vocab-parallel
# embedding, SequenceParallel norms, colwise fused wqkv, w1, w3 and lm_head, rowwise wo and w2;
# then FSDP2 over its fsdp mesh). CPU adaptations: tests/_titan.py.
def titan_reference_run() -> dict[str, Any]:
    return results()[0]["references"]["llama"]


def _titan_llama(lockstep: bool) -> dict[str, Any]:
    """3 steps of torchtitan's Llama3 under its parallelize_llama on (dp=2, tp=2), torch's
    clip_grad_norm_ every step. ``lockstep``: torch.optim.Muon through OwnerRoutedOptimizer, and
    on every rank a one-process copy stepped by torch.optim.Muon + AdamW on the same (clipped)
    gradients (gathered with full_tensor): the optimizer path alone, bfloat16 Newton-Schulz
    included. Else this package's Muon in float32 (compared with the whole-batch run)."""
    import torch.distributed as dist
    from torchtitan.models.llama3.parallelize import parallelize_llama

    import _titan

    par = _titan.parallelism(data_parallel_shard_degree=2, tensor_parallel_degree=2)
    model = _titan.build(_titan.llama_config(), par)
    ref = _titan.build(_titan.llama_config(), par) if lockstep else None
    ref_opts = titan_optimizers(ref, torch.optim.Muon, MUON) if ref is not None else []
    dims = _titan.parallelize(model, parallelize_llama, par, dist.get_world_size())
    matrix, options = ("torch_muon", MUON) if lockstep else ("muon", LLAMA_MUON)
    opt = OwnerRoutedOptimizer(model, matrix=matrix, matrix_options=options, tail="adamw", tail_options=ADAMW)
    dp = dims.get_mesh("fsdp").get_local_rank()
    norms, losses = [], []
    for tokens, targets in _titan.batches(TITAN_STEPS, TITAN_BATCH):
        rows = slice(2 * dp, 2 * dp + 2)
        loss = _titan.loss(model, tokens[rows], targets[rows], tokens.numel())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        losses.append(loss.item())
        if ref is not None:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            for n, p in ref.named_parameters():
                p.grad = grads[n]
            for o in ref_opts:
                o.step()
                o.zero_grad()
        opt.step()
        opt.zero_grad()
    out = {
        "placements": {n: str(tuple(p.placements)) for n, p in model.named_parameters()},
        "routes": {r["name"]: r["role"] for r in opt.routes()},
        "norms": norms,
        "losses": losses,
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
    }
    if ref is not None:
        out["lockstep"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return out


# -- expert parallel: torchtitan's Qwen3-MoE under its own parallelize_qwen3 ------------------------
# data_parallel_shard_degree=4, expert_parallel_degree=2: the dense parameters Shard(0) over its
# fsdp mesh (4), the routed experts w1/w2/w3 [E, ., .] on its (efsdp=2, ep=2) mesh as
# (_StridedShard(0, sf=2), Shard(0)): ep coordinate t holds experts [2t, 2t + 2), FSDP splits
# them over efsdp. Rank r takes row r of each global batch.
def moe_reference_run() -> dict[str, Any]:
    return results()[0]["references"]["moe"]


MOE_SAVE_AT = 1  # the EP checkpoint holds the state after this many steps


def _titan_moe_model() -> tuple[nn.Module, OwnerRoutedOptimizer]:
    import torch.distributed as dist
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    import _titan

    par = _titan.parallelism(data_parallel_shard_degree=4, expert_parallel_degree=2)
    model = _titan.build(_titan.qwen3_moe_config(), par)
    _titan.parallelize(model, parallelize_qwen3, par, dist.get_world_size())
    opt = OwnerRoutedOptimizer(model, matrix="muon", matrix_options=LLAMA_MUON, tail="adamw", tail_options=ADAMW)
    return model, opt


def _titan_moe(rank: int, ckpt: str) -> dict[str, Any]:
    """3 steps of torchtitan's Qwen3-MoE under parallelize_qwen3 with expert_parallel_degree=2,
    OwnerRoutedOptimizer (this package's Muon in float32 + AdamW), a one-process copy stepped in
    lockstep on the same gradients, and a DCP checkpoint of torch's get_model_state_dict /
    get_optimizer_state_dict at step 1 that a fresh model and optimizer resume from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    import _titan

    ref = _titan.build(_titan.qwen3_moe_config(), _titan.parallelism())
    ref_opts = titan_optimizers(ref, Muon, LLAMA_MUON)
    model, opt = _titan_moe_model()
    out: dict[str, Any] = {"losses": []}
    for step in range(MOE_STEPS):
        if step == MOE_SAVE_AT:
            dcp.save(
                sharded_state(model, opt),
                checkpoint_id=ckpt,
            )
        out["losses"].append(moe_step(model, rank, step).item())
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        for o in ref_opts:
            o.step()
            o.zero_grad()
        if step == MOE_STEPS - 1:
            with CommCounter() as cc:
                opt.step()
            out["ops"] = cc.by_op("optimizer")
            out["sent"], out["received"] = cc.bytes("optimizer", "sent"), cc.bytes("optimizer", "received")
        else:
            opt.step()
        opt.zero_grad()
    # the experts' state as one global tensor (its pieces over both mesh dims), and the lockstep copy's
    name = "layers.1.moe.routed_experts.inner_experts.w2_EDF"
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out["momentum"] = full["state"][name]["momentum_buffer"].clone()
    out["lockstep_momentum"] = ref_opts[0].state[dict(ref.named_parameters())[name]]["momentum_buffer"].clone()
    # resume from the checkpoint in a fresh model and optimizer (through another fresh pair's
    # state dicts, _ref.dcp_load: the experts' pieces), train the remaining steps
    resumed, resumed_opt = _titan_moe_model()
    dcp_load(resumed, resumed_opt, ckpt, via=_titan_moe_model())
    for step in range(MOE_SAVE_AT, MOE_STEPS):
        moe_step(resumed, rank, step)
        resumed_opt.step()
        resumed_opt.zero_grad()
    out.update(
        placements={
            n: (str(tuple(p.placements)), tuple(p.device_mesh.mesh_dim_names)) for n, p in model.named_parameters()
        },
        routes={r["name"]: r for r in opt.routes()},
        bytes_per_step=sum(pl.bytes_per_step() for pl in opt.layouts() if pl.name == "dtensor"),
        params={n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        lockstep={n: p.detach().clone() for n, p in ref.named_parameters()},
        resumed={n: p.full_tensor().detach().clone() for n, p in resumed.named_parameters()},
    )
    return out


def _one_matrix_weight() -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(D, 10, bias=False)


@functools.cache
def one_matrix_reference() -> torch.Tensor:
    lin = _one_matrix_weight()
    opt = torch.optim.Muon([lin.weight], **MUON)
    for x, _ in batches()[:2]:
        lin(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return lin.weight.detach().clone()


def _one_matrix(mesh: Any) -> dict[str, Any]:
    """A single TP matrix: one dp coordinate owns it, the other's TP group owns nothing and
    skips the all-gather over tp (every member alike)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    lin = _one_matrix_weight()
    parallelize_module(lin, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    fully_shard(lin, mesh=mesh["dp"])
    opt = OwnerRoutedOptimizer([("w", lin.weight)], matrix="torch_muon", matrix_options=MUON)
    dp = mesh["dp"].get_local_rank()
    ops = []
    for x, _ in batches()[:2]:
        lin(x[4 * dp : 4 * dp + 4]).pow(2).mean().backward()
        with CommCounter() as cc:
            opt.step()
        ops.append(cc.by_op("optimizer"))
        opt.zero_grad()
    return {"owner": opt.routes()[0]["owner"], "ops": ops, "weight": lin.weight.full_tensor().detach().clone()}


def _bad_placements(mesh: Any) -> dict[str, str]:
    """Refused at construction: a 2D matrix TP-sharded by rows with FSDP's rows first
    ((Shard(0), Shard(0))); a stack of expert matrices split inside each expert over the second
    mesh dim (expert tensor parallel, (Shard(0), Shard(1))); a 3D conv kernel split over dim 0
    in the expert parallel form (its dim 0 is rows of one matrix, not a stack of matrices)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    cases = {
        "rows_twice": ((8, 4), [Shard(0), Shard(0)], None),
        "expert_tp": ((4, 6, 4), [Shard(0), Shard(1)], None),
        "conv": ((4, 6, 3), [_StridedShard(0, split_factor=2), Shard(0)], "conv"),
    }
    out = {}
    for case, (shape, placements, view) in cases.items():
        p = nn.Parameter(distribute_tensor(torch.randn(shape), mesh, placements))
        try:
            views = {"w": view} if view is not None else None
            OwnerRoutedOptimizer([("w", p)], matrix="muon", roles={"w": "matrix"}, matrix_views=views)
            out[case] = "no error"
        except ValueError as exc:
            out[case] = str(exc)
    return out


def _owner_layout_on_tp(mesh: Any) -> str:
    """The package's own fully_shard on a TP block over its own tp mesh (not the dp dim beside
    it: tests/test_tensor_parallel_owner.py runs that form): refused at the call, naming the
    parameter."""
    from matrix_owner_optim import fully_shard

    block = Block(10)
    parallelize_block(block, mesh["tp"])
    try:
        fully_shard(block, mesh=mesh["tp"])
    except ValueError as exc:
        return str(exc)
    return "no error"


def tp_job(rank: int, W: int, ckpt: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {
        "train": _train(rank, mesh, ckpt),
        "llama": _titan_llama(lockstep=False),
        "llama_lockstep": _titan_llama(lockstep=True),
        "moe": _titan_moe(rank, f"{ckpt}/moe"),
        "resumed": _resume(mesh, ckpt),
        "owner_layout_resumed": _owner_layout_resume(mesh, ckpt),
        "llama_checkpoint": _titan_checkpoint.round_trips(mesh, LLAMA_CHECKPOINT, f"{ckpt}/llama"),
        "one_matrix": _one_matrix(mesh),
        "bad": _bad_placements(mesh),
        "owner_layout": _owner_layout_on_tp(mesh),
    }
    if rank == 0:  # the one-process torchtitan references, where torchtitan is imported already
        out["references"] = {
            "llama": titan_reference(),
            "llama_separate_qkv": titan_reference(fuse_qkv=False),
            "moe": moe_reference(),
        }
    return out


def _owner_layout_resume(mesh: Any, ckpt: str) -> dict[str, torch.Tensor]:
    """The (dp=2, tp=2) checkpoint resumed on this package's 1D owner layout at W=2: each tp
    group ({0, 1} and {2, 3}) is one such layout (two identical runs, no second spawn); shard
    rank s takes the rows dp coordinate s took, and trains the remaining steps."""

    def built() -> tuple[Net, OwnerRoutedOptimizer]:
        model = fully_shard_model(build(), mesh=mesh["tp"])
        return model, OwnerRoutedOptimizer(
            model, matrix="torch_muon", matrix_options=MUON, tail="adamw", tail_options=ADAMW
        )

    model, opt = built()
    dcp_load(model, opt, ckpt, via=built())
    s = mesh["tp"].get_local_rank()
    for step in range(SAVE_AT, STEPS):
        x, y = batches()[step]
        lo, hi = s * BATCH // 2, (s + 1) * BATCH // 2
        model(x[lo:hi], y[lo:hi]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


@functools.cache
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="moo-tp-") as ckpt:
        return spawn_ranks(tp_job, 4, ckpt, threads_per_rank=1)


# -- the tests ---------------------------------------------------------------------------------------
def test_fsdp_x_tp_equals_one_process_torch_muon_adamw() -> None:
    ref = reference_run()
    for rank, r in enumerate(results()):
        t = r["train"]
        assert "_StridedShard" in t["placements"]["layers.0.w1.weight"], t["placements"]
        assert t["placements"]["layers.1.w2.weight"] == "(Shard(dim=0), Shard(dim=1))", t["placements"]
        for i, (a, b) in enumerate(zip(t["norms"], ref["norms"], strict=True)):
            assert abs(a - b) <= TP_NORM_RTOL * b, f"rank {rank} step {i}: clip norm {a} vs {b}"
        worst = max(rel(t["params"][n], p) for n, p in ref["params"].items())
        print(f"rank {rank}: worst parameter rel err {worst:.2e}")
        for n, p in ref["params"].items():
            assert rel(t["params"][n], p) <= TP_PARAM_RTOL, f"rank {rank}: {n} rel err {rel(t['params'][n], p):.2e}"
    # losses: each dp coordinate's micro-batch mean; the two average to the whole batch's
    res = results()
    for i, b in enumerate(ref["losses"]):
        a = (res[0]["train"]["losses"][i] + res[2]["train"]["losses"][i]) / 2
        assert abs(a - b) <= TP_LOSS_RTOL * abs(b), f"step {i}: loss {a} vs {b}"


def test_fsdp_x_tp_step_moves_what_bytes_per_step_says() -> None:
    for rank, r in enumerate(results()):
        t = r["train"]
        assert t["resyncs"] == 1, t["resyncs"]  # the owners' copies, built once
        assert set(t["ops"]) == {"owner_grad_all_to_all", "owner_update_all_to_all", "owner_grad_tp_all_gather"}, t
        assert t["sent"] + t["received"] == t["bytes_per_step"], (rank, t["sent"], t["received"], t["bytes_per_step"])
        print(f"rank {rank}: optimizer step sent {t['sent']} B, received {t['received']} B, by op {t['ops']}")


def test_torchtitan_parallelize_llama_equals_one_process() -> None:
    ref = titan_reference_run()
    for rank, r in enumerate(results()):
        got = r["llama"]
        assert got["placements"]["layers.0.attention.qkv_linear.wqkv.weight"].startswith("(_StridedShard"), got
        assert got["placements"]["layers.0.feed_forward.w2.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert got["placements"]["norm.weight"] == "(Shard(dim=0), Replicate())", got["placements"]
        assert got["routes"]["layers.1.attention.wo.weight"] == "matrix", got["routes"]
        assert got["routes"]["lm_head.weight"] != "matrix", got["routes"]
        # torch's clip_grad_norm_ over dp and tp: the one-process norm, on every rank
        for i, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
            assert abs(a - b) <= TP_NORM_RTOL * b, f"rank {rank} step {i}: clip norm {a} vs {b}"
        worst = max(rel(got["params"][n], p) for n, p in ref["params"].items())
        print(f"rank {rank}: torchtitan parallelize_llama, worst parameter rel err {worst:.2e}")
        for n, p in ref["params"].items():
            assert rel(got["params"][n], p) <= TITAN_PARAM_RTOL, (
                f"rank {rank}: {n} rel err {rel(got['params'][n], p):.2e}"
            )
    res = results()  # each dp coordinate's loss is its share of the global mean: they sum to it
    for i, b in enumerate(ref["losses"]):
        a = res[0]["llama"]["losses"][i] + res[2]["llama"]["losses"][i]
        assert abs(a - b) <= TP_LOSS_RTOL * abs(b), f"step {i}: loss {a} vs {b}"


def test_torchtitan_parallelize_llama_torch_muon_is_bitwise_in_lockstep() -> None:
    for rank, r in enumerate(results()):
        got = r["llama_lockstep"]
        for n, p in got["lockstep"].items():
            assert torch.equal(got["params"][n], p), f"rank {rank}: {n} differs from torch.optim.Muon in lockstep"


EXPERTS = ("w1_EFD", "w2_EDF", "w3_EFD")


def test_torchtitan_expert_parallel_equals_one_process() -> None:
    ref = moe_reference_run()
    res = results()
    for rank, r in enumerate(res):
        got = r["moe"]
        for n, (placements, mesh) in got["placements"].items():
            if n.endswith(EXPERTS):  # experts on the (efsdp, ep) mesh, the rest on fsdp
                assert (placements, mesh) == ("(_StridedShard(dim=0, sf=2), Shard(dim=0))", ("efsdp", "ep")), (n, mesh)
            else:
                assert mesh == ("fsdp",), (n, placements, mesh)
        experts = {n: route for n, route in got["routes"].items() if n.endswith(EXPERTS)}
        assert len(experts) == 6 and all(route["role"] == "matrix" for route in experts.values()), experts
        assert got["routes"]["layers.0.moe.router.gate.weight"]["role"] == "tail"
        worst = max(rel(got["params"][n], p) for n, p in ref["params"].items())
        print(f"rank {rank}: torchtitan Qwen3-MoE EP=2, worst parameter rel err {worst:.2e}")
        for n, p in ref["params"].items():
            assert rel(got["params"][n], p) <= MOE_PARAM_RTOL, (
                f"rank {rank}: {n} rel err {rel(got['params'][n], p):.2e}"
            )
    for i, b in enumerate(ref["losses"]):  # each rank's loss is its share of the global mean
        a = sum(r["moe"]["losses"][i] for r in res)
        assert abs(a - b) <= TP_LOSS_RTOL * abs(b), f"step {i}: loss {a} vs {b}"


def test_torchtitan_expert_parallel_steps_each_expert_exactly_on_its_owner() -> None:
    """Fed the same gradients, one process's Muon + AdamW over the whole model agree bitwise:
    each ep rank's experts, stepped expert by expert by their owner over efsdp, are the
    one-process step of those experts."""
    res = results()
    for rank, r in enumerate(res):
        got = r["moe"]
        for n, p in got["lockstep"].items():
            assert torch.equal(got["params"][n], p), f"rank {rank}: {n} differs from one process in lockstep"
        # owners are efsdp coordinates: the ranks holding the same experts ({0, 2} experts 0-1,
        # {1, 3} experts 2-3; rank = 2 * efsdp + ep) plan them among themselves, nothing over ep
        for n, route in got["routes"].items():
            if n.endswith(EXPERTS):
                assert route["owner"] in (0, 1) and route["local"] == (route["owner"] == rank // 2), (rank, n, route)
        assert set(got["ops"]) == {"owner_grad_all_to_all", "owner_update_all_to_all"}, got["ops"]
        assert got["sent"] + got["received"] == got["bytes_per_step"], (rank, got["sent"], got["bytes_per_step"])
        print(f"rank {rank}: EP optimizer step sent {got['sent']} B, received {got['received']} B, by op {got['ops']}")


def test_expert_parallel_checkpoint_resumes_exactly() -> None:
    """The experts' optimizer state is one global tensor in torch's state dicts, its rows on each
    ep coordinate's owner: the full state dict's momentum is the lockstep copy's, and a DCP
    checkpoint at step 1 resumed in a fresh model and optimizer repeats the run bit for bit."""
    for rank, r in enumerate(results()):
        got = r["moe"]
        want = got["lockstep_momentum"]
        assert torch.equal(got["momentum"].view(want.shape), want), f"rank {rank}: expert momentum differs"
        for n, p in got["params"].items():
            assert torch.equal(got["resumed"][n], p), f"rank {rank}: {n} differs after resuming"


def test_a_tp_group_owning_nothing_skips_the_tp_stage() -> None:
    want = one_matrix_reference()
    res = results()
    owner = res[0]["one_matrix"]["owner"]
    for rank, r in enumerate(res):
        got = r["one_matrix"]
        assert got["owner"] == owner, (rank, got["owner"], owner)
        assert rel(got["weight"], want) <= TP_PARAM_RTOL, f"rank {rank}: rel err {rel(got['weight'], want):.2e}"
        owns = rank // 2 == owner  # ranks (d, t) are 2 * d + t
        assert ("owner_grad_tp_all_gather" in got["ops"][1]) == owns, (rank, got["ops"])


def test_fsdp_x_tp_checkpoint_resumes_exactly() -> None:
    for rank, r in enumerate(results()):
        t, resumed = r["train"], r["resumed"]
        for n, p in t["saved"].items():
            assert torch.equal(resumed["loaded"][n], p), f"rank {rank}: {n} loaded differs from the saved"
        # the optimizer state (Muon momenta, Adam moments, steps) came back: without
        # set_optimizer_state_dict the resumed run differs at the first parameter
        for n, p in t["params"].items():
            assert torch.equal(resumed["params"][n], p), f"rank {rank}: {n} differs after resuming"


def test_fsdp_x_tp_checkpoint_resumes_on_the_owner_layout_at_two_ranks() -> None:
    want = results()[0]["train"]["params"]  # the (2, 2) run's last step
    for rank, got in enumerate(r["owner_layout_resumed"] for r in results()):
        worst = max(rel(got[n], p) for n, p in want.items())
        print(f"owner layout W=2 rank {rank}: worst parameter rel err to the (2, 2) run {worst:.2e}")
        for n, p in want.items():
            assert rel(got[n], p) <= TP_PARAM_RTOL, f"rank {rank}: {n} rel err {rel(got[n], p):.2e}"


def test_torchtitan_tp_checkpoint_moves_to_the_1d_layouts_and_back() -> None:
    """torchtitan's parallelize_llama on (dp=2, tp=2) saves model and optimizer with DCP at step
    1; the checkpoint loads bitwise (parameters and torch's full optimizer state) on this
    package's 1D owner layout at W=2 and W=4 and on stock FSDP2 at W=4; the W=4 owner layout's
    checkpoint at step 2 loads back on (2, 2). Every run continued to step 3 equals the
    uninterrupted one-process run at the noise floor."""
    ref = results()[0]["references"]["llama_separate_qkv"]["params"]
    _titan_checkpoint.check_round_trips([r["llama_checkpoint"] for r in results()], "tp", ref, TITAN_PARAM_RTOL)


def test_owner_layout_fully_shard_refuses_tp_blocks_at_the_call() -> None:
    """A TP block sharded over its own tp mesh is refused at the call, naming the parameter and
    the supported form (fully_shard over the dp dim of the (dp, tp) mesh)."""
    for r in results():
        msg = r["owner_layout"]
        assert msg.startswith("fully_shard(Block): parameter 'w1.weight' is a DTensor"), msg
        assert "(Shard(dim=0),)" in msg and "mesh=mesh['dp']" in msg, msg
        assert "torch.distributed.fsdp.fully_shard" in msg, msg


def test_unsupported_tp_and_ep_placements_are_refused_naming_them() -> None:
    for r in results():
        bad = r["bad"]
        msg = bad["rows_twice"]
        assert "'w'" in msg and "(Shard(dim=0), Shard(dim=0))" in msg and "RowwiseParallel" in msg, msg
        msg = bad["expert_tp"]
        assert "'w'" in msg and "(Shard(dim=0), Shard(dim=1))" in msg and "(efsdp, ep)" in msg, msg
        msg = bad["conv"]
        assert "'w'" in msg and "the 'conv' matrix view" in msg and "_StridedShard" in msg, msg


if __name__ == "__main__":  # the noise floor: the references against themselves, summation order changed
    runs = (
        ("two blocks", reference),
        ("torchtitan Llama3", titan_reference),
        ("torchtitan Llama3, separate q/k/v", functools.partial(titan_reference, fuse_qkv=False)),
        ("Qwen3-MoE", moe_reference),
    )
    for name, run in runs:
        a, b = run(), run("reversed")
        print(name, "params", max(rel(a["params"][n], b["params"][n]) for n in a["params"]))
        if "norms" in a:
            print(name, "norms", max(abs(x - y) / y for x, y in zip(a["norms"], b["norms"], strict=True)))
        print(name, "losses", max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"], strict=True)))
