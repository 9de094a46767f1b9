"""Expert parallel on the package's own ``fully_shard``: torchtitan's Qwen3-MoE, EP=2 on 4 gloo ranks.

torchtitan's ``model.parallelize(dims)`` (what its parallelize_qwen3 runs before FSDP) makes the
routed experts' stacks ``w1_EFD``/``w2_EDF``/``w3_EFD`` ``[E, ., .]`` DTensors ``Shard(0)`` on
its ``ep`` mesh (ep coordinate ``t`` holds experts ``[2t, 2t + 2)``) and wires the token
dispatch's all-to-all over ``ep``. Then the package's ``fully_shard`` per torchtitan's FSDP units
(``apply_fsdp`` before per-parameter meshes): each layer's experts module over the ``efsdp`` mesh
(the ranks holding the same experts), the embedding, each block, norm with head and the root
over the dense ``fsdp`` mesh (all 4 ranks), gradient division off. The experts' call stays a
tree of its own, nested in the block's (``sharding/nested.py``): each stack becomes an
owner-layout tensor on the 2D (efsdp, ep) mesh, ``(OwnerShard(0, ranges), Shard(0))``, ep
slice ``t`` (whole experts) held whole by one efsdp owner, as a TP slice is. One spawned job:

* ``OwnerRoutedOptimizer`` (this package's Muon, float32 Newton-Schulz, + AdamW), 3 steps of
  tests/_tp.py's ``moe_step`` batches, against ``moe_reference`` (one process, whole
  batch; computed on rank 0 in the spawn): parameters and losses;
* torch's ``clip_grad_norm_`` (``max_norm=inf``: the norm without changing the gradients) on
  every rank against the one-process norm; then a real clip (to half the norm) of one more
  backward's gradients: the norm after it is half on every rank (the coefficient, a 0-dim value
  on the dense 1D mesh, scales the experts' 2D gradients too);
* DCP of ``get_model_state_dict`` / ``get_optimizer_state_dict`` into a fresh model and
  optimizer: parameters and torch's full optimizer state (the experts' momenta as pieces of the
  stacks' 2D layout) load bitwise;
* the experts' placements, local pieces and DCP offsets; each stack's matrix state only on its
  owners; the optimizer step issues no collective (``CommCounter``): each owner steps its
  experts as a stack of matrices, expert by expert, the dense tensors are whole on their owners.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import pytest
import torch

from _ranks import spawn_ranks
from _ref import bitwise_equal, dcp_load, full_optimizer_state, full_param_copies, sharded_state
from _tolerances import MOE_PARAM_RTOL, TP_LOSS_RTOL, TP_NORM_RTOL
from _tp import (
    ADAMW,
    LLAMA_MUON,
    MOE_BATCH,
    MOE_STEPS,
    moe_reference,
    moe_step,
    rel,
    titan_optimizers,
)
from matrix_owner_optim import CommCounter, OwnerRoutedOptimizer
from matrix_owner_optim.preconditioners import Muon

# one xdist worker runs the module, so its cached gloo job (results()) spawns once per run
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("expert_parallel_owner")]

EXPERTS = ("w1_EFD", "w2_EDF", "w3_EFD")
EXPERTS_MODULE = "moe.routed_experts.inner_experts"


def _is_expert(name: str) -> bool:
    return name.endswith(EXPERTS)


def reference_norms() -> list[float]:
    """One process, the whole batch: the gradient norm ``clip_grad_norm_`` computes at each of
    ``moe_reference``'s steps (``max_norm=inf`` scales by 1: the run is ``moe_reference``'s)."""
    import _titan

    model = _titan.build(_titan.qwen3_moe_config(), _titan.parallelism())
    opts = titan_optimizers(model, Muon, LLAMA_MUON)
    norms = []
    for tokens, targets in _titan.batches(MOE_STEPS, MOE_BATCH, seed=3):
        _titan.loss(model, tokens, targets, tokens.numel()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        for o in opts:
            o.step()
            o.zero_grad()
    return norms


# -- the spawned job ----------------------------------------------------------------------------
def _owner_ep_model(W: int) -> tuple[torch.nn.Module, Any]:
    """torchtitan's Qwen3-MoE with EP=2 (``model.parallelize``), the package's fully_shard per
    torchtitan's FSDP units: experts over efsdp, everything else over fsdp (module docstring)."""
    import _titan
    from matrix_owner_optim import fully_shard
    from matrix_owner_optim.sharding import OwnerShardedModule

    par = _titan.parallelism(data_parallel_shard_degree=4, expert_parallel_degree=2)
    model = _titan.build(_titan.qwen3_moe_config(), par)
    dims = _titan.parallel_dims(par, W)
    model.parallelize(dims)  # EP only: the experts Shard(0) on ep, the dispatch over ep
    fsdp, efsdp = dims.get_mesh("fsdp"), dims.get_mesh("efsdp")
    fully_shard(model.tok_embeddings, mesh=fsdp)
    for layer in model.layers.values():
        fully_shard(layer.moe.routed_experts.inner_experts, mesh=efsdp)
        fully_shard(layer, mesh=fsdp)
    fully_shard([model.norm, model.lm_head], mesh=fsdp)
    fully_shard(model, mesh=fsdp)
    for m in model.modules():
        if isinstance(m, OwnerShardedModule):
            m.set_gradient_divide_factor(1.0)  # torchtitan's loss is divided by the global token count
    return model, dims


def _layout(model: torch.nn.Module) -> dict[str, Any]:
    """Per expert stack: placements, mesh, local shape, DCP's local shape and offset, owner."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from matrix_owner_optim.planning import get_matrix_shard

    out = {}
    for n, p in model.named_parameters():
        shard = get_matrix_shard(p)
        assert shard is not None, n
        dcp_shape, dcp_offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        out[n] = {
            "placements": repr(tuple(p.placements)),
            "mesh": tuple(p.device_mesh.mesh_dim_names or ()),
            "mesh_shape": tuple(p.device_mesh.shape),
            "local": tuple(p._local_tensor.shape),
            "dcp": (tuple(dcp_shape), tuple(dcp_offset)),
            "owner": shard.owner,
            "split": shard.is_split,
        }
    return out


def _refused(dims: Any) -> dict[str, str]:
    """What is refused, naming it: a plain module sharded over efsdp inside a call over fsdp (its
    gradient would be summed over half the ranks), and a stack cut inside each expert on ep
    (expert tensor parallel's ``Shard(1)``), at the optimizer's construction on every rank."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from matrix_owner_optim import fully_shard

    fsdp, efsdp, ep = dims.get_mesh("fsdp"), dims.get_mesh("efsdp"), dims.get_mesh("ep")
    out = {}
    block = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(block[0], mesh=efsdp)
    try:
        fully_shard(block, mesh=fsdp)
        out["plain_on_efsdp"] = "no error"
    except ValueError as exc:
        out["plain_on_efsdp"] = str(exc)

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(distribute_tensor(torch.ones(4, 8, 6), ep, [Shard(1)]))

    experts = fully_shard(Experts(), mesh=efsdp)
    try:
        OwnerRoutedOptimizer(experts, matrix="muon", matrix_options=LLAMA_MUON, tail="adamw", tail_options=ADAMW)
        out["cut_experts"] = "no error"
    except ValueError as exc:
        out["cut_experts"] = str(exc)
    return out


def _total_norm(model: torch.nn.Module) -> float:
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _clip_to_half(model: torch.nn.Module, rank: int) -> tuple[float, float]:
    """One more backward; torch's clip_grad_norm_ to half its norm: (norm before, norm after)."""
    moe_step(model, rank, 0)
    before = _total_norm(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), before / 2)
    return before, _total_norm(model)


def _state_dict_round_trip(model: torch.nn.Module, opt: Any, W: int, ckpt: str) -> dict[str, bool]:
    """DCP of torch's sharded model and optimizer state dicts, loaded into a fresh pair
    (``_ref.dcp_load``): parameters and torch's full optimizer state, bitwise."""
    import torch.distributed.checkpoint as dcp

    def fresh() -> tuple[torch.nn.Module, Any]:
        m, _ = _owner_ep_model(W)
        return m, OwnerRoutedOptimizer(m, matrix="muon", matrix_options=LLAMA_MUON, tail="adamw", tail_options=ADAMW)

    dcp.save(sharded_state(model, opt), checkpoint_id=ckpt)
    params, state = full_param_copies(model), full_optimizer_state(model, opt)
    resumed, resumed_opt = fresh()
    dcp_load(resumed, resumed_opt, ckpt, via=fresh())
    return {
        "params": bitwise_equal(full_param_copies(resumed), params),
        "optimizer": bitwise_equal(full_optimizer_state(resumed, resumed_opt), state),
        "expert_state": any(_is_expert(k.rsplit(".", 1)[0]) for k in state),
    }


def owner_ep_job(rank: int, W: int, ckpt: str) -> dict[str, Any]:
    model, dims = _owner_ep_model(W)
    opt = OwnerRoutedOptimizer(model, matrix="muon", matrix_options=LLAMA_MUON, tail="adamw", tail_options=ADAMW)
    out: dict[str, Any] = {"losses": [], "norms": [], "ops": [], "layout": _layout(model)}
    out["efsdp"] = dims.get_mesh("efsdp").get_local_rank()
    out["ep"] = dims.get_mesh("ep").get_local_rank()
    for step in range(MOE_STEPS):
        out["losses"].append(moe_step(model, rank, step).item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # scales by 1.0
        out["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        with CommCounter() as cc:
            opt.step()
        out["ops"].append(cc.by_op("optimizer"))
        opt.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    matrix = opt.matrix_optimizer
    assert matrix is not None
    out["matrix_state"] = sorted(
        names[id(rp.param)]
        for pl in opt.layouts()
        for rp in pl.entries
        if rp.proxy is not None and rp.proxy in matrix.state
    )
    out["routes"] = {r["name"]: r["role"] for r in opt.routes()}
    out["params"] = full_param_copies(model)
    out["clipped"] = _clip_to_half(model, rank)
    opt.zero_grad()
    out["state_dicts"] = _state_dict_round_trip(model, opt, W, ckpt)
    out["refused"] = _refused(dims)
    if rank == 0:  # the one-process references, where torchtitan is imported already
        out["reference"] = moe_reference()
        out["reference_norms"] = reference_norms()
    return out


@functools.cache
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="moo-owner-ep-") as ckpt:
        return spawn_ranks(owner_ep_job, 4, ckpt, threads_per_rank=1)


# -- the tests ---------------------------------------------------------------------------------------
def test_expert_parallel_on_the_owner_layout_equals_one_process() -> None:
    res = results()
    ref = res[0]["reference"]
    for rank, r in enumerate(res):
        worst = max(rel(r["params"][n], p) for n, p in ref["params"].items())
        print(f"rank {rank}: Qwen3-MoE EP=2 on the owner layout, worst parameter rel err {worst:.2e}")
        for n, p in ref["params"].items():
            assert rel(r["params"][n], p) <= MOE_PARAM_RTOL, f"rank {rank}: {n} rel err {rel(r['params'][n], p):.2e}"
        assert r["routes"]["layers.0.moe.router.gate.weight"] == "tail"
        assert all(role == "matrix" for n, role in r["routes"].items() if _is_expert(n))
    for i, b in enumerate(ref["losses"]):  # each rank's loss is its share of the global mean
        a = sum(r["losses"][i] for r in res)
        assert abs(a - b) <= TP_LOSS_RTOL * abs(b), f"step {i}: loss {a} vs {b}"


def test_gradient_norm_on_every_rank_equals_one_process() -> None:
    """torch's ``get_total_norm`` (``clip_grad_norm_``'s norm) over the dense 1D and the experts'
    2D tensors: each gradient's norm a partial value, their total the one-process norm."""
    res = results()
    want = res[0]["reference_norms"]
    for rank, r in enumerate(res):
        for i, (a, b) in enumerate(zip(r["norms"], want, strict=True)):
            assert abs(a - b) <= TP_NORM_RTOL * b, f"rank {rank} step {i}: gradient norm {a} vs {b}"


def test_clip_grad_norm_scales_every_gradient_on_every_rank() -> None:
    """torch's clip_grad_norm_ to half the norm: the coefficient (a 0-dim value on the dense 1D
    mesh) scales the dense 1D and the experts' 2D gradients alike, so the norm after is half."""
    for rank, r in enumerate(results()):
        before, after = r["clipped"]
        assert abs(after - before / 2) <= TP_NORM_RTOL * before, (rank, before, after)


def test_model_and_optimizer_state_dicts_round_trip_bitwise_through_dcp() -> None:
    for rank, r in enumerate(results()):
        assert r["state_dicts"] == {"params": True, "optimizer": True, "expert_state": True}, (rank, r["state_dicts"])


def test_expert_stacks_are_ep_slices_held_whole_by_their_efsdp_owner() -> None:
    res = results()
    for rank, r in enumerate(res):
        e, t = r["efsdp"], r["ep"]
        assert (e, t) == divmod(rank, 2), (rank, e, t)
        stacks = {n: lay for n, lay in r["layout"].items() if _is_expert(n)}
        assert len(stacks) == 6, sorted(stacks)
        for n, lay in stacks.items():
            E, *rest = res[0]["reference"]["params"][n].shape
            owner = lay["owner"]
            assert owner in (0, 1) and not lay["split"], (n, lay)
            ranges = tuple((0, E) if c == owner else (E, E) for c in range(2))
            assert lay["placements"] == f"(OwnerShard(dim=0, ranges={ranges}), Shard(dim=0))", (n, lay)
            assert lay["mesh"] == ("efsdp", "ep"), (n, lay)
            ep_slice = (E // 2, *rest)
            if e == owner:  # whole experts [2t, 2t + 2), DCP's offset theirs
                assert lay["local"] == ep_slice and lay["dcp"] == (ep_slice, (t * E // 2, 0, 0)), (rank, n, lay)
            else:
                assert lay["local"] == (0, *rest) and lay["dcp"][0] == lay["local"], (rank, n, lay)
            # both ep coordinates planned the same owners (global shapes, the same list)
            assert owner == res[rank ^ 1]["layout"][n]["owner"], (rank, n)
        dense = {n: lay for n, lay in r["layout"].items() if not _is_expert(n)}
        # the rest on the 1D owner layout over all 4 ranks (the fsdp group)
        # (the embedding and the head are 'rows' tensors: row blocks, Shard(0))
        for n, lay in dense.items():
            assert lay["mesh_shape"] == (4,), (n, lay)
            rows = n in ("tok_embeddings.weight", "lm_head.weight")
            assert lay["placements"].startswith("(Shard(dim=0)" if rows else "(OwnerShard"), (n, lay)


def test_expert_state_only_on_owners_and_the_step_issues_no_collective() -> None:
    for rank, r in enumerate(results()):
        e = r["efsdp"]
        experts = sorted(n for n in r["matrix_state"] if _is_expert(n))
        owned = sorted(n for n, lay in r["layout"].items() if _is_expert(n) and lay["owner"] == e)
        assert experts == owned, (rank, experts, owned)
        for i, ops in enumerate(r["ops"]):
            assert not ops, f"rank {rank} step {i}: the optimizer step issued {ops}"


def test_what_is_not_expert_parallel_is_refused_naming_it() -> None:
    for rank, r in enumerate(results()):
        msg = r["refused"]["plain_on_efsdp"]
        assert msg.startswith(
            "fully_shard(Sequential): its submodule '0' (OwnerShardedLinear) was passed to fully_shard with "
            "another mesh (2 ranks) than this call (4 ranks)"
        ), (rank, msg)
        assert msg.endswith("here its parameter 'weight' is not an expert-parallel slice (a DTensor on an ep mesh)")
        msg = r["refused"]["cut_experts"]
        assert msg.startswith("matrix 'w' is a 3D tensor (4, 8, 6) with placements"), (rank, msg)
        assert "Shard(dim=1)" in msg and "split by Shard(0) on ep" in msg, (rank, msg)
